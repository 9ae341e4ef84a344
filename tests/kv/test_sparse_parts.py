"""Behaviour of the block-sparse cache's parts, driven through the tiny model."""

from __future__ import annotations

import pytest
import torch

from kvchat.kv.anchors import anchor_rows, block_anchors
from kvchat.kv.positions import rotate
from kvchat.kv.sparse import CacheGeometry, CpuKernelPath, SparseBackend

from .conftest import dense_cache, run, small_settings, sparse_cache, tiny_model

PROMPT = 700


def _ids(n: int = PROMPT, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def test_sinks_are_always_attended(tiny):
    # With no retrieved blocks at all, the first block must still be read (attention sink):
    # the output equals attention over exactly {block 0} + local window, computed densely.
    settings = small_settings(second_select_num=0, dense_layer_num=0)
    cache = sparse_cache(tiny, settings)
    run(tiny, cache, _ids(), 64)
    stats = cache.stats()
    assert all(layer.selected == () for layer in stats.layers)
    assert stats.resident_tokens == PROMPT - (PROMPT - 128) // 32 * 32 + 32
    # Zeroing the sink block's values changes the output, so it is read.
    before = tiny.forward(torch.tensor([5]), cache)
    cache.truncate(PROMPT)
    sink_slots = cache.head_base.reshape(-1)  # block 0 of every KV head
    for st in cache.layers:
        st.sink_v.zero_()
        st.v_pool.write(sink_slots, torch.zeros(len(sink_slots), 32, 32))
    after = tiny.forward(torch.tensor([5]), cache)
    assert (before - after).abs().max() > 1e-4


def test_block_completion_and_anchor_timing(tiny):
    settings = small_settings()
    cache = sparse_cache(tiny, settings)
    run(tiny, cache, _ids(100), 64)
    s = cache.stats()
    assert s.blocks_in_dram == 100 // 32 and s.tokens == 100
    # Nothing has left the 128-token window yet: no candidates, nothing selected.
    assert s.layers[0].candidates == 0 and s.anchor_bytes == 0
    run(tiny, cache, _ids(300, seed=2), 64)
    s = cache.stats()
    assert s.blocks_in_dram == 400 // 32
    # Blocks leave the window at the start of a pass: the last chunk started at 356.
    window_start = (356 - 128) // 32 * 32
    assert s.layers[0].candidates == window_start // 32 - 1  # minus the sink block
    assert (
        s.kv_bytes == 4 * 2 * 2 * (400 // 32) * 32 * 32 * 4
    )  # layers, K+V, heads, tokens, dim, fp32


@pytest.mark.parametrize(
    ("anchor_type", "stored"),
    [("QUEST", torch.bfloat16), ("BLOCK_MAX", torch.bfloat16), ("BLOCK_MEAN", torch.float32)],
)
def test_anchors_that_are_key_values_stay_in_the_keys_dtype(anchor_type, stored):
    # With bf16 keys, QUEST's and BLOCK_MAX's per-channel minimum and maximum are bf16
    # values: stored as bf16 they are exact at half the bytes; a mean keeps fp32.
    model = tiny_model(dtype=torch.bfloat16)
    cache = sparse_cache(model, small_settings(anchor_type=anchor_type))
    run(model, cache, _ids(), 64)
    n = cache.n_anchored
    slots = (cache.head_base + torch.arange(1, n)).reshape(-1)
    for st in cache.layers:
        assert st.anchors.dtype == stored
        keys = st.k_pool.storage[slots].view(2, n - 1, 32, 32).transpose(0, 1)
        assert torch.equal(st.anchors[1:n].float(), block_anchors(keys, anchor_type, 1))
    rows = anchor_rows(anchor_type)
    assert cache.stats().anchor_bytes == 4 * n * 2 * rows * 32 * stored.itemsize


class NoRotation:
    """Positions that do not rotate anything, so planted keys keep their direction; the
    tables are made on `device` unless a caller asks for another, as core/rope.py's are."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)

    def cos_sin(self, start: int, length: int, dtype: torch.dtype, device=None):
        device = self.device if device is None else device
        ones = torch.ones(length, 32, dtype=dtype, device=device)
        return ones, torch.zeros_like(ones)


@pytest.mark.parametrize("anchor_type", ["DYNAMIC", "FIXED", "BLOCK_MEAN", "BLOCK_MAX", "QUEST"])
@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
def test_planted_block_is_selected(anchor_type, mode):
    gen = torch.Generator().manual_seed(3)
    settings = small_settings(
        second_select_num=2, dense_layer_num=0, anchor_type=anchor_type, head_select_mode=mode
    )
    cache = SparseBackend(
        CacheGeometry(1, 2, 1, 32, torch.float32, torch.device("cpu"), 4096, 4096),
        NoRotation(),
        settings,
        "native",
    )
    needle = torch.randn(32, generator=gen)
    needle = 4 * needle / needle.norm()
    keys = 0.1 * torch.randn(1, PROMPT, 32, generator=gen)
    keys[0, 5 * 32 : 6 * 32] += needle
    for start in range(0, PROMPT, 64):
        n = min(64, PROMPT - start)
        cache.begin(n)
        q = 0.1 * torch.randn(2, n, 32, generator=gen)
        cache.attend(0, q, keys[:, start : start + n], torch.randn(1, n, 32, generator=gen))
        cache.commit()
    cache.begin(1)
    cache.attend(0, needle.expand(2, 1, 32), needle.view(1, 1, 32), torch.zeros(1, 1, 32))
    cache.commit()
    assert 5 in cache.stats().layers[0].selected


def test_token_step_reuses_selection_and_counts_hits(tiny):
    settings = small_settings(second_select_num=3, token_step=4, dense_layer_num=0)
    cache = sparse_cache(tiny, settings)
    run(tiny, cache, _ids(), 64)
    picks = []
    for t in range(4):
        tiny.forward(torch.tensor([t]), cache)
        picks.append(cache.stats().layers[2].selected)
    assert picks[0] == picks[1] == picks[2]
    s = cache.stats()
    assert s.hits > 0 and s.misses > 0 and 0 < s.hit_rate < 1
    assert s.bytes_moved == s.misses * cache.device_cache.bytes_per_block


def test_layer_step_shares_selection_between_layers(tiny):
    settings = small_settings(second_select_num=2, layer_step=2, dense_layer_num=0)
    cache = sparse_cache(tiny, settings)
    run(tiny, cache, _ids(), 64, decode=1)
    layers = cache.stats().layers
    assert layers[0].selected == layers[1].selected
    assert layers[2].selected == layers[3].selected


def test_preselection_keeps_sinks_and_generated_blocks(tiny):
    settings = small_settings(
        second_select_num=2, preselect_block=True, preselect_block_count=3, dense_layer_num=0
    )
    cache = sparse_cache(tiny, settings)
    run(tiny, cache, _ids(), 64)
    tiny.forward(torch.tensor([1]), cache)
    kept = cache.layers[1].preselected
    assert kept is not None and len(kept) == 3 and 0 not in kept.tolist()
    first_generated = cache.n_anchored
    # Generate past a block boundary and out of the window: new blocks become candidates.
    for t in range(80):
        tiny.forward(torch.tensor([t % 256]), cache)
    candidates = cache.selector.candidates(cache.layers[1]).tolist()
    assert set(kept.tolist()) <= set(candidates)
    assert any(b >= first_generated for b in candidates)
    assert cache.stats().resident_tokens > 128  # sinks + window still resident


def test_truncate_then_continue_equals_fresh(tiny):
    ids = _ids()
    settings = small_settings(second_select_num=10_000, dense_layer_num=0)
    cache = sparse_cache(tiny, settings)
    run(tiny, cache, ids, 64)
    # Drop far back (below the window buffer) and mid-block, then prefill a new ending.
    cache.truncate(250)
    tail = _ids(150, seed=9)
    got = run(tiny, cache, tail, 64)
    reference = run(tiny, dense_cache(tiny), torch.cat([ids[:250], tail]), 64)[250:]
    assert (got - reference).abs().max().item() < 1e-3


def test_extrapolate_mode_keeps_positions_in_range(tiny):
    # Keys are stored unrotated; the far part is read at a fixed distance. With a full budget it
    # is no longer dense attention, but it must be finite, close to it for near-uniform heads,
    # and never ask RoPE for a position past window + block + pass.
    settings = small_settings(second_select_num=10_000, dense_layer_num=0, chunk_size=64)
    cache = sparse_cache(tiny, settings, position_mode="extrapolate")
    got = run(tiny, cache, _ids(), 64, decode=8)
    assert torch.isfinite(got).all()
    assert cache.max_chunk == 64
    assert cache.stats().position_mode == "extrapolate"


def test_extrapolate_window_reload_matches_a_fresh_prefill(tiny):
    # Truncating below the window buffer reloads it from the store (unrotated keys), rotating
    # them again at their absolute positions.
    settings = small_settings(dense_layer_num=0)
    cache = sparse_cache(tiny, settings, position_mode="extrapolate")
    run(tiny, cache, _ids(), 64)
    cache.truncate(320)
    fresh = sparse_cache(tiny, settings, position_mode="extrapolate")
    run(tiny, fresh, _ids()[:320], 64)
    start = cache.window_start_at(320)
    for st, want in zip(cache.layers, fresh.layers, strict=True):
        got_cols = slice(start - cache.win_base, 320 - cache.win_base)
        want_cols = slice(start - fresh.win_base, 320 - fresh.win_base)
        torch.testing.assert_close(st.win_k[:, got_cols], want.win_k[:, want_cols])
        torch.testing.assert_close(st.win_store_k[:, got_cols], want.win_store_k[:, want_cols])
    # As in test_truncate_then_continue_equals_fresh: equal up to summation order.
    got, want = tiny.forward(torch.tensor([9]), cache), tiny.forward(torch.tensor([9]), fresh)
    assert (got - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("kv_type", ["FP16", "INT8", "INT4"])
def test_decode_read_bytes_counts_what_a_step_reads(tiny, kv_type):
    # TINY: 4 layers, 2 KV heads x 32 dims, fp32. Window 128, blocks of 32, 4 selected,
    # layer 0 dense. After 700 tokens the next step's window starts at 544 (a block
    # boundary <= 701 - 128): 157 window tokens in place; the sink block and the selected
    # blocks are read (FP16 blocks, and quantized ones of the sparse layers, in place by the
    # CPU kernel, the sink block in full precision; else gathered); blocks 1..16 are candidates.
    settings = small_settings(kv_type=kv_type)
    cache = sparse_cache(tiny, settings)
    run(tiny, cache, _ids(), 64)
    full = 2 * 2 * 32 * 4  # K and V of one token, fp32
    slot = {"FP16": 32 * 32 * 4, "INT8": 32 * (32 + 2), "INT4": 32 * (16 + 4)}[kv_type]
    window = (701 - 544) * full
    kernels = isinstance(cache.path, CpuKernelPath)
    in_place = kv_type == "FP16" and kernels
    copy = 0 if in_place else 2 * 32 * full  # the gather buffer's write + read
    gathered = 2 * 2 * slot + copy  # per block
    anchors = 16 * 2 * 2 * 32 * 4  # QUEST: min and max keys per block and head, fp32 as the keys
    dense_layer = 17 * 32 * full if kv_type == "FP16" else 17 * gathered
    if kv_type != "FP16" and kernels:
        sparse_layer = 32 * full + 4 * 2 * 2 * slot + anchors
    else:
        sparse_layer = 5 * gathered + anchors
    assert cache.decode_read_bytes() == 4 * window + dense_layer + 3 * sparse_layer

    dense = dense_cache(tiny)
    run(tiny, dense, _ids(), 64)
    assert dense.decode_read_bytes() == 4 * 701 * full


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kv_type", ["FP16", "INT8"])
def test_a_random_fill_equals_a_prefill_of_the_same_keys(tiny, backend, kv_type):
    # fill_random (the GPU benchmark's long context) must leave the cache a prefill of its
    # keys and values leaves: the same store, anchors and window, so the same next step.
    if backend == "triton":
        pytest.importorskip("triton")
    settings = small_settings(kv_type=kv_type, anchor_type="QUEST")
    filled = sparse_cache(tiny, settings, ops_backend=backend)
    filled.fill_random(320, seed=1, blocks_per_step=3)
    prefilled = sparse_cache(tiny, settings, ops_backend=backend)
    cfg, gen = tiny.cfg, torch.Generator().manual_seed(2)
    cos, sin = tiny.rope.cos_sin(0, 320, torch.float32)
    slots = (filled.head_base + torch.arange(10)).reshape(-1)
    stored = []
    for st in filled.layers:
        k = st.k_pool.gather(slots, torch.empty(len(slots), 32, 32)).view(2, 320, 32)
        v = st.v_pool.gather(slots, torch.empty(len(slots), 32, 32)).view(2, 320, 32)
        k[:, :32], v[:, :32] = st.sink_k, st.sink_v  # the sinks are kept in full precision
        stored.append((rotate(k, cos, -sin), v))  # the keys as the model hands them over
    for start in range(0, 320, 64):
        prefilled.begin(64)
        for layer, (k, v) in enumerate(stored):
            q = torch.randn(cfg.num_heads, 64, 32, generator=gen)
            prefilled.attend(layer, q, k[:, start : start + 64], v[:, start : start + 64])
        prefilled.commit()
    for _ in range(2):
        outs = []
        for cache in (filled, prefilled):
            cache.begin(1)
            step = torch.Generator().manual_seed(3)
            outs.append(
                [
                    cache.attend(layer, *(torch.randn(h, 1, 32, generator=step) for h in (4, 2, 2)))
                    for layer in range(cfg.num_layers)
                ]
            )
            cache.commit()
        # INT8: the prefill quantizes the store's dequantized keys again, and a value may
        # land one step (1/127 of its group's largest) away.
        tol = 1e-5 if kv_type == "FP16" else 3e-4
        for got, want in zip(*outs, strict=True):
            torch.testing.assert_close(got, want, atol=tol, rtol=0)
    assert filled.stats().layers == prefilled.stats().layers
    assert any(layer.selected for layer in filled.stats().layers)
    with pytest.raises(ValueError, match="block boundary"):
        filled.fill_random(330, seed=1)
