"""Exact softmax attention over sets of keys, the torch reference every kernel must match.

A query reads several disjoint key sets (sinks, retrieved blocks, the local window, the
chunk's own keys). For a chunk of queries each set runs on the CPU flash kernel and the
partial results are merged by log-sum-exp; for one decode query the scores of all sets are
put through one softmax, which is cheaper than a kernel call per set.

bf16 on a CPU without bf16 products in hardware runs in fp32 on the widened values
(kvchat.native.cpu), and the output is rounded back to bf16.
"""

from __future__ import annotations

import torch

from kvchat.native.cpu import widened_products

from .merge import merge_partials

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q [n_heads, T, D] over k, v [n_kv, S, D]; returns out and fp32 LSE [n_heads, T].

    `causal` aligns the last query with the last key (the chunk attending to itself). Without a
    mask, the query heads of a GQA group are folded onto their KV head so keys are read once.
    """
    if widened_products(q.device, q.dtype):
        out, lse = partial_attention(q.float(), k.float(), v.float(), causal, scale)
        return out.to(q.dtype), lse
    n_heads, t, dim = q.shape
    n_kv = k.shape[0]
    group = n_heads // n_kv
    if causal:
        out, lse = _flash(
            q.unsqueeze(0),
            k.repeat_interleave(group, dim=0).unsqueeze(0),
            v.repeat_interleave(group, dim=0).unsqueeze(0),
            0.0,
            True,
            scale=scale,
        )
        return out[0], lse[0]
    out, lse = _flash(
        q.reshape(1, n_kv, group * t, dim), k.unsqueeze(0), v.unsqueeze(0), 0.0, False, scale=scale
    )
    return out.reshape(n_heads, t, dim), lse.reshape(n_heads, t)


def chunk_attention(
    q: torch.Tensor,
    past: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> torch.Tensor:
    """A chunk of queries over unmasked past key sets plus causal attention to itself.

    past: (q_for_this_set, k, v) triples, so a set may see the queries at other positions
    (InfLLM places retrieved blocks at a fixed distance). Empty sets are skipped.
    """
    outs, lses = [], []
    out, lse = partial_attention(q, k_new, v_new, causal=True)
    outs.append(out)
    lses.append(lse)
    for q_set, k, v in past:
        if k.shape[1]:
            out, lse = partial_attention(q_set, k, v, causal=False)
            outs.append(out)
            lses.append(lse)
    if len(outs) == 1:
        return outs[0]
    return merge_partials(outs, lses)[0]


def _per_head(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b for each head. Keys read in place (the local window buffer, the block store) are
    views whose head stride is not their rows' size; batched matmul takes a slow path on
    those (measured: 5x slower for a 4K window, 20x for 128K keys), one matmul per head
    does not."""
    if b.is_contiguous() or b.transpose(-1, -2).is_contiguous():
        return torch.matmul(a, b)
    return torch.stack([torch.matmul(a[h], b[h]) for h in range(a.shape[0])])


def decode_attention(
    parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One query token per head over several key sets with a single softmax.

    parts: (q [n_heads, 1, D], k [n_kv, S_i, D], v [n_kv, S_i, D]); empty sets are allowed.
    Returns the output [n_heads, 1, D] and the probabilities of the first set summed over each
    KV head's query group, [n_kv, S_0] fp32 (the attention its keys received).
    A plain matmul-softmax-matmul beats scaled_dot_product_attention for one query here.
    """
    q0 = parts[0][0]
    if widened_products(q0.device, q0.dtype):
        out, received = decode_attention([(q.float(), k.float(), v.float()) for q, k, v in parts])
        return out.to(q0.dtype), received
    n_heads, _, dim = q0.shape
    n_kv = parts[0][1].shape[0]
    group = n_heads // n_kv
    scores = [_per_head(q.reshape(n_kv, group, dim), k.transpose(1, 2)) for q, k, _ in parts]
    sizes = [s.shape[-1] for s in scores]
    probs = torch.softmax(torch.cat(scores, dim=-1).mul_(dim**-0.5), dim=-1, dtype=torch.float32)
    weights = probs.to(parts[0][2].dtype).split(sizes, dim=-1)
    out = None
    for (_, _, v), p in zip(parts, weights, strict=True):
        if p.shape[-1]:
            part = _per_head(p, v)
            out = part if out is None else out + part
    assert out is not None, "decode attention needs at least one key"
    return out.reshape(n_heads, 1, dim), probs[..., : sizes[0]].sum(dim=1)
