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
    stacked = torch.stack(lses)
    lse = stacked.logsumexp(dim=0)
    weights = torch.exp(stacked - lse).unsqueeze(-1)
    # One fused pass a part: a prefill chunk merges four [heads, 2048, D] parts per layer.
    merged = outs[0] * weights[0]  # fp32, a new tensor whatever the parts' dtype
    for out, weight in zip(outs[1:], weights[1:], strict=True):
        merged.addcmul_(out, weight)
    return merged.to(outs[0].dtype), lse
