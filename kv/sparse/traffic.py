"""What a decode step reads, in bytes: the cache's side of the roofline."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .geometry import SINK_BLOCKS

if TYPE_CHECKING:
    from .cache import SparseBackend


def decode_read_bytes(cache: SparseBackend) -> int:
    """The window in place; the sink block and the selected blocks read in kv_type (from
    the store, then from the gather buffer they are dequantized into where the path
    gathers; once where it reads them in place); every candidate's anchors scored."""
    lc, path = cache.lc, cache.path
    window_start = cache.window_start_at(cache.length)
    full = cache.geom.token_bytes
    window = (cache.length + 1 - window_start) * full
    sinks = SINK_BLOCKS if cache.has_sinks(window_start) else 0
    candidates = max(window_start // cache.block - SINK_BLOCKS, 0)
    slot = cache.layers[0].k_pool.bytes_per_slot
    anchor = cache.layers[0].anchors[0].nbytes
    total = 0
    for layer in range(cache.geom.n_layers):
        dense = layer < lc.dense_layer_num
        total += window
        if dense and path.dense_span_in_place:
            total += (sinks + candidates) * cache.block * full
            continue
        # Kernels read blocks where they are and the sinks in place, in full precision;
        # a gathering path writes what it gathers to a buffer and reads it again.
        kernel = path.reads_in_place(layer)
        if kernel:
            total += sinks * cache.block * full
        read = candidates if dense else min(candidates, lc.second_select_num)
        gathered = 0 if kernel else 2 * cache.block * full
        total += (read + (0 if kernel else sinks)) * (2 * cache.geom.n_kv_heads * slot + gathered)
        if not dense:
            total += candidates * anchor
    return total
