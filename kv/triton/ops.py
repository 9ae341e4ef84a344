"""The Triton implementation of kv.kernels.AttentionOps (chosen by kv.kernels.attention_ops)."""

from __future__ import annotations

import torch

from .. import selection
from . import append, attention, scoring


class TritonOps:
    name = "triton"

    partial_attention = staticmethod(attention.partial_attention)
    sparse_attention = staticmethod(attention.sparse_attention)
    window_probs = staticmethod(attention.window_probs)
    score_blocks = staticmethod(scoring.score_blocks)
    write_blocks = staticmethod(append.write_blocks)

    @staticmethod
    def merge_partials(
        outs: list[torch.Tensor], lses: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return attention.merge_stacked(torch.stack(outs), torch.stack(lses), outs[0].dtype)

    @staticmethod
    def chunk_attention(
        q: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> torch.Tensor:
        """kv.attention.chunk_attention: causal over the chunk's own keys, unmasked over each
        past set (read with its own queries), merged by log-sum-exp."""
        parts = [attention.partial_attention(q, k_new, v_new, causal=True)]
        parts += [
            attention.partial_attention(q_set, k, v, causal=False)
            for q_set, k, v in past
            if k.shape[1]
        ]
        if len(parts) == 1:
            return parts[0][0]
        outs, lses = zip(*parts, strict=True)
        return attention.merge_stacked(torch.stack(outs), torch.stack(lses), q.dtype)[0]

    @staticmethod
    def decode_attention(
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """kv.attention.decode_attention: one query per head over several key sets; returns the
        output and the probabilities of the first set's keys summed per KV head's group."""
        done = [
            attention.partial_attention(q, k, v, causal=False) for q, k, v in parts if k.shape[1]
        ]
        if not done:
            raise ValueError("decode attention needs at least one key")
        if len(done) == 1:
            out, lse = done[0]
        else:
            outs, lses = zip(*done, strict=True)
            out, lse = attention.merge_stacked(torch.stack(outs), torch.stack(lses), outs[0].dtype)
        q0, k0, _ = parts[0]
        return out, attention.window_probs(q0, k0, lse)

    @staticmethod
    def select_top(scores: torch.Tensor, k: int) -> torch.Tensor:
        # torch.topk: no GPU measurement shows a Triton top-k beating it.
        return selection.select_top(scores, k)


TRITON_OPS = TritonOps()
