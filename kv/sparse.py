"""The block-sparse KV cache (InfLLM / KTransformers long_context) behind the backend interface.

Per layer, each query reads three key sets:
- sinks: the first block, in full precision (attention sinks; always read);
- the local window: every token from `window_start` on, in full precision, causal;
- retrieved blocks: the `second_select_num` stored blocks whose anchors score highest for
  the query (every stored block in the first `dense_layer_num` layers), led while an answer
  decodes by the `pinned_blocks` the prompt's last queries voted for (kv/pinning.py).
`window_start` is the block boundary at or before `length - local_windows_len`, so the
three sets never overlap and, with a budget that covers every block, their union is the
whole context: the output then equals dense attention.

Blocks are written to the block store (DRAM, in kv_type) as soon as they complete, and get
anchors when they leave the local window, which is also when they become candidates (the
DYNAMIC anchors need the attention a block received while it was local).

Positions: `native` stores keys rotated at their absolute positions. `extrapolate` (InfLLM)
stores keys unrotated and reads sinks and retrieved blocks with the query rotated to the
distance `local_windows_len`, so no position ever exceeds the trained range; the local
window keeps exact relative positions.

Compute, by the ops kv/kernels.py picks for the device:
- torch (the CPU): blocks are gathered (dequantized) from the store into a buffer and read
  with the torch attention; the device block cache only counts what a GPU would copy. Where
  the C++ kernels (kv/cpu_kernel.py) build, a decode step reads the window, the sinks and FP16
  blocks in place (quantized blocks from the gather buffer) in one pass, and selection
  scores and ranks the candidates in one pass too. In bf16 a decode step's layer is one C++
  call (kv/csrc/decode_layer.cpp: rotations, window write, selection, attention).
- Triton (CUDA; the CPU under TRITON_INTERPRET=1, for tests): window, sinks, anchors and
  received attention live on the device, the store stays in host DRAM, and the selected
  blocks are copied into a DeviceBlockTier (kv/cuda_tier.py), from whose slots one
  sparse_attention kernel reads them in kv_type, dequantizing in registers.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvchat.config import LongContextSettings
from kvchat.native.cpu import widened_products

from . import cpu_kernel, pinning
from .anchors import anchor_dtype, anchor_rows, block_anchors
from .attention import chunk_attention, decode_attention
from .backend import AttentionBackend, CacheStats, LayerStats, check_capacity
from .cuda_tier import DeviceBlockTier
from .device_cache import DeviceBlockCache
from .kernels import TORCH_OPS, attention_ops, cpu_kernels, rotation
from .positions import RopeTables, rotate
from .quant import BlockPool
from .selection import pin, preselect_vote, score_blocks, select_top
from .state import CacheState, StateMismatchError

POSITION_MODES = ("native", "extrapolate")
# long_context keys read afresh at every selection, so a built cache can take new values.
RETUNABLE = ("second_select_num", "pinned_blocks", "token_step", "layer_step")
_SINK_BLOCKS = 1
_RECEIVED_QUERIES = 64  # prefill queries whose attention feeds DYNAMIC anchors
_PROMPT_QUERIES = 32  # last prompt queries that vote in preselection and pinning


def window_capacity(lc: LongContextSettings) -> int:
    """Tokens kept in full precision per layer: the local window, the partial block, the
    sink-to-window gap, and one pass of new tokens. The planner sizes memory with it too."""
    return lc.local_windows_len + 2 * lc.block_size + lc.chunk_size


@dataclass
class _LayerState:
    k_pool: BlockPool
    v_pool: BlockPool
    anchors: torch.Tensor  # [max_blocks, n_kv, R, D] in anchor_dtype
    win_k: torch.Tensor  # [n_kv, win_cap, D], rotated at absolute positions
    win_v: torch.Tensor
    win_store_k: torch.Tensor  # keys as the store keeps them (win_k itself in native mode)
    received: torch.Tensor | None  # [n_kv, win_cap] attention received (DYNAMIC only)
    sink_k: torch.Tensor  # [n_kv, block, D] store-space keys of the sink block
    sink_v: torch.Tensor
    selection: torch.Tensor | None = None  # [k] (SHARED) or [n_kv, k] (SEPARATE) block ids
    selection_age: int = 0
    selection_upto: int = 0  # candidate blocks that existed when `selection` was made
    preselected: torch.Tensor | None = None
    q_last: torch.Tensor | None = None  # last prompt queries, for preselection


class SparseBackend(AttentionBackend):
    name = "sparse"

    def __init__(
        self,
        n_layers: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        rope: RopeTables,
        dtype: torch.dtype,
        device: torch.device | str,
        settings: LongContextSettings,
        position_mode: str,
        max_tokens: int,
        trained_context: int,
        ops_backend: str | None = None,
    ) -> None:
        """ops_backend: see kv.kernels.attention_ops (None: KVCHAT_ATTENTION_OPS, else auto)."""
        if position_mode not in POSITION_MODES:
            raise ValueError(f"position mode {position_mode!r}; choose one of {POSITION_MODES}")
        lc = settings
        self.lc, self.position_mode = lc, position_mode
        self.n_layers, self.n_heads, self.n_kv, self.head_dim = (
            n_layers,
            n_heads,
            n_kv_heads,
            head_dim,
        )
        self.rope, self.dtype, self.device = rope, dtype, torch.device(device)
        self.block = lc.block_size
        self.window = lc.local_windows_len
        self.max_tokens = max_tokens
        self.max_blocks = -(-max_tokens // self.block)
        self.win_cap = window_capacity(lc)
        rows = anchor_rows(lc.anchor_type)
        self.ops = attention_ops(self.device, ops_backend)
        # DYNAMIC anchors need the window's attention probabilities, which the kernel does
        # not return.
        self._cpu_kernels = (
            lc.anchor_type != "DYNAMIC"
            and dtype in (torch.bfloat16, torch.float32)
            and head_dim in (32, 64, 128, 256)
            and cpu_kernels(self.device, ops_backend) is not None
        )
        self._rotate = rotation(self.device, dtype, ops_backend)

        def window_buffer() -> torch.Tensor:
            # Head-major, [n_kv, win_cap, D]: the CPU decode kernel reads each head's window
            # rows as one stream (token-major, a head's rows were 128 of every 384 bytes: 30
            # layers of a 128K step's attention replayed from DRAM, 12.6 -> 11.6 ms).
            shape = (n_kv_heads, self.win_cap, head_dim)
            return torch.zeros(shape, dtype=dtype, device=self.device)

        def pool() -> BlockPool:
            # Pageable: pinning rounds every allocation up to a power of two, and the tier
            # copies misses through its own pinned staging buffer.
            n_slots = n_kv_heads * self.max_blocks
            return BlockPool(n_slots, self.block, head_dim, lc.kv_type, dtype, "cpu")

        self._layers: list[_LayerState] = []
        for _ in range(n_layers):
            win_k = window_buffer()
            self._layers.append(
                _LayerState(
                    k_pool=pool(),
                    v_pool=pool(),
                    # Untouched host pages cost no memory: only anchored blocks are ever written.
                    anchors=torch.empty(
                        self.max_blocks,
                        n_kv_heads,
                        rows,
                        head_dim,
                        dtype=anchor_dtype(lc.anchor_type, dtype),
                        device=self.device,
                    ),
                    win_k=win_k,
                    win_v=window_buffer(),
                    win_store_k=win_k if position_mode == "native" else window_buffer(),
                    received=torch.zeros(n_kv_heads, self.win_cap, device=self.device)
                    if lc.anchor_type == "DYNAMIC"
                    else None,
                    sink_k=torch.zeros(
                        n_kv_heads, self.block, head_dim, dtype=dtype, device=self.device
                    ),
                    sink_v=torch.zeros(
                        n_kv_heads, self.block, head_dim, dtype=dtype, device=self.device
                    ),
                )
            )
        first = self._layers[0].k_pool
        # The Triton path reads blocks from the tier; the torch path reads them on the host
        # and only counts residency. device_cache is what stats() reports, either way.
        self.tier: DeviceBlockTier | None = None
        self.device_cache: DeviceBlockCache | DeviceBlockTier
        if self.ops is TORCH_OPS:
            group = n_kv_heads if lc.head_select_mode == "SHARED" else 1
            self.device_cache = DeviceBlockCache(
                n_layers,
                self._device_slots(),
                2 * first.bytes_per_slot,
                group,
                cpu_kernels(self.device, ops_backend),
            )
        else:
            self.tier = DeviceBlockTier(
                [st.k_pool for st in self._layers],
                [st.v_pool for st in self._layers],
                self._device_slots(),
                self.device,
            )
            self.device_cache = self.tier
        self._block_ids = torch.arange(self.max_blocks, device=self.device)
        # Blocks are gathered on the host (the store's side), then moved where they are used.
        self._gather_k = torch.empty(0, self.block, head_dim, dtype=dtype)
        self._gather_v = torch.empty_like(self._gather_k)
        self._head_base = (torch.arange(n_kv_heads) * self.max_blocks).unsqueeze(1)
        self._heads = torch.arange(n_kv_heads).unsqueeze(1)
        # Where each head's sink block starts in the sink buffers, for the CPU decode kernel.
        self._sink_starts = self._heads * self.block * head_dim
        # bf16 decode steps of the layers that rank their blocks: one C++ call a layer.
        self._layer_kernels = (
            [self._layer_kernel(i, st) for i, st in enumerate(self._layers)]
            if self._cpu_kernels and dtype == torch.bfloat16
            else None
        )
        self._length = 0
        self._n_new = 0
        self._n_stored = 0  # blocks written to the pools
        self._n_anchored = 0  # blocks below this have left the window (candidates, with anchors)
        self._first_generated = 0  # first candidate block that postdates the last preselection
        self._win_base = 0  # absolute position of window buffer column 0
        self._window_start = 0
        self._needs_preselect = False
        self._pinned = torch.empty(0, dtype=torch.long)  # blocks the last prompt voted for
        self._votes: torch.Tensor | None = None  # the votes of this pass's layers so far
        # The vote's products: bf16 where the CPU multiplies it in hardware; native positions
        # rotate the keys back in fp32 first.
        exact = position_mode == "native" or widened_products(torch.device("cpu"), dtype)
        self._vote_dtype = torch.float32 if exact else dtype
        self._vote_table = rope.cos_sin(self.window, 1, torch.float32)  # queries at one distance
        self._cos = self._sin = self._far_cos = self._far_sin = torch.empty(0)
        self._last_selection: list[torch.Tensor | None] = [None] * n_layers
        # Extrapolation keeps local distances (window + partial block + pass) in the trained
        # range only if passes stay short enough.
        self.max_chunk = lc.chunk_size
        if position_mode == "extrapolate":
            self.max_chunk = max(1, min(lc.chunk_size, trained_context - self.window - self.block))
            # Retrieved keys are read at one fixed distance, so one table serves every pass.
            self._far_table = rope.cos_sin(self.window, 1, dtype)

    def _layer_kernel(self, layer: int, st: _LayerState) -> object:
        """kv/csrc/decode_layer.cpp's object over this layer's buffers, counting its reads in
        the device cache."""
        kv_type = self.lc.kv_type
        unit = self.block * self.head_dim if kv_type == "FP16" else st.k_pool.bytes_per_slot
        return cpu_kernel.decode_layer(
            st.win_k,
            st.win_v,
            st.win_store_k,
            st.sink_k,
            st.sink_v,
            st.k_pool.storage,
            st.v_pool.storage,
            kv_type,
            unit,
            self.max_blocks,
            st.anchors,
            self.lc.anchor_type,
            self.lc.head_select_mode,
            self.device_cache.lru,
            layer,
        )

    @property
    def length(self) -> int:
        return self._length

    def _device_slots(self) -> int:
        """Room for two selections per layer (blocks kept from one step to the next hit),
        never more than every block of the layer."""
        return min(2 * max(self.lc.second_select_num, 1), self.max_blocks) * self.n_kv

    def retune(self, settings: LongContextSettings) -> None:
        """Take the RETUNABLE values of `settings` from the next selection on; the cache
        keeps every other value it was built with."""
        self.lc = replace(self.lc, **{key: getattr(settings, key) for key in RETUNABLE})
        self.device_cache.resize(self._device_slots())

    def _has_sinks(self, window_start: int) -> bool:
        """Whether the sink block lies before a window starting at `window_start`, so queries
        read it apart from the window."""
        return window_start >= _SINK_BLOCKS * self.block

    def _window_start_at(self, length: int) -> int:
        """First token of the local window for queries after `length` tokens: the block
        boundary at or before length - local_windows_len."""
        return max(0, (length - self.window) // self.block * self.block)

    # -- a pass --------------------------------------------------------------------------
    def begin(self, n_new: int) -> None:
        end = self._length + n_new
        check_capacity(end, self.max_tokens)
        if n_new > self.lc.chunk_size:
            raise ValueError(
                f"a pass of {n_new} tokens exceeds the chunk size {self.lc.chunk_size}"
            )
        start = self._window_start_at(self._length)
        self._anchor_blocks(start // self.block)
        self._window_start = start
        if end - self._win_base > self.win_cap:
            self._shift_window(start)
        if n_new > 1:
            self._start_vote(n_new)
        elif self._needs_preselect:
            self._preselect()
        self._n_new = n_new
        if n_new == 1 and self._cpu_kernels:
            # Where each head's window starts in the window buffer, the same for every layer of
            # the step.
            ws = self._window_start - self._win_base
            self._window_starts = (self._heads * self.win_cap + ws) * self.head_dim
        self._cos, self._sin = self.rope.cos_sin(self._length, n_new, self.dtype)
        if self.position_mode == "extrapolate":
            cos, sin = self._far_table
            self._far_cos, self._far_sin = cos.expand(n_new, -1), sin.expand(n_new, -1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        st = self._layers[layer]
        n = self._n_new
        if (
            n == 1
            and self._layer_kernels is not None
            and layer >= self.lc.dense_layer_num
            and st.preselected is None
        ):
            return self._decode_layer(layer, st, q, k, v)
        start, end = self._length, self._length + n
        qa = self._rotate(q, self._cos, self._sin)
        ka = self._rotate(k, self._cos, self._sin)
        o = start - self._win_base
        st.win_k[:, o : o + n] = ka
        st.win_v[:, o : o + n] = v
        if st.win_store_k is not st.win_k:
            st.win_store_k[:, o : o + n] = k
        if st.received is not None:
            st.received[:, o : o + n] = 0
        self._store_blocks(st, end // self.block)

        q_far = (
            qa if self.position_mode == "native" else self._rotate(q, self._far_cos, self._far_sin)
        )
        if self._votes is not None and layer >= self.lc.dense_layer_num:
            self._vote(st, q)
        ws = self._window_start - self._win_base
        sinks = self._has_sinks(self._window_start)
        if n == 1 and self._cpu_kernels:
            return self._decode_in_place(layer, st, qa, q_far, ws, o + 1, sinks)
        if self.tier is not None:
            sink_k = st.sink_k if sinks else st.sink_k[:, :0]
            sink_v = st.sink_v if sinks else st.sink_v[:, :0]
            return self._attend_tier(layer, st, qa, q_far, ws, o + n, sink_k, sink_v)
        far_k, far_v = self._retrieve(layer, st, q_far, sinks)
        if n == 1:
            out, received = decode_attention(
                [
                    (qa, st.win_k[:, ws : o + 1], st.win_v[:, ws : o + 1]),
                    (q_far, far_k, far_v),
                ]
            )
            if st.received is not None:
                st.received[:, ws : o + 1] += received
            return out
        window = (qa, st.win_k[:, ws:o], st.win_v[:, ws:o])
        out = chunk_attention(qa, [window, (q_far, far_k, far_v)], ka, v)
        if st.received is not None:
            self._record_received(st, qa, ws, o + n)
        if self.lc.preselect_block:
            st.q_last = q_far[:, -_PROMPT_QUERIES:].float().clone()
        return out

    def _decode_layer(
        self, layer: int, st: _LayerState, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        """attend for a decode token in one C++ call: the steps of the path below (rotations,
        window writes, selection, _decode_in_place's attention) without a dozen Python-level
        ops a layer."""
        o = self._length - self._win_base
        known, blocks = self._known_selection(layer, st)
        out, ranked = self._layer_kernels[layer].decode(  # type: ignore[index]
            q,
            k,
            v,
            self._cos,
            self._sin,
            self._far_cos,
            self._far_sin,
            o,
            self._window_start - self._win_base,
            self._has_sinks(self._window_start),
            blocks,
            _SINK_BLOCKS,
            self._n_anchored,
            0 if known else self.lc.second_select_num,
            self._pinned,
        )
        if not known:
            blocks = self._remember(st, ranked, decoding=True)
        self._store_blocks(st, (self._length + 1) // self.block)
        self._last_selection[layer] = blocks
        return out

    def _attend_tier(
        self,
        layer: int,
        st: _LayerState,
        qa: torch.Tensor,
        q_far: torch.Tensor,
        ws: int,
        end: int,
        sink_k: torch.Tensor,
        sink_v: torch.Tensor,
    ) -> torch.Tensor:
        """attend on the kernel path: the window (causal on its tail, the pass's own keys),
        the sinks and the selected blocks, fetched into the tier, in one sparse_attention."""
        assert self.tier is not None
        tier, ops = self.tier, self.ops
        blocks = self._select(layer, st, q_far)
        self._last_selection[layer] = blocks
        if blocks is None:
            blocks = torch.empty(0, dtype=torch.long)
        per_head = blocks if blocks.dim() == 2 else blocks.unsqueeze(0).expand(self.n_kv, -1)
        store_slots = self._head_base + per_head
        # A layer may read more blocks than its tier slots (a dense layer, or a reused
        # selection that blocks leaving the window joined): they pass through in runs that
        # fit, each released before the next is fetched, merged by log-sum-exp.
        run = tier.slots_per_layer // self.n_kv
        empty = st.sink_k[:, :0]
        outs, lses = [], []
        for lo in range(0, max(store_slots.shape[1], 1), run):
            part = store_slots[:, lo : lo + run]
            tier_slots = tier.fetch(layer, part) if part.shape[1] else None
            local = (st.win_k[:, ws:end], st.win_v[:, ws:end], sink_k, sink_v)
            first = lo == 0
            out, lse = ops.sparse_attention(
                qa, q_far, *(local if first else (empty,) * 4), tier.k, tier.v, tier_slots, first
            )
            tier.release(layer)
            outs.append(out)
            lses.append(lse)
        if len(outs) > 1:
            out, lse = ops.merge_partials(outs, lses)
        if self._n_new == 1:
            if st.received is not None:
                st.received[:, ws:end] += ops.window_probs(qa, st.win_k[:, ws:end], lse)
            return out
        if st.received is not None:
            self._record_received(st, qa, ws, end)
        if self.lc.preselect_block:
            st.q_last = q_far[:, -_PROMPT_QUERIES:].float().clone()
        return out

    def commit(self) -> None:
        self._length += self._n_new
        self._n_stored = self._length // self.block
        self._votes = None
        if self._n_new > 1 and self.lc.preselect_block:
            self._needs_preselect = True
        self._n_new = 0

    # -- blocks ----------------------------------------------------------------------------
    def _store_blocks(self, st: _LayerState, complete: int) -> None:
        """Write blocks that this pass completed to the store (and the sink copy)."""
        first = self._n_stored
        if complete <= first:
            return
        b = self.block
        lo, hi = first * b - self._win_base, complete * b - self._win_base
        n_blocks = complete - first
        slots = (self._head_base + torch.arange(first, complete)).reshape(-1)
        keys = st.win_store_k[:, lo:hi].reshape(self.n_kv * n_blocks, b, self.head_dim)
        values = st.win_v[:, lo:hi].reshape(self.n_kv * n_blocks, b, self.head_dim)
        self.ops.write_blocks(st.k_pool, slots, keys)
        self.ops.write_blocks(st.v_pool, slots, values)
        if first < _SINK_BLOCKS:
            st.sink_k.copy_(st.win_store_k[:, lo : lo + b])
            st.sink_v.copy_(st.win_v[:, lo : lo + b])

    def _anchor_blocks(self, upto: int) -> None:
        """Give anchors to the blocks that leave the local window before block `upto`."""
        first = max(self._n_anchored, _SINK_BLOCKS)
        if upto <= first:
            self._n_anchored = max(self._n_anchored, upto)
            return
        b, n_blocks = self.block, upto - first
        slots = (self._head_base + torch.arange(first, upto)).reshape(-1)
        for st in self._layers:
            keys = st.k_pool.gather(slots, self._gather_buffer(len(slots))[0]).to(self.device)
            keys = keys.view(self.n_kv, n_blocks, b, self.head_dim).transpose(0, 1)
            received = None
            if st.received is not None:
                lo = first * b - self._win_base
                window = st.received[:, lo : lo + n_blocks * b]
                received = window.reshape(self.n_kv, n_blocks, b).transpose(0, 1)
            st.anchors[first:upto] = block_anchors(
                keys, self.lc.anchor_type, self.lc.anchor_num, received
            )
        self._n_anchored = upto

    def _shift_window(self, new_base: int) -> None:
        keep = self._length - new_base
        src = new_base - self._win_base
        for st in self._layers:
            tensors = [st.win_k, st.win_v]
            if st.win_store_k is not st.win_k:
                tensors.append(st.win_store_k)
            if st.received is not None:
                tensors.append(st.received)
            for t in tensors:
                t[:, :keep] = t[:, src : src + keep].clone()
        self._win_base = new_base

    def _gather_buffer(self, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._gather_k.shape[0] < n_slots:
            size = max(n_slots, 2 * self._gather_k.shape[0])
            shape = (size, self.block, self.head_dim)
            self._gather_k = torch.empty(shape, dtype=self.dtype)
            self._gather_v = torch.empty(shape, dtype=self.dtype)
        return self._gather_k, self._gather_v

    # -- selection ---------------------------------------------------------------------------
    def _candidates(self, st: _LayerState) -> torch.Tensor:
        if st.preselected is not None:
            fresh = torch.arange(max(self._first_generated, _SINK_BLOCKS), self._n_anchored)
            return torch.cat([st.preselected, fresh])
        return torch.arange(_SINK_BLOCKS, max(self._n_anchored, _SINK_BLOCKS))

    def _n_candidates(self, st: _LayerState) -> int:
        """len(self._candidates(st)), without building them (the selection kernel reads the
        candidates' anchors as a range)."""
        if st.preselected is not None:
            fresh = self._n_anchored - max(self._first_generated, _SINK_BLOCKS)
            return len(st.preselected) + max(fresh, 0)
        return max(self._n_anchored - _SINK_BLOCKS, 0)

    def _select(self, layer: int, st: _LayerState, q_far: torch.Tensor) -> torch.Tensor | None:
        """Block ids this layer reads now: [k] shared by all heads or [n_kv, k] per head."""
        known, blocks = self._known_selection(layer, st)
        if known:
            return blocks
        decoding = self._n_new == 1
        query = q_far[:, 0].float() if decoding else q_far.float().mean(dim=1)
        return self._remember(st, self._rank(st, query), decoding)

    def _known_selection(self, layer: int, st: _LayerState) -> tuple[bool, torch.Tensor | None]:
        """(True, block ids or None) where this layer's blocks are settled without ranking
        (none yet, a dense layer, a reused selection); (False, None) where the query must
        rank the candidates."""
        lc = self.lc
        if self._n_anchored <= _SINK_BLOCKS:
            return True, None
        if layer < lc.dense_layer_num:
            return True, torch.arange(_SINK_BLOCKS, self._n_anchored)
        if (layer - lc.dense_layer_num) % lc.layer_step:
            st.selection = self._layers[layer - 1].selection
            return True, st.selection
        if self._n_new == 1 and st.selection is not None and st.selection_age < lc.token_step:
            st.selection_age += 1
            # Blocks that left the window since the selection was made join it: otherwise
            # they would be read by no part of the attention until the next selection.
            if self._n_anchored > st.selection_upto:
                fresh = torch.arange(st.selection_upto, self._n_anchored)
                if st.selection.dim() == 2:
                    fresh = fresh.expand(self.n_kv, -1)
                st.selection = torch.cat([st.selection, fresh], dim=-1)
                st.selection_upto = self._n_anchored
            return True, st.selection
        if lc.second_select_num == 0 or self._n_candidates(st) == 0:
            return True, None
        return False, None

    def _remember(self, st: _LayerState, blocks: torch.Tensor, decoding: bool) -> torch.Tensor:
        """Keep a ranking as the layer's selection, for reuse by the next tokens and layers."""
        st.selection = blocks
        st.selection_upto = self._n_anchored
        # A chunk's selection (from its mean query) is never reused for decode queries.
        st.selection_age = 1 if decoding else self.lc.token_step
        return blocks

    def _rank(self, st: _LayerState, query: torch.Tensor) -> torch.Tensor:
        """The second_select_num candidates that score highest for `query` [n_heads, D]."""
        lc = self.lc
        if self._cpu_kernels and st.preselected is None:
            return cpu_kernel.select_blocks(
                query,
                st.anchors,
                _SINK_BLOCKS,
                self._n_anchored,
                lc.second_select_num,
                lc.anchor_type,
                lc.head_select_mode,
                self._pinned,
            )
        candidates = self._candidates(st)
        if self.tier is None:
            # Without preselection the candidates are one run of blocks: score their anchors
            # in place instead of copying them (a copy of every anchor, per layer, per token).
            anchors = (
                st.anchors[_SINK_BLOCKS : self._n_anchored]
                if st.preselected is None
                else st.anchors[candidates]
            )
            scores = score_blocks(query, anchors, lc.anchor_type, lc.head_select_mode)
        else:
            # The kernel reads the candidates' anchors in place, by id.
            ids = (
                self._block_ids[_SINK_BLOCKS : self._n_anchored]
                if st.preselected is None
                else candidates.to(self.device)
            )
            scores = self.ops.score_blocks(
                query, st.anchors, lc.anchor_type, lc.head_select_mode, ids
            )
        pin(scores, candidates, self._pinned)
        return candidates[select_top(scores, lc.second_select_num).cpu()]

    def _decode_in_place(
        self,
        layer: int,
        st: _LayerState,
        qa: torch.Tensor,
        q_far: torch.Tensor,
        ws: int,
        end: int,
        sinks: bool,
    ) -> torch.Tensor:
        """A decode step's attention by the CPU kernel: the window (columns ws..end, read with
        qa), the sinks and the retrieved blocks (read with q_far) in one softmax."""
        b, dim, n_kv = self.block, self.head_dim, self.n_kv
        window = (st.win_k, st.win_v, 0, dim, end - ws, self._window_starts)
        sets = [window]
        if not self._reads_store_in_place(layer):
            # Every block of a dense layer in INT8 / INT4 is dequantized into the gather
            # buffer first (sinks included).
            k, v = self._retrieve(layer, st, q_far, sinks)
            if k.shape[1]:
                sets.append((k, v, 1, dim, k.shape[1], self._heads * k.shape[1] * dim))
            return cpu_kernel.decode_attention(qa, q_far, sets, n_kv)
        if sinks:
            sets.append((st.sink_k, st.sink_v, 1, dim, b, self._sink_starts))
        blocks = self._select(layer, st, q_far)
        self._last_selection[layer] = blocks
        pool_k, pool_v = st.k_pool.storage, st.v_pool.storage
        if blocks is not None and layer < self.lc.dense_layer_num:
            # Every candidate: one run per head, like _retrieve's in-place span.
            rows = (self._n_anchored - _SINK_BLOCKS) * b
            starts = (self._head_base + _SINK_BLOCKS) * b * dim
            sets.append((pool_k, pool_v, 1, dim, rows, starts))
        elif blocks is not None and blocks.shape[-1]:
            self._count_reads(layer, blocks)
            slots = self._slots(blocks)
            # Quantized blocks are read where they lie too (0.53x / 0.31x the bytes of FP16),
            # from byte offsets, and dequantized in the kernel.
            kv_type = self.lc.kv_type
            unit = b * dim if kv_type == "FP16" else st.k_pool.bytes_per_slot
            sets.append((pool_k, pool_v, 1, dim, b, slots * unit, kv_type))
        return cpu_kernel.decode_attention(qa, q_far, sets, n_kv)

    def _reads_store_in_place(self, layer: int) -> bool:
        """Whether the CPU decode kernel reads this layer's blocks from the store (FP16, and
        quantized blocks that selection picked) rather than from the gather buffer."""
        return self.lc.kv_type == "FP16" or layer >= self.lc.dense_layer_num

    def _count_reads(self, layer: int, blocks: torch.Tensor) -> None:
        """Count with the device cache that `layer` reads `blocks` ([k] shared or [n_kv, k])
        now."""
        # SHARED: one selection for every head, so its block ids are the cache's keys (each
        # the group of its heads' slots); SEPARATE: the slots themselves.
        keys = blocks if self.lc.head_select_mode == "SHARED" else self._head_base + blocks
        self.device_cache.touch(layer, keys)

    def _slots(self, blocks: torch.Tensor) -> torch.Tensor:
        """Store slots [n_kv, k] of `blocks` ([k] shared or [n_kv, k])."""
        per_head = blocks if blocks.dim() == 2 else blocks.unsqueeze(0).expand(self.n_kv, -1)
        return self._head_base + per_head

    def _retrieve(
        self, layer: int, st: _LayerState, q_far: torch.Tensor, sinks: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the sink block (when `sinks`) and the selected blocks as one key
        set, [n_kv, S, D] each: both are read with q_far, and one set costs one matmul pair
        (decode) or one kernel call (prefill) less per layer than two."""
        blocks = self._select(layer, st, q_far)
        self._last_selection[layer] = blocks
        lead = _SINK_BLOCKS if sinks else 0
        if blocks is None:
            blocks = torch.empty(0, dtype=torch.long)
        if lead + blocks.shape[-1] == 0:
            return st.sink_k[:, :0], st.sink_v[:, :0]
        exact = st.k_pool.kv_type == "FP16"  # the store's copy of the sinks is exact
        if layer < self.lc.dense_layer_num and exact:
            # Every candidate is read: one contiguous run per head, read in place (no copy
            # of what may be the whole context); the sinks are the run's first block.
            first, last = _SINK_BLOCKS - lead, self._n_anchored
            return st.k_pool.span(self.n_kv, first, last), st.v_pool.span(self.n_kv, first, last)
        self._count_reads(layer, blocks)
        selected = self._slots(blocks)
        # Each head's sink block (block 0) leads its run; _head_base is exactly those slots.
        slots = (torch.cat([self._head_base, selected], dim=1) if lead else selected).reshape(-1)
        gk, gv = self._gather_buffer(len(slots))
        k = st.k_pool.gather(slots, gk).view(self.n_kv, -1, self.head_dim)
        v = st.v_pool.gather(slots, gv).view(self.n_kv, -1, self.head_dim)
        if lead and not exact:
            # Sinks stay in full precision; the store only has them quantized.
            k[:, : self.block] = st.sink_k
            v[:, : self.block] = st.sink_v
        return k, v

    def _start_vote(self, n_new: int) -> None:
        """A prompt pass begins: pins of the last answer go. A pass shorter than a full chunk
        ends a prompt (a question, or a document's last chunk), so its layers vote."""
        self._pinned = torch.empty(0, dtype=torch.long)
        candidates = self._n_anchored - _SINK_BLOCKS
        voting = self._pin_count() > 0 and n_new < self.max_chunk and candidates > 0
        self._votes = torch.zeros(candidates) if voting else None

    def _vote(self, st: _LayerState, q: torch.Tensor) -> None:
        """kv/pinning.py's vote of this layer's last queries of the pass (q: unrotated),
        added to the votes of the layers before it; the blocks with the most votes so far
        lead this layer's selection, and those of all layers every selection of the answer.

        Every key is scored at one distance, that of extrapolated positions: with native
        distances the heads that favour recent tokens would vote for the blocks nearest the
        window, whatever the question asks."""
        assert self._votes is not None
        first, last = _SINK_BLOCKS, self._n_anchored
        queries = rotate(q[:, -_PROMPT_QUERIES:].float().cpu(), *self._vote_table)
        self._votes += pinning.layer_shares(
            queries, self._key_reader(st), first, last, self._vote_dtype
        )
        self._pinned = pinning.pick(self._votes, first, self._pin_count(), last)

    def _forget_votes(self) -> None:
        """The cache no longer holds what the votes and pins were counted over."""
        self._pinned, self._votes = torch.empty(0, dtype=torch.long), None

    def _pin_count(self) -> int:
        """Blocks to pin: each brings the block after it, and together they take at most the
        budget's half, so the query of each step still chooses the rest."""
        return min(self.lc.pinned_blocks, self.lc.second_select_num // 4)

    def _key_reader(self, st: _LayerState) -> pinning.KeyReader:
        """Unrotated keys of blocks lo..hi-1, [n_kv, (hi - lo) * block, D]: read in place
        where the store is FP16, else dequantized into the gather buffer; native positions
        are rotated back."""

        def read(lo: int, hi: int) -> torch.Tensor:
            keys = st.k_pool.span(self.n_kv, lo, hi)
            if keys is None:
                slots = (self._head_base + torch.arange(lo, hi)).reshape(-1)
                keys = st.k_pool.gather(slots, self._gather_buffer(len(slots))[0])
                keys = keys.view(self.n_kv, -1, self.head_dim)
            if self.position_mode == "extrapolate":
                return keys
            cos, sin = self.rope.cos_sin(lo * self.block, (hi - lo) * self.block, torch.float32)
            return rotate(keys.float(), cos, -sin)

        return read

    def _preselect(self) -> None:
        """SnapKV-style: the last prompt queries vote once for the blocks worth keeping."""
        self._needs_preselect = False
        ids = torch.arange(_SINK_BLOCKS, max(self._n_anchored, _SINK_BLOCKS))
        for layer, st in enumerate(self._layers):
            if layer < self.lc.dense_layer_num or st.q_last is None or len(ids) == 0:
                continue
            keep = preselect_vote(
                st.q_last, st.anchors[ids], self.lc.anchor_type, self.lc.preselect_block_count
            )
            st.preselected = ids[keep.cpu()]
            st.selection = None
        self._first_generated = self._n_anchored

    def _record_received(self, st: _LayerState, qa: torch.Tensor, ws: int, end: int) -> None:
        """Attention the last queries of a chunk give the local window, for DYNAMIC anchors."""
        assert st.received is not None
        m = min(qa.shape[1], _RECEIVED_QUERIES)
        group = self.n_heads // self.n_kv
        q = qa[:, -m:].float().reshape(self.n_kv, group * m, self.head_dim)
        keys = st.win_k[:, ws:end].float()
        scores = torch.matmul(q, keys.transpose(1, 2)) * self.head_dim**-0.5
        # Query i of the last m sits at window column (end - ws) - m + i: it sees keys up to it.
        cols = torch.arange(end - ws, device=keys.device)
        rows = torch.arange(m, device=keys.device).repeat(group) + (end - ws - m)
        scores.masked_fill_(cols[None, None, :] > rows[None, :, None], float("-inf"))
        st.received[:, ws:end] += torch.softmax(scores, dim=-1).sum(dim=1)

    # -- housekeeping ------------------------------------------------------------------------
    @torch.inference_mode()  # its scratch buffers are made inside the model's inference mode
    def truncate(self, n_tokens: int) -> None:
        if n_tokens >= self._length:
            return
        n_tokens = max(n_tokens, 0)
        self._length = n_tokens
        self._n_stored = n_tokens // self.block
        start = self._window_start_at(n_tokens)
        self._n_anchored = min(self._n_anchored, start // self.block)
        self._first_generated = min(self._first_generated, self._n_anchored)
        self._needs_preselect = False
        self._forget_votes()
        for st in self._layers:
            st.selection, st.preselected, st.q_last = None, None, None
        self.device_cache.invalidate()
        if start < self._win_base:
            self._reload_window(start)

    def _reload_window(self, start: int) -> None:
        """Refill the window buffer from the store after truncating below it."""
        b = self.block
        first, last = start // b, -(-self._length // b)
        slots = (self._head_base + torch.arange(first, last)).reshape(-1)
        n = (last - first) * b
        cos, sin = self.rope.cos_sin(start, n, self.dtype)
        for st in self._layers:
            gk, gv = self._gather_buffer(len(slots))
            keys = st.k_pool.gather(slots, gk).view(self.n_kv, n, self.head_dim).to(self.device)
            values = st.v_pool.gather(slots, gv).view(self.n_kv, n, self.head_dim)
            st.win_store_k[:, :n] = keys
            st.win_v[:, :n] = values
            if st.win_store_k is not st.win_k:
                st.win_k[:, :n] = self._rotate(keys, cos, sin)
            if st.received is not None:
                st.received.zero_()
        self._win_base = start

    def decode_read_bytes(self) -> int:
        """The window in place; the sink block and the selected blocks read in kv_type (from
        the store, then from the gather buffer they are dequantized into, on the torch path
        and for a dense layer's quantized blocks on the CPU kernel's; once otherwise); every
        candidate's anchors scored."""
        lc = self.lc
        window_start = self._window_start_at(self._length)
        full = 2 * self.n_kv * self.head_dim * self.dtype.itemsize  # K and V of one token
        window = (self._length + 1 - window_start) * full
        sinks = _SINK_BLOCKS if self._has_sinks(window_start) else 0
        candidates = max(window_start // self.block - _SINK_BLOCKS, 0)
        slot = self._layers[0].k_pool.bytes_per_slot
        anchor = self._layers[0].anchors[0].nbytes
        in_place = lc.kv_type == "FP16" and self.tier is None  # see _retrieve
        total = 0
        for layer in range(self.n_layers):
            total += window
            if layer < lc.dense_layer_num and in_place:
                total += (sinks + candidates) * self.block * full
                continue
            # The kernels read blocks where they are and the sinks in place, in full
            # precision; the torch path writes what it gathers to a buffer and reads it again.
            kernel = self.tier is not None or (
                self._cpu_kernels and self._reads_store_in_place(layer)
            )
            if kernel:
                total += sinks * self.block * full
            read = (
                candidates if layer < lc.dense_layer_num else min(candidates, lc.second_select_num)
            )
            gathered = 0 if kernel else 2 * self.block * full
            total += (read + (0 if kernel else sinks)) * (2 * self.n_kv * slot + gathered)
            if layer >= lc.dense_layer_num:
                total += candidates * anchor
        return total

    def stats(self) -> CacheStats:
        lc = self.lc
        first = self._layers[0]
        window_start = self._window_start_at(self._length)
        sinks = self.block if self._has_sinks(window_start) else 0
        resident = self._length - window_start + sinks
        per_token_full = 2 * self.n_kv * self.head_dim * self.dtype.itemsize
        # Besides window and sinks: the tier's slots, or the host path's gather buffers.
        scratch = (
            self.tier.k.nbytes + self.tier.v.nbytes
            if self.tier is not None
            else 2 * self._gather_k.numel() * self._gather_k.element_size()
        )
        layers = []
        for i, blocks in enumerate(self._last_selection):
            selected = () if blocks is None else tuple(sorted(set(blocks.reshape(-1).tolist())))
            layers.append(
                LayerStats(
                    layer=i,
                    dense=i < lc.dense_layer_num,
                    candidates=max(self._n_anchored - _SINK_BLOCKS, 0),
                    selected=selected,
                )
            )
        return CacheStats(
            backend=self.name,
            tokens=self._length,
            capacity_tokens=self.max_tokens,
            kv_bytes=self.n_layers * 2 * self.n_kv * self._n_stored * first.k_pool.bytes_per_slot,
            kv_dtype=lc.kv_type,
            position_mode=self.position_mode,
            block_size=self.block,
            blocks_in_dram=self._n_stored,
            resident_tokens=resident,
            resident_bytes=self.n_layers * per_token_full * (self.win_cap + self.block) + scratch,
            anchor_bytes=self.n_layers * self._n_anchored * first.anchors[0].nbytes,
            device_slots_used=self.device_cache.used,
            device_slots_total=self.device_cache.total,
            hits=self.device_cache.hits,
            misses=self.device_cache.misses,
            bytes_moved=self.device_cache.bytes_moved,
            layers=tuple(layers),
        )

    # -- snapshots ---------------------------------------------------------------------------
    def export_state(self) -> CacheState:
        """Per layer: the stored blocks of every KV head (as stored, in kv_type), the anchors,
        the sinks and the window columns in use. Selections are not part of it: they are made
        afresh, as after a truncate."""
        used = self._length - self._win_base
        tensors: dict[str, torch.Tensor] = {}
        for i, st in enumerate(self._layers):
            parts = {
                "anchors": st.anchors[_SINK_BLOCKS : max(self._n_anchored, _SINK_BLOCKS)],
                "sink_k": st.sink_k,
                "sink_v": st.sink_v,
            }
            for name in ("k_pool", "v_pool"):
                rows = getattr(st, name).storage
                per_head = rows.view(self.n_kv, self.max_blocks, *rows.shape[1:])
                parts[name] = per_head[:, : self._n_stored]
            window = {"win_k": st.win_k, "win_v": st.win_v, "received": st.received}
            if st.win_store_k is not st.win_k:
                window["win_store_k"] = st.win_store_k
            parts |= {name: t[:, :used] for name, t in window.items() if t is not None}
            tensors |= {f"{i}.{name}": t for name, t in parts.items()}
        scalars = {"length": self._length, "win_base": self._win_base}
        return CacheState(scalars | {"n_anchored": self._n_anchored}, tensors)

    @torch.inference_mode()  # like truncate: the model's inference mode may own the scratch
    def load_state(self, state: CacheState) -> None:
        length, base = state.scalar("length"), state.scalar("win_base")
        anchored = state.scalar("n_anchored")
        check_capacity(length, self.max_tokens)
        window_start = self._window_start_at(length)
        if not (0 <= base <= window_start and base % self.block == 0) or not (
            length - base <= self.win_cap and 0 <= anchored <= window_start // self.block
        ):
            raise StateMismatchError(
                f"inconsistent positions in the saved state: {length} tokens, window buffer "
                f"from {base}, {anchored} anchored blocks (window capacity {self.win_cap})"
            )
        self._length, self._win_base, self._n_anchored = length, base, anchored
        self._n_stored, self._window_start = length // self.block, window_start
        self._first_generated, self._needs_preselect = 0, False
        self._forget_votes()
        for st in self._layers:
            st.selection, st.preselected, st.q_last = None, None, None
        self._last_selection = [None] * self.n_layers
        self.device_cache.invalidate()
        state.restore(self.export_state().tensors)
