"""Choosing the next token: greedy and seeded sampling give the same token on every device."""

from __future__ import annotations

from dataclasses import replace

import torch

from kvchat.config import GenerationSettings
from kvchat.core.sampling import sample_next


def test_a_seed_draws_the_same_token_on_every_device(device):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, generator=gen)
    params = replace(
        GenerationSettings(), temperature=0.8, top_k=100, top_p=0.9, repetition_penalty=1.3
    )
    previous = [int(logits.argmax()), 17]  # the penalty moves the greedy choice
    draws = {}
    for where in ("cpu", device):
        seeded = torch.Generator().manual_seed(7)
        draws[where] = [sample_next(logits.to(where), params, previous, seeded) for _ in range(8)]
    assert draws["cpu"] == draws[device]
    assert len(set(draws[device])) > 1  # sampled, not greedy
    greedy = replace(params, temperature=0.0)
    chosen = {where: sample_next(logits.to(where), greedy, previous, None) for where in draws}
    assert chosen["cpu"] == chosen[device] != previous[0]
