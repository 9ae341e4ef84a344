"""Choosing the next token from logits: greedy, or temperature with top-k / top-p."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvchat.config import GenerationSettings


def apply_repetition_penalty(
    logits: torch.Tensor, previous: Sequence[int], penalty: float
) -> torch.Tensor:
    """CTRL-style penalty (as in transformers): shrink the logits of tokens already produced."""
    if penalty == 1.0 or not previous:
        return logits
    ids = torch.tensor(sorted(set(previous)), dtype=torch.long)
    picked = logits[ids]
    logits = logits.clone()
    logits[ids] = torch.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def sample_next(
    logits: torch.Tensor,
    params: GenerationSettings,
    previous: Sequence[int],
    generator: torch.Generator | None,
) -> int:
    """The next token id from fp32 logits [vocab]; `previous` are the reply's tokens so far."""
    logits = apply_repetition_penalty(logits, previous, params.repetition_penalty)
    if params.temperature == 0.0:
        return int(torch.argmax(logits))
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        # Drop a token when the tokens before it already reach top_p; the first always stays.
        drop = (cumulative - torch.softmax(sorted_logits, dim=-1)) >= params.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    # Drawn on the host with the host generator: a seed gives the same draw on every device.
    probs = torch.softmax(logits, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))
