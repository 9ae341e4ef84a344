"""Exact softmax attention assembled from partial results, merged by log-sum-exp."""

from __future__ import annotations

import torch


def merge_partials(
    outs: list[torch.Tensor], lses: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attention outputs over disjoint key sets into attention over their union.

    outs[i]: [..., T, D] (any float dtype); lses[i]: [..., T] float32, the log-sum-exp of the
    scaled scores of each partial. Returns the merged output (dtype of outs[0]) and its LSE.
    """
    lse = torch.stack(lses).logsumexp(dim=0)
    merged = torch.zeros_like(outs[0], dtype=torch.float32)
    for out, part_lse in zip(outs, lses, strict=True):
        merged += out.float() * torch.exp(part_lse - lse).unsqueeze(-1)
    return merged.to(outs[0].dtype), lse
