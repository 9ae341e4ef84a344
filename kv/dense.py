"""Dense attention: every query reads every earlier key; the reference for the sparse cache.

On the CPU the torch functions of kv/attention.py compute it; where kv/kernels.py picks the
Triton kernels (CUDA), one causal kernel call per layer reads every key.
"""

from __future__ import annotations

import torch

from kvchat.config.enums import AttentionMode, PositionMode

from .attention import chunk_attention, decode_attention
from .backend import AttentionBackend, CacheStats, check_capacity
from .kernels import TORCH_OPS, attention_ops, rotation
from .positions import RopeTables
from .state import CacheState


class DenseBackend(AttentionBackend):
    """Keys (after RoPE, absolute positions) and values of every token, per layer, in one buffer."""

    name = AttentionMode.DENSE

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        rope: RopeTables,
        dtype: torch.dtype,
        device: torch.device | str,
        max_tokens: int,
        ops_backend: str | None = None,
    ) -> None:
        """ops_backend: see kv.kernels.attention_ops (None: KVCHAT_ATTENTION_OPS, else auto)."""
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.rope, self.dtype, self.device = rope, dtype, torch.device(device)
        self.ops = attention_ops(self.device, ops_backend)
        self._rotate = rotation(self.device, dtype, ops_backend)
        self.max_tokens = max_tokens
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._capacity = 0
        self._length = 0
        self._n_new = 0
        self._cos = self._sin = torch.empty(0)

    @property
    def length(self) -> int:
        return self._length

    def reserve(self, n_tokens: int) -> None:
        # A known size, which the plan counts: grown by doubling, the cache could hold up to
        # twice it.
        self._resize(min(n_tokens, self.max_tokens))

    def _grow(self, needed: int) -> None:
        if needed > self._capacity:
            # Doubling keeps the copies of a long chunked prefill linear in total.
            self._resize(min(max(needed, 2 * self._capacity, 256), self.max_tokens))

    def _resize(self, capacity: int) -> None:
        if capacity <= self._capacity:
            return
        shape = (self.n_kv_heads, capacity, self.head_dim)
        keep = self._length
        for store in (self._k, self._v):
            for i in range(self.n_layers):
                fresh = torch.empty(shape, dtype=self.dtype, device=self.device)
                if i < len(store):
                    fresh[:, :keep] = store[i][:, :keep]
                    store[i] = fresh
                else:
                    store.append(fresh)
        self._capacity = capacity

    def begin(self, n_new: int) -> None:
        end = self._length + n_new
        check_capacity(end, self.max_tokens)
        self._grow(end)
        self._n_new = n_new
        self._cos, self._sin = self.rope.cos_sin(self._length, n_new, self.dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        start, end = self._length, self._length + self._n_new
        q = self._rotate(q, self._cos, self._sin)
        k = self._rotate(k, self._cos, self._sin)
        keys, values = self._k[layer], self._v[layer]
        keys[:, start:end] = k
        values[:, start:end] = v
        if self.ops is not TORCH_OPS:
            return self.ops.partial_attention(q, keys[:, :end], values[:, :end], causal=True)[0]
        if self._n_new == 1:
            return decode_attention([(q, keys[:, :end], values[:, :end])])[0]
        return chunk_attention(q, [(q, keys[:, :start], values[:, :start])], k, v)

    def commit(self) -> None:
        self._length += self._n_new
        self._n_new = 0

    def abort(self) -> None:
        self._n_new = 0

    def truncate(self, n_tokens: int) -> None:
        self._length = min(self._length, max(n_tokens, 0))

    def decode_read_bytes(self) -> int:
        per_token = 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        return per_token * (self._length + 1)

    def stats(self) -> CacheStats:
        per_token = 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.dtype.itemsize
        return CacheStats(
            backend=self.name,
            tokens=self._length,
            capacity_tokens=self._capacity,
            kv_bytes=per_token * self._capacity,
            kv_dtype=str(self.dtype).removeprefix("torch."),
            position_mode=PositionMode.NATIVE,
        )

    def export_state(self) -> CacheState:
        n = self._length
        tensors = {}
        for i, (k, v) in enumerate(zip(self._k, self._v, strict=True)):
            tensors[f"{i}.k"], tensors[f"{i}.v"] = k[:, :n], v[:, :n]
        return CacheState({"length": n}, tensors)

    @torch.inference_mode()  # the buffers may have been made inside the model's inference mode
    def load_state(self, state: CacheState) -> None:
        n = state.scalar("length")
        check_capacity(n, self.max_tokens)
        self._grow(n)
        self._length = n
        state.restore(self.export_state().tensors)
