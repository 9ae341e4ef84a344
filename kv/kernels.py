"""One dispatch point for the cache's compute: Triton kernels on CUDA, the torch reference on
the CPU.

`attention_ops(device)` returns an object with the same methods either way, so the cache calls
`ops.sparse_attention(...)` without knowing which implementation runs. The torch methods are
the reference functions of kv/attention.py, kv/merge.py, kv/selection.py and kv/quant.py (or
compositions of them); the Triton ones live in kv/triton/ and are imported only when chosen,
so kvchat imports and runs without Triton installed.

The torch reference runs on the CPU only (kv/attention.py calls the CPU flash kernel), so CUDA
always gets the Triton kernels. On the CPU, `auto` also uses the C++ kernels
(kv/cpu_kernel.py) for the block-sparse cache's decode attention and block selection, where
they build. The environment
variable KVCHAT_ATTENTION_OPS (auto, torch, triton; read here and nowhere else) forces a
choice: `torch` is the reference alone; `triton` on a CPU with TRITON_INTERPRET=1 runs the
kernels in the interpreter, which is how the CPU tests drive the GPU code path.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import cache
from types import ModuleType
from typing import Protocol

import torch

from . import attention, merge, selection
from .positions import rotate
from .quant import BlockPool

OPS_BACKENDS = ("auto", "torch", "triton")
OPS_ENV = "KVCHAT_ATTENTION_OPS"


class AttentionOps(Protocol):
    """What the block-sparse cache computes, in one implementation or the other."""

    name: str

    def partial_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def chunk_attention(
        self,
        q: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> torch.Tensor: ...

    def decode_attention(
        self, parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def merge_partials(
        self, outs: list[torch.Tensor], lses: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def sparse_attention(
        self,
        q_local: torch.Tensor,
        q_far: torch.Tensor,
        local_k: torch.Tensor,
        local_v: torch.Tensor,
        sink_k: torch.Tensor,
        sink_v: torch.Tensor,
        k_pool: BlockPool | None,
        v_pool: BlockPool | None,
        slots: torch.Tensor | None,
        causal: bool = True,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def window_probs(
        self, q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor: ...

    def score_blocks(
        self,
        q: torch.Tensor,
        anchors: torch.Tensor,
        anchor_type: str,
        mode: str,
        candidates: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def select_top(self, scores: torch.Tensor, k: int) -> torch.Tensor: ...

    def write_blocks(self, pool: BlockPool, slots: torch.Tensor, blocks: torch.Tensor) -> None: ...


class TorchOps:
    """The reference implementation, on CPU tensors (the attention calls the CPU flash kernel)."""

    name = "torch"

    @staticmethod
    def partial_attention(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return attention.partial_attention(q, k, v, causal, scale)

    @staticmethod
    def chunk_attention(
        q: torch.Tensor,
        past: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        k_new: torch.Tensor,
        v_new: torch.Tensor,
    ) -> torch.Tensor:
        return attention.chunk_attention(q, past, k_new, v_new)

    @staticmethod
    def decode_attention(
        parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return attention.decode_attention(parts)

    @staticmethod
    def merge_partials(
        outs: list[torch.Tensor], lses: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return merge.merge_partials(outs, lses)

    @staticmethod
    def sparse_attention(
        q_local: torch.Tensor,
        q_far: torch.Tensor,
        local_k: torch.Tensor,
        local_v: torch.Tensor,
        sink_k: torch.Tensor,
        sink_v: torch.Tensor,
        k_pool: BlockPool | None,
        v_pool: BlockPool | None,
        slots: torch.Tensor | None,
        causal: bool = True,
        scale: float | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention over local keys (q_local; causal with the last query on the last key),
        sinks and the blocks at `slots` [n_kv, n_sel] of the pools (q_far), as the merge of
        exact partial attentions. Returns out [n_heads, T, D] and fp32 LSE [n_heads, T]."""
        t_len = q_local.shape[1]
        # The CPU flash kernel aligns a causal mask top-left, so the local keys are split into
        # the unmasked past and the queries' own keys (square, where both alignments agree).
        past = local_k.shape[1] - t_len if causal else local_k.shape[1]
        if past < 0:
            raise ValueError(
                f"causal local keys ({local_k.shape[1]}) must include the {t_len} queries' keys"
            )
        sets = [(q_local, local_k[:, :past], local_v[:, :past], False)]
        if causal:
            sets.append((q_local, local_k[:, past:], local_v[:, past:], True))
        sets.append((q_far, sink_k, sink_v, False))
        if slots is not None and slots.shape[1]:
            if k_pool is None or v_pool is None:
                raise ValueError("sparse_attention: slots given without block pools")
            sets.append((q_far, *gather_blocks(k_pool, v_pool, slots, q_local.dtype), False))
        outs, lses = [], []
        for q, k, v, is_causal in sets:
            if k.shape[1]:
                out, lse = attention.partial_attention(q, k, v, is_causal, scale)
                outs.append(out)
                lses.append(lse)
        if not outs:
            raise ValueError("sparse_attention needs at least one key")
        if len(outs) == 1:
            return outs[0], lses[0]
        return merge.merge_partials(outs, lses)

    @staticmethod
    def window_probs(
        q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float | None = None
    ) -> torch.Tensor:
        """Probabilities one decode query per head [n_heads, 1, D] gave keys k [n_kv, S, D],
        given the LSE [n_heads, 1] of its whole attention, summed per group: [n_kv, S] fp32."""
        n_kv, _, dim = k.shape
        group = q.shape[0] // n_kv
        scale = dim**-0.5 if scale is None else scale
        scores = torch.matmul(q.float().reshape(n_kv, group, dim), k.float().transpose(1, 2))
        return torch.exp(scores * scale - lse.reshape(n_kv, group, 1)).sum(dim=1)

    @staticmethod
    def score_blocks(
        q: torch.Tensor,
        anchors: torch.Tensor,
        anchor_type: str,
        mode: str,
        candidates: torch.Tensor | None = None,
    ) -> torch.Tensor:
        chosen = anchors if candidates is None else anchors[candidates]
        return selection.score_blocks(q, chosen, anchor_type, mode)

    @staticmethod
    def select_top(scores: torch.Tensor, k: int) -> torch.Tensor:
        return selection.select_top(scores, k)

    @staticmethod
    def write_blocks(pool: BlockPool, slots: torch.Tensor, blocks: torch.Tensor) -> None:
        pool.write(slots, blocks)


def gather_blocks(
    k_pool: BlockPool, v_pool: BlockPool, slots: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks at slots [n_kv, n_sel], dequantized: k, v [n_kv, n_sel * block, D]."""
    n_kv, n_sel = slots.shape
    if n_sel == 0:
        empty = torch.empty(n_kv, 0, k_pool.head_dim, dtype=dtype, device=k_pool.device)
        return empty, empty
    flat = slots.reshape(-1).to(device=k_pool.device, dtype=torch.long)
    shape = (n_kv * n_sel, k_pool.block_size, k_pool.head_dim)
    k = k_pool.gather(flat, torch.empty(shape, dtype=dtype, device=k_pool.device))
    v = v_pool.gather(flat, torch.empty(shape, dtype=dtype, device=v_pool.device))
    return k.view(n_kv, -1, k_pool.head_dim), v.view(n_kv, -1, v_pool.head_dim)


TORCH_OPS = TorchOps()


@cache
def triton_available() -> bool:
    """Triton imports here (the CPU torch wheel does not depend on it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    """Triton kernels run on the CPU, in the interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


def attention_ops(device: torch.device | str, backend: str | None = None) -> AttentionOps:
    """The implementation for tensors on `device`.

    backend None: the value of KVCHAT_ATTENTION_OPS, else auto. auto: Triton on CUDA, torch
    elsewhere. torch / triton force one; torch is refused on CUDA (its attention is CPU-only),
    and triton on a CPU needs TRITON_INTERPRET=1 set before the first kernel module is
    imported (the interpreter is for tests and dry runs: slow, and wrong in bf16).
    """
    source, backend = _resolve(backend)
    device = torch.device(device)
    if device.type == "cuda" and backend == "torch":
        raise RuntimeError(
            "the torch attention ops run on the CPU only (kv/attention.py uses the CPU flash "
            f"kernel); on CUDA set {source} to auto or triton"
        )
    if device.type != "cuda" and backend != "triton":
        return TORCH_OPS
    if not triton_available():
        what = "attention on CUDA" if device.type == "cuda" else "the triton ops backend"
        raise RuntimeError(f"{what} needs Triton installed (pip install triton)")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"Triton kernels need a CUDA device, or TRITON_INTERPRET=1 to run on {device.type}"
        )
    from .triton.ops import TRITON_OPS

    return TRITON_OPS


def cpu_kernels(device: torch.device | str, backend: str | None = None) -> ModuleType | None:
    """The C++ CPU kernels' module when `backend` resolves to auto on a CPU and they build."""
    if torch.device(device).type != "cpu" or _resolve(backend)[1] != "auto":
        return None
    from . import cpu_kernel

    return cpu_kernel.load()


def rotation(
    device: torch.device | str, dtype: torch.dtype, backend: str | None = None
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """kv.positions.rotate, or for bf16 where the CPU kernels run their bit-identical one."""
    if dtype == torch.bfloat16 and cpu_kernels(device, backend) is not None:
        from . import cpu_kernel

        return cpu_kernel.rotate
    return rotate


def _resolve(backend: str | None) -> tuple[str, str]:
    """(where the choice came from, the backend), checked."""
    source = "backend"
    if backend is None:
        source, backend = OPS_ENV, os.environ.get(OPS_ENV) or "auto"
    if backend not in OPS_BACKENDS:
        raise ValueError(
            f"unknown ops backend {backend!r} ({source}); choose one of {OPS_BACKENDS}"
        )
    return source, backend
