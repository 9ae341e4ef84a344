"""How the sparse cache's layers compute attention: one path per cache, chosen at
construction (`choose_path`), behind one interface.

- TorchPath: blocks are gathered (dequantized) from the store into a buffer and read with
  the torch attention; the device block cache only counts what a GPU would copy.
- CpuKernelPath: a decode step reads the window, the sinks and the selected blocks where
  they lie (quantized ones dequantized in the kernel) in one C++ pass, and selection scores
  and ranks the candidates in one pass too (kv/cpu_kernel.py); prefill is TorchPath's.
- FusedCpuPath (bf16): a decode step's ranking layer is one C++ call (kv/csrc/decode_layer.cpp:
  rotations, window write, selection, attention).
- TritonPath (CUDA; the CPU under TRITON_INTERPRET=1, for tests): the selected blocks are
  copied into a DeviceBlockTier (kv/cuda_tier.py), from whose slots one sparse_attention
  kernel reads them in kv_type with the window and the sinks.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from kvchat.config import AnchorType, HeadSelectMode, KvType, LongContextSettings

from .. import cpu_kernel
from ..attention import chunk_attention, decode_attention
from ..cuda_tier import DeviceBlockTier
from ..device_cache import DeviceBlockCache
from ..kernels import TORCH_OPS, attention_ops, cpu_kernels
from ..selection import pin, score_blocks, select_top
from .geometry import SINK_BLOCKS, CacheGeometry
from .layer import LayerState

if TYPE_CHECKING:
    from .cache import SparseBackend

_KERNEL_HEAD_DIMS = (32, 64, 128, 256)


class PassInputs(NamedTuple):
    """A layer's part of a pass, its keys and values already written to the window."""

    qa: torch.Tensor  # queries rotated at their positions, [n_heads, n, D]
    q_far: torch.Tensor  # queries as they read sinks and blocks (qa in native mode)
    ka: torch.Tensor  # the pass's keys, rotated, [n_kv, n, D]
    v: torch.Tensor
    ws: int  # window column of the window's first token
    o: int  # window column of the pass's first token


class AttendPath:
    """A layer's attention over the window, the sinks and its selected blocks."""

    device_cache: DeviceBlockCache | DeviceBlockTier
    # Whether a dense layer's blocks are read in place as one run per head (else gathered).
    dense_span_in_place = False

    def __init__(self, cache: SparseBackend, ops_backend: str | None) -> None:
        self.cache = cache

    def begin(self, n_new: int) -> None:
        """A pass of n_new tokens starts (the window's bounds are set)."""

    def decode_step(
        self, layer: int, st: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor | None:
        """A whole decode step of a ranking layer, unrotated inputs to output, where the path
        does it in one call; None where it does not."""
        return None

    def decode(self, layer: int, st: LayerState, x: PassInputs) -> torch.Tensor:
        """One query (its key and value already at window column o)."""
        raise NotImplementedError

    def prefill(self, layer: int, st: LayerState, x: PassInputs) -> torch.Tensor:
        """A chunk of queries whose keys and values start at window column o."""
        raise NotImplementedError

    def rank(self, st: LayerState, query: torch.Tensor) -> torch.Tensor:
        """The second_select_num candidates that score highest for `query` [n_heads, D],
        led by the pinned blocks."""
        candidates = self.cache.selector.candidates(st)
        scores = self.score(st, query, candidates)
        pin(scores, candidates, self.cache.selector.pinned)
        return candidates[select_top(scores, self.cache.lc.second_select_num).cpu()]

    def score(self, st: LayerState, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        """Scores of the candidates' anchors for `query` (kv/selection.py's score_blocks)."""
        raise NotImplementedError

    def reads_in_place(self, layer: int) -> bool:
        """Whether a decode step reads this layer's selected blocks where they are (a
        kernel), rather than gathering them into a buffer first."""
        return False

    def scratch_bytes(self) -> int:
        """Memory besides window and sinks that the path keeps on the compute device."""
        raise NotImplementedError


class TorchPath(AttendPath):
    def __init__(self, cache: SparseBackend, ops_backend: str | None) -> None:
        super().__init__(cache, ops_backend)
        geom, lc = cache.geom, cache.lc
        self.dense_span_in_place = lc.kv_type == KvType.FP16
        group = geom.n_kv_heads if lc.head_select_mode == HeadSelectMode.SHARED else 1
        self.device_cache = DeviceBlockCache(
            geom.n_layers,
            cache.device_slots(),
            2 * cache.layers[0].k_pool.bytes_per_slot,
            group,
            cpu_kernels(geom.device, ops_backend),
        )

    def decode(self, layer: int, st: LayerState, x: PassInputs) -> torch.Tensor:
        far_k, far_v = self.retrieve(layer, st, x.q_far)
        window = (x.qa, st.win_k[:, x.ws : x.o + 1], st.win_v[:, x.ws : x.o + 1])
        out, received = decode_attention([window, (x.q_far, far_k, far_v)])
        if st.received is not None:
            st.received[:, x.ws : x.o + 1] += received
        return out

    def prefill(self, layer: int, st: LayerState, x: PassInputs) -> torch.Tensor:
        far_k, far_v = self.retrieve(layer, st, x.q_far)
        window = (x.qa, st.win_k[:, x.ws : x.o], st.win_v[:, x.ws : x.o])
        return chunk_attention(x.qa, [window, (x.q_far, far_k, far_v)], x.ka, x.v)

    def score(self, st: LayerState, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        lc = self.cache.lc
        # Without preselection the candidates are one run of blocks: score their anchors in
        # place instead of copying them (a copy of every anchor, per layer, per token).
        anchors = (
            st.anchors[SINK_BLOCKS : self.cache.n_anchored]
            if st.preselected is None
            else st.anchors[candidates]
        )
        return score_blocks(query, anchors, lc.anchor_type, lc.head_select_mode)

    def retrieve(
        self, layer: int, st: LayerState, q_far: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the sink block (when the window starts after it) and the
        selected blocks as one key set, [n_kv, S, D] each: both are read with q_far, and one
        set costs one matmul pair (decode) or one kernel call (prefill) less per layer than
        two."""
        cache = self.cache
        n_kv, dim = cache.geom.n_kv_heads, cache.geom.head_dim
        blocks = cache.selector.select(layer, st, q_far, self.rank)
        lead = SINK_BLOCKS if cache.has_sinks() else 0
        if blocks is None:
            blocks = torch.empty(0, dtype=torch.long)
        if lead + blocks.shape[-1] == 0:
            return st.sink_k[:, :0], st.sink_v[:, :0]
        exact = st.k_pool.kv_type == KvType.FP16  # the store's copy of the sinks is exact
        if layer < cache.lc.dense_layer_num and exact:
            # Every candidate is read: one contiguous run per head, read in place (no copy
            # of what may be the whole context); the sinks are the run's first block.
            first, last = SINK_BLOCKS - lead, cache.n_anchored
            return st.k_pool.span(n_kv, first, last), st.v_pool.span(n_kv, first, last)
        self.count_reads(layer, blocks)
        selected = cache.slots(blocks)
        # Each head's sink block (block 0) leads its run; head_base is exactly those slots.
        slots = (torch.cat([cache.head_base, selected], dim=1) if lead else selected).reshape(-1)
        gk, gv = cache.gather_buffer(len(slots))
        k = st.k_pool.gather(slots, gk).view(n_kv, -1, dim)
        v = st.v_pool.gather(slots, gv).view(n_kv, -1, dim)
        if lead and not exact:
            # Sinks stay in full precision; the store only has them quantized.
            k[:, : cache.block] = st.sink_k
            v[:, : cache.block] = st.sink_v
        return k, v

    def count_reads(self, layer: int, blocks: torch.Tensor) -> None:
        """Count with the device cache that `layer` reads `blocks` ([k] shared or [n_kv, k])."""
        cache = self.cache
        # SHARED: one selection for every head, so its block ids are the cache's keys (each
        # the group of its heads' slots); SEPARATE: the slots themselves.
        keys = (
            blocks
            if cache.lc.head_select_mode == HeadSelectMode.SHARED
            else cache.head_base + blocks
        )
        self.device_cache.touch(layer, keys)

    def scratch_bytes(self) -> int:
        return self.cache.gather_bytes()


class CpuKernelPath(TorchPath):
    def __init__(self, cache: SparseBackend, ops_backend: str | None) -> None:
        super().__init__(cache, ops_backend)
        self.heads = torch.arange(cache.geom.n_kv_heads).unsqueeze(1)
        # Where each head's sink block starts in the sink buffers.
        self.sink_starts = self.heads * cache.block * cache.geom.head_dim

    def begin(self, n_new: int) -> None:
        if n_new == 1:
            # Where each head's window starts in the window buffer, the same for every layer
            # of the step.
            cache = self.cache
            ws = cache.window_start - cache.win_base
            self.window_starts = (self.heads * cache.win_cap + ws) * cache.geom.head_dim

    def decode(self, layer: int, st: LayerState, x: PassInputs) -> torch.Tensor:
        """The window (columns ws..o, read with qa), the sinks and the retrieved blocks (read
        with q_far) in one softmax."""
        cache = self.cache
        b, dim, n_kv = cache.block, cache.geom.head_dim, cache.geom.n_kv_heads
        qa, q_far = x.qa, x.q_far
        sets: list[tuple] = [(st.win_k, st.win_v, 0, dim, x.o + 1 - x.ws, self.window_starts)]
        if not self.reads_in_place(layer):
            # Every block of a dense layer in INT8 / INT4 is dequantized into the gather
            # buffer first (sinks included).
            k, v = self.retrieve(layer, st, q_far)
            if k.shape[1]:
                sets.append((k, v, 1, dim, k.shape[1], self.heads * k.shape[1] * dim))
            return cpu_kernel.decode_attention(qa, q_far, sets, n_kv)
        if cache.has_sinks():
            sets.append((st.sink_k, st.sink_v, 1, dim, b, self.sink_starts))
        blocks = cache.selector.select(layer, st, q_far, self.rank)
        pool_k, pool_v = st.k_pool.storage, st.v_pool.storage
        if blocks is not None and layer < cache.lc.dense_layer_num:
            # Every candidate: one run per head, as retrieve's in-place span.
            rows = (cache.n_anchored - SINK_BLOCKS) * b
            starts = (cache.head_base + SINK_BLOCKS) * b * dim
            sets.append((pool_k, pool_v, 1, dim, rows, starts))
        elif blocks is not None and blocks.shape[-1]:
            self.count_reads(layer, blocks)
            # Quantized blocks are read where they lie too (0.53x / 0.31x the bytes of FP16),
            # from byte offsets, and dequantized in the kernel.
            kv_type = cache.lc.kv_type
            unit = b * dim if kv_type == KvType.FP16 else st.k_pool.bytes_per_slot
            sets.append((pool_k, pool_v, 1, dim, b, cache.slots(blocks) * unit, kv_type))
        return cpu_kernel.decode_attention(qa, q_far, sets, n_kv)

    def rank(self, st: LayerState, query: torch.Tensor) -> torch.Tensor:
        if st.preselected is not None:
            return super().rank(st, query)
        cache, lc = self.cache, self.cache.lc
        return cpu_kernel.select_blocks(
            query,
            st.anchors,
            SINK_BLOCKS,
            cache.n_anchored,
            lc.second_select_num,
            lc.anchor_type,
            lc.head_select_mode,
            cache.selector.pinned,
        )

    def reads_in_place(self, layer: int) -> bool:
        """FP16 blocks, and quantized blocks that selection picked, are read from the store;
        a dense layer's quantized blocks from the gather buffer."""
        return self.cache.lc.kv_type == KvType.FP16 or layer >= self.cache.lc.dense_layer_num


class FusedCpuPath(CpuKernelPath):
    def __init__(self, cache: SparseBackend, ops_backend: str | None) -> None:
        super().__init__(cache, ops_backend)
        lc, geom = cache.lc, cache.geom
        self.layer_kernels = []
        for layer, st in enumerate(cache.layers):
            unit = (
                cache.block * geom.head_dim
                if lc.kv_type == KvType.FP16
                else st.k_pool.bytes_per_slot
            )
            self.layer_kernels.append(
                cpu_kernel.decode_layer(
                    st.win_k,
                    st.win_v,
                    st.win_store_k,
                    st.sink_k,
                    st.sink_v,
                    st.k_pool.storage,
                    st.v_pool.storage,
                    lc.kv_type,
                    unit,
                    cache.max_blocks,
                    st.anchors,
                    lc.anchor_type,
                    lc.head_select_mode,
                    self.device_cache.lru,
                    layer,
                )
            )

    def decode_step(
        self, layer: int, st: LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor | None:
        """The steps of the cache's attend and CpuKernelPath.decode (rotations, window
        writes, selection, attention) in one C++ call, without a dozen Python-level ops."""
        cache, selector = self.cache, self.cache.selector
        known, blocks = selector.known(layer, st)
        out, ranked = self.layer_kernels[layer].decode(
            q,
            k,
            v,
            *cache.rotations(),
            cache.length - cache.win_base,
            cache.window_start - cache.win_base,
            cache.has_sinks(),
            blocks,
            SINK_BLOCKS,
            cache.n_anchored,
            0 if known else cache.lc.second_select_num,
            selector.pinned,
        )
        if not known:
            blocks = selector.remember(st, ranked, decoding=True)
        cache.store_blocks(st, (cache.length + 1) // cache.block)
        selector.last[layer] = blocks
        return out


class TritonPath(AttendPath):
    def __init__(self, cache: SparseBackend, ops_backend: str | None) -> None:
        super().__init__(cache, ops_backend)
        self.ops = cache.ops
        self.tier = DeviceBlockTier(
            [st.k_pool for st in cache.layers],
            [st.v_pool for st in cache.layers],
            cache.device_slots(),
            cache.geom.device,
        )
        self.device_cache = self.tier
        self.block_ids = torch.arange(cache.max_blocks, device=cache.geom.device)

    def decode(self, layer: int, st: LayerState, x: PassInputs) -> torch.Tensor:
        out, lse = self._attend(layer, st, x, x.o + 1)
        if st.received is not None:
            window = st.win_k[:, x.ws : x.o + 1]
            st.received[:, x.ws : x.o + 1] += self.ops.window_probs(x.qa, window, lse)
        return out

    def prefill(self, layer: int, st: LayerState, x: PassInputs) -> torch.Tensor:
        return self._attend(layer, st, x, x.o + x.qa.shape[1])[0]

    def _attend(
        self, layer: int, st: LayerState, x: PassInputs, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The window (causal on its tail, the pass's own keys), the sinks and the selected
        blocks, fetched into the tier, in one sparse_attention."""
        cache, tier = self.cache, self.tier
        qa, q_far, ws = x.qa, x.q_far, x.ws
        blocks = cache.selector.select(layer, st, q_far, self.rank)
        if blocks is None:
            blocks = torch.empty(0, dtype=torch.long)
        store_slots = cache.slots(blocks)
        sinks = cache.has_sinks()
        sink_k = st.sink_k if sinks else st.sink_k[:, :0]
        sink_v = st.sink_v if sinks else st.sink_v[:, :0]
        # A layer may read more blocks than its tier slots (a dense layer, or a reused
        # selection that blocks leaving the window joined): they pass through in runs that
        # fit, each released before the next is fetched, merged by log-sum-exp.
        run = tier.slots_per_layer // cache.geom.n_kv_heads
        empty = st.sink_k[:, :0]
        outs, lses = [], []
        for lo in range(0, max(store_slots.shape[1], 1), run):
            part = store_slots[:, lo : lo + run]
            tier_slots = tier.fetch(layer, part) if part.shape[1] else None
            local = (st.win_k[:, ws:end], st.win_v[:, ws:end], sink_k, sink_v)
            first = lo == 0
            out, lse = self.ops.sparse_attention(
                qa, q_far, *(local if first else (empty,) * 4), tier.k, tier.v, tier_slots, first
            )
            tier.release(layer)
            outs.append(out)
            lses.append(lse)
        if len(outs) > 1:
            return self.ops.merge_partials(outs, lses)
        return outs[0], lses[0]

    def score(self, st: LayerState, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        lc = self.cache.lc
        # The kernel reads the candidates' anchors in place, by id.
        ids = (
            self.block_ids[SINK_BLOCKS : self.cache.n_anchored]
            if st.preselected is None
            else candidates.to(self.cache.geom.device)
        )
        return self.ops.score_blocks(query, st.anchors, lc.anchor_type, lc.head_select_mode, ids)

    def reads_in_place(self, layer: int) -> bool:
        return True

    def scratch_bytes(self) -> int:
        return self.tier.k.nbytes + self.tier.v.nbytes


def choose_path(
    geom: CacheGeometry, lc: LongContextSettings, ops_backend: str | None
) -> type[AttendPath]:
    """The fastest path that computes this cache on its device (ops_backend: see
    kv.kernels.attention_ops)."""
    if attention_ops(geom.device, ops_backend) is not TORCH_OPS:
        return TritonPath
    kernels = (
        # DYNAMIC anchors need the window's attention probabilities, which the kernel does
        # not return.
        lc.anchor_type != AnchorType.DYNAMIC
        and geom.dtype in (torch.bfloat16, torch.float32)
        and geom.head_dim in _KERNEL_HEAD_DIMS
        and cpu_kernels(geom.device, ops_backend) is not None
    )
    if not kernels:
        return TorchPath
    return FusedCpuPath if geom.dtype == torch.bfloat16 else CpuKernelPath
