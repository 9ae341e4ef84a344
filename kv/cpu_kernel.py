"""The CPU kernels of the block-sparse cache (kv/csrc/), built on first use (kvchat.native).

torch's small bf16 matmuls read a decode step's keys at ~8 GB/s (docs/performance.md) and its
block selection is a dozen small ops per layer; the kernels read each key, value and anchor
once, in place, and are what the block-sparse cache uses on the CPU (decode attention, block
selection, the rotary rotation of bf16 queries and keys, and the gather that dequantizes INT8
and INT4 blocks). Where they cannot be built the
cache keeps the torch path and says why once.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from kvchat.config.enums import AnchorType, HeadSelectMode, KvType
from kvchat.native import build_extension

SOURCES = [
    Path(__file__).with_name("csrc") / name
    for name in (
        "bindings.cpp",
        "decode_attention.cpp",
        "select_blocks.cpp",
        "rotate.cpp",
        "decode_layer.cpp",
        "block_lru.cpp",
        "gather_blocks.cpp",
        "block_max.cpp",
    )
]
# How decode_attention's sets are stored (the kernel's Format).
_FORMATS = {KvType.FP16: 0, KvType.INT8: 1, KvType.INT4: 2}


@cache
def load() -> ModuleType | None:
    """The compiled kernels' module, or None (with a warning logged) when it cannot be built."""
    return build_extension(
        "kvchat_cpu_kernels",
        SOURCES,
        "decode attention and block selection",
        "the block-sparse cache computes with torch ops (decode several times slower at long "
        "context)",
    )


def decode_attention(
    q0: torch.Tensor,
    q1: torch.Tensor,
    sets: list[tuple],
    n_kv: int,
) -> torch.Tensor:
    """One decode query per head over key sets read in place; [n_heads, 1, D] in q0's dtype.

    q0, q1: [n_heads, 1, D], the two rotations of the query. Each set is (k, v, qid, stride,
    rows, starts[, kv_type]): contiguous K and V sources of the same shape, read as rows of D
    elements `stride` elements apart, `rows` rows from each element offset in starts (int64
    [n_kv, runs]), scored with q0 (qid 0) or q1 (qid 1). With kv_type "INT8" or "INT4" the
    sources are such a BlockPool's storage and each run one block (starts in bytes, stride D),
    dequantized in the kernel as the pool's gather would. One softmax over every set; the
    first set is in the kv dtype.
    """
    dim = q0.shape[-1]
    return _module().decode_attention(
        q0,
        q1,
        [s[0] for s in sets],
        [s[1] for s in sets],
        [s[2] for s in sets],
        [s[3] for s in sets],
        [s[4] for s in sets],
        [s[5] for s in sets],
        [_FORMATS[s[6] if len(s) > 6 else KvType.FP16] for s in sets],
        n_kv,
        dim**-0.5,
    )


def select_blocks(
    query: torch.Tensor,
    anchors: torch.Tensor,
    first: int,
    last: int,
    k: int,
    anchor_type: AnchorType,
    mode: HeadSelectMode,
    pinned: torch.Tensor,
) -> torch.Tensor:
    """The top-min(k, n) blocks among first..last-1 for `query` (fp32 [n_heads, D]), as
    kv.selection.score_blocks + select_top rank them, the `pinned` ids (int64) first: ids
    ascending, [k] for SHARED or [n_kv, k] for SEPARATE. anchors: the layer's fp32 or bf16
    [n_blocks, n_kv, R, D]. Equal scores go to the lower id."""
    return _module().select_blocks(
        query,
        anchors,
        first,
        last,
        k,
        anchor_type == AnchorType.QUEST,
        mode == HeadSelectMode.SHARED,
        pinned,
    )


def decode_layer(
    win_k: torch.Tensor,
    win_v: torch.Tensor,
    win_store_k: torch.Tensor,
    sink_k: torch.Tensor,
    sink_v: torch.Tensor,
    pool_k: torch.Tensor,
    pool_v: torch.Tensor,
    kv_type: KvType,
    slot_unit: int,
    max_blocks: int,
    anchors: torch.Tensor,
    anchor_type: AnchorType,
    mode: HeadSelectMode,
    lru: Any,
    layer: int,
) -> Any:
    """A layer's decode attention in one call (kv/csrc/decode_layer.cpp) over these buffers:
    the bf16 window buffers [n_kv, capacity, D] (win_store_k the same tensor when
    the store keeps rotated keys), the sink blocks, the pools' storage (slot h * max_blocks + b
    starts at slot * slot_unit: elements for FP16, bytes otherwise) and the anchors.

    Its decode(q, k, v, cos, sin, far_cos, far_sin, col, ws, sinks, known, first, last, budget,
    pinned) rotates q and k (far_cos empty: q_far is the rotated q), writes the key and value
    to window column col, reads the blocks `known` ([k] or [n_kv, k]; None with budget 0:
    none) or else the top `budget` of candidates first..last-1, the `pinned` ids first,
    counts the blocks it reads as `layer`'s in the BlockLru `lru` (None: not counted), and
    returns (out [n_heads, 1, D], blocks).
    """
    return _module().DecodeLayer(
        win_k,
        win_v,
        win_store_k,
        sink_k,
        sink_v,
        pool_k,
        pool_v,
        _FORMATS[kv_type],
        slot_unit,
        max_blocks,
        anchors,
        anchor_type == AnchorType.QUEST,
        mode == HeadSelectMode.SHARED,
        lru,
        layer,
    )


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """kv.positions.rotate for bf16 x [..., T, D] and cos, sin [T, D], bit for bit, in one pass."""
    return _module().rotate(x, cos, sin)


def gather_blocks(
    storage: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, kv_type: KvType
) -> torch.Tensor:
    """BlockPool.gather of an INT8 / INT4 pool's `storage` rows, bit for bit: the blocks at
    `slots` (int64 [n]) dequantized into out[:n] (bf16 or fp32 [>= n, block, D]), returned."""
    return _module().gather_blocks(storage, slots, out, _FORMATS[kv_type])


def block_max(scores: torch.Tensor, block: int) -> torch.Tensor:
    """scores [H, n * block, R] (bf16 or fp32) -> fp32 [H, n, R]: each block's largest row,
    as torch's scores.unflatten(1, (n, block)).amax(2)."""
    return _module().block_max(scores, block)


def _module() -> ModuleType:
    module = load()
    assert module is not None, "the CPU kernels are not built: check load() first"
    return module
