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

This class keeps the bookkeeping (window, store, anchors, truncation, snapshots, stats);
which blocks a layer reads is the BlockSelector's (selector.py), and how it computes the
attention the AttendPath chosen at construction (paths.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvchat.config import AnchorType, AttentionMode, LongContextSettings, PositionMode

from ..anchors import block_anchors, received_attention
from ..backend import AttentionBackend, CacheStats, LayerStats, check_capacity
from ..cuda_tier import DeviceBlockTier
from ..device_cache import DeviceBlockCache
from ..kernels import attention_ops, rotation
from ..positions import RopeTables
from ..state import CacheState, StateMismatchError
from .geometry import PROMPT_QUERIES, RECEIVED_QUERIES, SINK_BLOCKS, CacheGeometry
from .geometry import window_capacity as window_capacity
from .layer import LayerState, new_layer
from .paths import AttendPath, PassInputs, choose_path
from .selector import BlockSelector
from .traffic import decode_read_bytes

POSITION_MODES = (PositionMode.NATIVE, PositionMode.EXTRAPOLATE)
# long_context keys read afresh at every selection, so a built cache can take new values.
RETUNABLE = ("second_select_num", "pinned_blocks", "token_step", "layer_step")


class SparseBackend(AttentionBackend):
    name = AttentionMode.SPARSE

    def __init__(
        self,
        geom: CacheGeometry,
        rope: RopeTables,
        settings: LongContextSettings,
        position_mode: str,
        ops_backend: str | None = None,
        path: type[AttendPath] | None = None,
    ) -> None:
        """ops_backend: see kv.kernels.attention_ops (None: KVCHAT_ATTENTION_OPS, else auto);
        path: the compute path, where a test needs one other than choose_path's."""
        if position_mode not in POSITION_MODES:
            choices = ", ".join(POSITION_MODES)
            raise ValueError(f"position mode {position_mode!r}; choose one of {choices}")
        lc = settings
        self.geom, self.lc, self.rope, self.position_mode = geom, lc, rope, position_mode
        self.block, self.window = lc.block_size, lc.local_windows_len
        self.max_tokens = geom.max_tokens
        self.max_blocks = -(-geom.max_tokens // self.block)
        self.win_cap = window_capacity(lc)
        self.ops = attention_ops(geom.device, ops_backend)
        self._rotate = rotation(geom.device, geom.dtype, ops_backend)
        native = position_mode == PositionMode.NATIVE
        self.layers = [
            new_layer(geom, lc, native, self.win_cap, self.max_blocks) for _ in range(geom.n_layers)
        ]
        self.head_base = (torch.arange(geom.n_kv_heads) * self.max_blocks).unsqueeze(1)
        # Blocks are gathered on the host (the store's side), then moved where they are used.
        self._gather_k = torch.empty(0, self.block, geom.head_dim, dtype=geom.dtype)
        self._gather_v = torch.empty_like(self._gather_k)
        self._length = 0
        self.n_new = 0
        self._n_stored = 0  # blocks written to the pools
        self.n_anchored = 0  # blocks below this have left the window (candidates, with anchors)
        self.win_base = 0  # absolute position of window buffer column 0
        self.window_start = 0
        self._cos = self._sin = self._far_cos = self._far_sin = torch.empty(0)
        # Extrapolation keeps local distances (window + partial block + pass) in the trained
        # range only if passes stay short enough.
        self.max_chunk = lc.chunk_size
        if position_mode == PositionMode.EXTRAPOLATE:
            limit = geom.trained_context - self.window - self.block
            self.max_chunk = max(1, min(lc.chunk_size, limit))
            # Retrieved keys are read at one fixed distance, so one table serves every pass.
            self._far_table = rope.cos_sin(self.window, 1, geom.dtype)
        self.selector = BlockSelector(self)
        self.path = (path or choose_path(geom, lc, ops_backend))(self, ops_backend)

    @property
    def length(self) -> int:
        return self._length

    @property
    def device_cache(self) -> DeviceBlockCache | DeviceBlockTier:
        """Where the selected blocks are (or would be, on the host) resident."""
        return self.path.device_cache

    def device_slots(self) -> int:
        """Room for two selections per layer (blocks kept from one step to the next hit),
        never more than every block of the layer."""
        return min(2 * max(self.lc.second_select_num, 1), self.max_blocks) * self.geom.n_kv_heads

    def retune(self, settings: LongContextSettings) -> None:
        """Take the RETUNABLE values of `settings` from the next selection on; the cache
        keeps every other value it was built with."""
        self.lc = replace(self.lc, **{key: getattr(settings, key) for key in RETUNABLE})
        self.device_cache.resize(self.device_slots())

    def has_sinks(self, window_start: int | None = None) -> bool:
        """Whether the sink block lies before the window (this pass's, by default), so
        queries read it apart from the window."""
        start = self.window_start if window_start is None else window_start
        return start >= SINK_BLOCKS * self.block

    def window_start_at(self, length: int) -> int:
        """First token of the local window for queries after `length` tokens: the block
        boundary at or before length - local_windows_len."""
        return max(0, (length - self.window) // self.block * self.block)

    def rotations(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """This pass's cos and sin at the new tokens' positions, then at the far distance
        (empty in native mode)."""
        return self._cos, self._sin, self._far_cos, self._far_sin

    # -- a pass --------------------------------------------------------------------------
    def begin(self, n_new: int) -> None:
        end = self._length + n_new
        check_capacity(end, self.max_tokens)
        if n_new > self.lc.chunk_size:
            raise ValueError(
                f"a pass of {n_new} tokens exceeds the chunk size {self.lc.chunk_size}"
            )
        start = self.window_start_at(self._length)
        self._anchor_blocks(start // self.block)
        self.window_start = start
        if end - self.win_base > self.win_cap:
            self._shift_window(start)
        if n_new > 1:
            self.selector.start_vote(n_new)
        elif self.selector.needs_preselect:
            self.selector.preselect()
        self.n_new = n_new
        self.path.begin(n_new)
        self._cos, self._sin = self.rope.cos_sin(self._length, n_new, self.geom.dtype)
        if self.position_mode == PositionMode.EXTRAPOLATE:
            cos, sin = self._far_table
            self._far_cos, self._far_sin = cos.expand(n_new, -1), sin.expand(n_new, -1)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        st = self.layers[layer]
        n = self.n_new
        if n == 1 and layer >= self.lc.dense_layer_num and st.preselected is None:
            out = self.path.decode_step(layer, st, q, k, v)
            if out is not None:
                return out
        qa = self._rotate(q, self._cos, self._sin)
        ka = self._rotate(k, self._cos, self._sin)
        o = self._length - self.win_base
        st.win_k[:, o : o + n] = ka
        st.win_v[:, o : o + n] = v
        if st.win_store_k is not st.win_k:
            st.win_store_k[:, o : o + n] = k
        if st.received is not None:
            st.received[:, o : o + n] = 0
        self.store_blocks(st, (self._length + n) // self.block)
        q_far = (
            qa
            if self.position_mode == PositionMode.NATIVE
            else self._rotate(q, *self.rotations()[2:])
        )
        if self.selector.votes is not None and layer >= self.lc.dense_layer_num:
            self.selector.vote(st, q)
        ws = self.window_start - self.win_base
        x = PassInputs(qa, q_far, ka, v, ws, o)
        if n == 1:
            return self.path.decode(layer, st, x)
        out = self.path.prefill(layer, st, x)
        if st.received is not None:
            m = min(n, RECEIVED_QUERIES)
            st.received[:, ws : o + n] += received_attention(qa[:, -m:], st.win_k[:, ws : o + n])
        if self.lc.preselect_block:
            st.q_last = q_far[:, -PROMPT_QUERIES:].float().clone()
        return out

    def commit(self) -> None:
        self._length += self.n_new
        self._n_stored = self._length // self.block
        self.selector.votes = None
        if self.n_new > 1 and self.lc.preselect_block:
            self.selector.needs_preselect = True
        self.n_new = 0

    def abort(self) -> None:
        # As after a truncate to the committed length: pins and selections go. DYNAMIC
        # anchors lose the attention the window received so far: the layers that ran added
        # this pass's share, which cannot be told apart.
        self.selector.reset()
        for st in self.layers:
            if st.received is not None:
                st.received.zero_()
        self.n_new = 0

    # -- blocks ----------------------------------------------------------------------------
    def slots(self, blocks: torch.Tensor) -> torch.Tensor:
        """Store slots [n_kv, k] of `blocks` ([k] shared or [n_kv, k])."""
        per_head = (
            blocks if blocks.dim() == 2 else blocks.unsqueeze(0).expand(self.geom.n_kv_heads, -1)
        )
        return self.head_base + per_head

    def store_blocks(self, st: LayerState, complete: int) -> None:
        """Write blocks that this pass completed to the store (and the sink copy)."""
        first = self._n_stored
        if complete <= first:
            return
        self._write_blocks(
            st, first, complete, st.win_store_k, st.win_v, first * self.block - self.win_base
        )

    def _write_blocks(
        self,
        st: LayerState,
        first: int,
        last: int,
        keys: torch.Tensor,
        values: torch.Tensor,
        column: int,
    ) -> None:
        """Blocks first..last-1 from keys and values [n_kv, T, D] (store-space keys) from
        column `column` on, into the store, and block 0 into the sinks too."""
        b, dim = self.block, self.geom.head_dim
        lo, hi = column, column + (last - first) * b
        slots = (self.head_base + torch.arange(first, last)).reshape(-1)
        self.ops.write_blocks(st.k_pool, slots, keys[:, lo:hi].reshape(-1, b, dim))
        self.ops.write_blocks(st.v_pool, slots, values[:, lo:hi].reshape(-1, b, dim))
        if first < SINK_BLOCKS:
            st.sink_k.copy_(keys[:, lo : lo + b])
            st.sink_v.copy_(values[:, lo : lo + b])

    def _anchor_blocks(self, upto: int) -> None:
        """Give anchors to the blocks that leave the local window before block `upto`."""
        first = max(self.n_anchored, SINK_BLOCKS)
        if upto <= first:
            self.n_anchored = max(self.n_anchored, upto)
            return
        b, n_blocks = self.block, upto - first
        n_kv, dim = self.geom.n_kv_heads, self.geom.head_dim
        slots = (self.head_base + torch.arange(first, upto)).reshape(-1)
        for st in self.layers:
            keys = st.k_pool.gather(slots, self.gather_buffer(len(slots))[0])
            keys = keys.to(self.geom.device).view(n_kv, n_blocks, b, dim).transpose(0, 1)
            received = None
            if st.received is not None:
                lo = first * b - self.win_base
                window = st.received[:, lo : lo + n_blocks * b]
                received = window.reshape(n_kv, n_blocks, b).transpose(0, 1)
            st.anchors[first:upto] = block_anchors(
                keys, self.lc.anchor_type, self.lc.anchor_num, received
            )
        self.n_anchored = upto

    def _shift_window(self, new_base: int) -> None:
        keep = self._length - new_base
        src = new_base - self.win_base
        for st in self.layers:
            for t in st.window_buffers:
                t[:, :keep] = t[:, src : src + keep].clone()
        self.win_base = new_base

    def gather_buffer(self, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Host buffers for at least n_slots blocks of keys and of values, in full precision."""
        if self._gather_k.shape[0] < n_slots:
            size = max(n_slots, 2 * self._gather_k.shape[0])
            shape = (size, self.block, self.geom.head_dim)
            self._gather_k = torch.empty(shape, dtype=self.geom.dtype)
            self._gather_v = torch.empty(shape, dtype=self.geom.dtype)
        return self._gather_k, self._gather_v

    def gather_bytes(self) -> int:
        return 2 * self._gather_k.numel() * self._gather_k.element_size()

    # -- housekeeping ------------------------------------------------------------------------
    @torch.inference_mode()  # its scratch buffers are made inside the model's inference mode
    def truncate(self, n_tokens: int) -> None:
        if n_tokens >= self._length:
            return
        n_tokens = max(n_tokens, 0)
        self._length = n_tokens
        self._n_stored = n_tokens // self.block
        start = self.window_start_at(n_tokens)
        self.n_anchored = min(self.n_anchored, start // self.block)
        self.selector.reset()
        self.device_cache.invalidate()
        if start < self.win_base:
            self._reload_window(start)

    def _reload_window(self, start: int) -> None:
        """Refill the window buffer from the store from `start` to the end."""
        b, n_kv, dim = self.block, self.geom.n_kv_heads, self.geom.head_dim
        first, last = start // b, -(-self._length // b)
        slots = (self.head_base + torch.arange(first, last)).reshape(-1)
        n = (last - first) * b
        cos, sin = self.rope.cos_sin(start, n, self.geom.dtype)
        for st in self.layers:
            gk, gv = self.gather_buffer(len(slots))
            keys = st.k_pool.gather(slots, gk).view(n_kv, n, dim).to(self.geom.device)
            values = st.v_pool.gather(slots, gv).view(n_kv, n, dim)
            st.win_store_k[:, :n] = keys
            st.win_v[:, :n] = values
            if st.win_store_k is not st.win_k:
                st.win_k[:, :n] = self._rotate(keys, cos, sin)
            if st.received is not None:
                st.received.zero_()
        self.win_base = start

    @torch.inference_mode()
    def fill_random(self, upto: int, seed: int, blocks_per_step: int = 1024) -> None:
        """Store random keys and values (standing for store-space keys) for every block from
        the end up to token `upto`, a block boundary, with their anchors, and reload the
        window from the store: a long context for benchmarks without a long prefill."""
        b, n_kv, dim = self.block, self.geom.n_kv_heads, self.geom.head_dim
        first, last = self._n_stored, upto // b
        if upto % b or last < first or upto > self.max_tokens:
            raise ValueError(f"cannot fill up to {upto}: not a block boundary past the stored end")
        if self.lc.anchor_type == AnchorType.DYNAMIC:
            raise ValueError("a random fill has no attention statistics for DYNAMIC anchors")
        gen = torch.Generator(device=self.geom.device).manual_seed(seed)
        anchored_end = self.window_start_at(upto) // b
        for b0 in range(first, last, blocks_per_step):
            b1 = min(b0 + blocks_per_step, last)
            for st in self.layers:
                kv = torch.randn(
                    2, n_kv, (b1 - b0) * b, dim, generator=gen, device=self.geom.device,
                    dtype=self.geom.dtype,
                )  # fmt: skip
                self._write_blocks(st, b0, b1, kv[0], kv[1], 0)
            self._anchor_blocks(min(b1, anchored_end))
        self._length, self._n_stored = upto, last
        self.window_start = self.window_start_at(upto)
        self.selector.reset()
        self.device_cache.invalidate()
        self._reload_window(self.window_start)

    def decode_read_bytes(self) -> int:
        return decode_read_bytes(self)

    def stats(self) -> CacheStats:
        lc, geom = self.lc, self.geom
        first = self.layers[0]
        window_start = self.window_start_at(self._length)
        sinks = self.block if self.has_sinks(window_start) else 0
        candidates = max(self.n_anchored - SINK_BLOCKS, 0)
        layers = []
        for i, blocks in enumerate(self.selector.last):
            selected = () if blocks is None else tuple(sorted(set(blocks.reshape(-1).tolist())))
            layers.append(
                LayerStats(
                    layer=i, dense=i < lc.dense_layer_num, candidates=candidates, selected=selected
                )
            )
        resident = geom.n_layers * geom.token_bytes * (self.win_cap + self.block)
        return CacheStats(
            backend=self.name,
            tokens=self._length,
            capacity_tokens=self.max_tokens,
            kv_bytes=geom.n_layers
            * 2
            * geom.n_kv_heads
            * self._n_stored
            * first.k_pool.bytes_per_slot,
            kv_dtype=lc.kv_type,
            position_mode=self.position_mode,
            block_size=self.block,
            blocks_in_dram=self._n_stored,
            resident_tokens=self._length - window_start + sinks,
            # Besides window and sinks: the tier's slots, or the host path's gather buffers.
            resident_bytes=resident + self.path.scratch_bytes(),
            anchor_bytes=geom.n_layers * self.n_anchored * first.anchors[0].nbytes,
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
        used = self._length - self.win_base
        tensors: dict[str, torch.Tensor] = {}
        for i, st in enumerate(self.layers):
            parts = {
                "anchors": st.anchors[SINK_BLOCKS : max(self.n_anchored, SINK_BLOCKS)],
                "sink_k": st.sink_k,
                "sink_v": st.sink_v,
            }
            for name in ("k_pool", "v_pool"):
                rows = getattr(st, name).storage
                per_head = rows.view(self.geom.n_kv_heads, self.max_blocks, *rows.shape[1:])
                parts[name] = per_head[:, : self._n_stored]
            window = {"win_k": st.win_k, "win_v": st.win_v, "received": st.received}
            if st.win_store_k is not st.win_k:
                window["win_store_k"] = st.win_store_k
            parts |= {name: t[:, :used] for name, t in window.items() if t is not None}
            tensors |= {f"{i}.{name}": t for name, t in parts.items()}
        scalars = {"length": self._length, "win_base": self.win_base}
        return CacheState(scalars | {"n_anchored": self.n_anchored}, tensors)

    @torch.inference_mode()  # like truncate: the model's inference mode may own the scratch
    def load_state(self, state: CacheState) -> None:
        length, base = state.scalar("length"), state.scalar("win_base")
        anchored = state.scalar("n_anchored")
        check_capacity(length, self.max_tokens)
        window_start = self.window_start_at(length)
        if not (0 <= base <= window_start and base % self.block == 0) or not (
            length - base <= self.win_cap and 0 <= anchored <= window_start // self.block
        ):
            raise StateMismatchError(
                f"inconsistent positions in the saved state: {length} tokens, window buffer "
                f"from {base}, {anchored} anchored blocks (window capacity {self.win_cap})"
            )
        self._length, self.win_base, self.n_anchored = length, base, anchored
        self._n_stored, self.window_start = length // self.block, window_start
        self.selector.first_generated = 0
        self.selector.reset()
        self.selector.last = [None] * self.geom.n_layers
        self.device_cache.invalidate()
        state.restore(self.export_state().tensors)
