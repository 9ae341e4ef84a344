"""Which stored blocks each layer of the sparse cache reads.

A layer's selection is reused by the layers after it (`layer_step`) and by the next tokens
(`token_step`); blocks that leave the window join a reused selection. Preselection keeps,
once per prompt, the blocks its last queries vote for; pinning (kv/pinning.py) leads every
selection of an answer with the blocks the question's last queries attend to most. How the
candidates are scored is the compute path's (`rank`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from kvchat.config import PositionMode
from kvchat.native.cpu import widened_products

from .. import cpu_kernel, pinning
from ..positions import rotate
from ..selection import preselect_vote
from .geometry import PROMPT_QUERIES, SINK_BLOCKS
from .layer import LayerState

if TYPE_CHECKING:
    from .cache import SparseBackend

Rank = Callable[[LayerState, torch.Tensor], torch.Tensor]
# Pins are voted where the block store is, whatever device the model computes on.
HOST = torch.device("cpu")


class BlockSelector:
    def __init__(self, cache: SparseBackend) -> None:
        self.cache = cache
        n_layers = cache.geom.n_layers
        self.pinned = torch.empty(0, dtype=torch.long)  # blocks the last prompt voted for
        self.votes: torch.Tensor | None = None  # the votes of this pass's layers so far
        self.first_generated = 0  # first candidate block that postdates the last preselection
        self.needs_preselect = False
        self.last: list[torch.Tensor | None] = [None] * n_layers  # what each layer read last
        # The vote's products: bf16 where the CPU multiplies it in hardware; native positions
        # rotate the keys back in fp32 first.
        dtype = cache.geom.dtype
        exact = cache.position_mode == PositionMode.NATIVE or widened_products(HOST, dtype)
        self.vote_dtype = torch.float32 if exact else dtype
        self.vote_table = cache.rope.cos_sin(cache.window, 1, torch.float32, HOST)
        self.block_max = (
            cpu_kernel.block_max if cpu_kernel.load() is not None else pinning.torch_block_max
        )

    def reset(self) -> None:
        """The cache no longer holds what selections, votes and pins were made over."""
        cache = self.cache
        self.first_generated = min(self.first_generated, cache.n_anchored)
        self.needs_preselect = False
        self.forget_votes()
        for st in cache.layers:
            st.forget_selection()

    # -- the blocks of a layer -----------------------------------------------------------------
    def candidates(self, st: LayerState) -> torch.Tensor:
        n_anchored = self.cache.n_anchored
        if st.preselected is not None:
            fresh = torch.arange(max(self.first_generated, SINK_BLOCKS), n_anchored)
            return torch.cat([st.preselected, fresh])
        return torch.arange(SINK_BLOCKS, max(n_anchored, SINK_BLOCKS))

    def n_candidates(self, st: LayerState) -> int:
        """len(self.candidates(st)), without building them (the selection kernel reads the
        candidates' anchors as a range)."""
        n_anchored = self.cache.n_anchored
        if st.preselected is not None:
            fresh = n_anchored - max(self.first_generated, SINK_BLOCKS)
            return len(st.preselected) + max(fresh, 0)
        return max(n_anchored - SINK_BLOCKS, 0)

    def select(
        self, layer: int, st: LayerState, q_far: torch.Tensor, rank: Rank
    ) -> torch.Tensor | None:
        """Block ids this layer reads now: [k] shared by all heads or [n_kv, k] per head."""
        known, blocks = self.known(layer, st)
        if not known:
            decoding = self.cache.n_new == 1
            query = q_far[:, 0].float() if decoding else q_far.float().mean(dim=1)
            blocks = self.remember(st, rank(st, query), decoding)
        self.last[layer] = blocks
        return blocks

    def known(self, layer: int, st: LayerState) -> tuple[bool, torch.Tensor | None]:
        """(True, block ids or None) where this layer's blocks are settled without ranking
        (none yet, a dense layer, a reused selection); (False, None) where the query must
        rank the candidates."""
        cache, lc = self.cache, self.cache.lc
        n_anchored = cache.n_anchored
        if n_anchored <= SINK_BLOCKS:
            return True, None
        if layer < lc.dense_layer_num:
            return True, torch.arange(SINK_BLOCKS, n_anchored)
        if (layer - lc.dense_layer_num) % lc.layer_step:
            st.selection = cache.layers[layer - 1].selection
            return True, st.selection
        if cache.n_new == 1 and st.selection is not None and st.selection_age < lc.token_step:
            st.selection_age += 1
            # Blocks that left the window since the selection was made join it: otherwise
            # they would be read by no part of the attention until the next selection.
            if n_anchored > st.selection_upto:
                fresh = torch.arange(st.selection_upto, n_anchored)
                if st.selection.dim() == 2:
                    fresh = fresh.expand(cache.geom.n_kv_heads, -1)
                st.selection = torch.cat([st.selection, fresh], dim=-1)
                st.selection_upto = n_anchored
            return True, st.selection
        if lc.second_select_num == 0 or self.n_candidates(st) == 0:
            return True, None
        return False, None

    def remember(self, st: LayerState, blocks: torch.Tensor, decoding: bool) -> torch.Tensor:
        """Keep a ranking as the layer's selection, for reuse by the next tokens and layers."""
        st.selection = blocks
        st.selection_upto = self.cache.n_anchored
        # A chunk's selection (from its mean query) is never reused for decode queries.
        st.selection_age = 1 if decoding else self.cache.lc.token_step
        return blocks

    # -- pins and preselection -----------------------------------------------------------------
    def start_vote(self, n_new: int) -> None:
        """A prompt pass begins: pins of the last answer go. A pass shorter than a full chunk
        ends a prompt (a question, or a document's last chunk), so its layers vote."""
        self.pinned = torch.empty(0, dtype=torch.long)
        candidates = self.cache.n_anchored - SINK_BLOCKS
        voting = self.pin_count() > 0 and n_new < self.cache.max_chunk and candidates > 0
        self.votes = torch.zeros(candidates) if voting else None

    def vote(self, st: LayerState, q: torch.Tensor) -> None:
        """kv/pinning.py's vote of this layer's last queries of the pass (q: unrotated),
        added to the votes of the layers before it; the blocks with the most votes so far
        lead this layer's selection, and those of all layers every selection of the answer.

        Every key is scored at one distance, that of extrapolated positions: with native
        distances the heads that favour recent tokens would vote for the blocks nearest the
        window, whatever the question asks."""
        assert self.votes is not None
        first, last = SINK_BLOCKS, self.cache.n_anchored
        queries = rotate(q[:, -PROMPT_QUERIES:].float().cpu(), *self.vote_table)
        self.votes += pinning.layer_shares(
            queries, self.key_reader(st), first, last, self.vote_dtype, self.block_max
        )
        self.pinned = pinning.pick(self.votes, first, self.pin_count(), last)

    def forget_votes(self) -> None:
        self.pinned, self.votes = torch.empty(0, dtype=torch.long), None

    def pin_count(self) -> int:
        return pinning.pin_count(self.cache.lc)

    def key_reader(self, st: LayerState) -> pinning.KeyReader:
        """Unrotated keys of blocks lo..hi-1, [n_kv, (hi - lo) * block, D]: read in place
        where the store is FP16, else dequantized into the gather buffer; native positions
        are rotated back."""
        cache = self.cache
        n_kv, block = cache.geom.n_kv_heads, cache.block

        def read(lo: int, hi: int) -> torch.Tensor:
            keys = st.k_pool.span(n_kv, lo, hi)
            if keys is None:
                slots = (cache.head_base + torch.arange(lo, hi)).reshape(-1)
                keys = st.k_pool.gather(slots, cache.gather_buffer(len(slots))[0])
                keys = keys.view(n_kv, -1, cache.geom.head_dim)
            if cache.position_mode == PositionMode.EXTRAPOLATE:
                return keys
            cos, sin = cache.rope.cos_sin(lo * block, (hi - lo) * block, torch.float32, HOST)
            return rotate(keys.float(), cos, -sin)

        return read

    def preselect(self) -> None:
        """SnapKV-style: the last prompt queries vote once for the blocks worth keeping."""
        cache, lc = self.cache, self.cache.lc
        self.needs_preselect = False
        ids = torch.arange(SINK_BLOCKS, max(cache.n_anchored, SINK_BLOCKS))
        for layer, st in enumerate(cache.layers):
            if layer < lc.dense_layer_num or st.q_last is None or len(ids) == 0:
                continue
            keep = preselect_vote(
                st.q_last, st.anchors[ids], lc.anchor_type, lc.preselect_block_count
            )
            st.preselected = ids[keep.cpu()]
            st.selection = None
        self.first_generated = cache.n_anchored
