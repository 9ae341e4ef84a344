"""The C++ decode kernel against the torch reference (kv/attention.py), and the block-sparse
cache's decode with it against the same cache on the torch path."""

from __future__ import annotations

import pytest
import torch

from kvchat.kv import cpu_kernel
from kvchat.kv.anchors import ANCHOR_TYPES, anchor_rows
from kvchat.kv.attention import decode_attention
from kvchat.kv.kernels import rotation
from kvchat.kv.positions import rotate
from kvchat.kv.quant import BlockPool, dequantize_int4, dequantize_int8
from kvchat.kv.selection import HEAD_SELECT_MODES, pin, score_blocks, select_top
from kvchat.kv.sparse import CpuKernelPath

from .conftest import run, small_settings, sparse_cache, tiny_model

pytestmark = pytest.mark.skipif(
    cpu_kernel.load() is None, reason="no C++ compiler: the torch path is used instead"
)


def _case(n_kv: int, group: int, dim: int, dtype: torch.dtype, seed: int = 0):
    """A window stored token-major (rows n_kv * D apart: the kernel reads any row stride, the
    cache keeps its window head-major), a sink block and a block store."""
    gen = torch.Generator().manual_seed(seed)
    block, n_blocks, cap = 16, 12, 70

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    window_k, window_v = rand(cap, n_kv, dim), rand(cap, n_kv, dim)
    sink_k, sink_v = rand(n_kv, block, dim), rand(n_kv, block, dim)
    pool_k, pool_v = rand(n_kv * n_blocks, block, dim), rand(n_kv * n_blocks, block, dim)
    q0, q1 = rand(n_kv * group, 1, dim), rand(n_kv * group, 1, dim)
    return block, n_blocks, window_k, window_v, sink_k, sink_v, pool_k, pool_v, q0, q1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 128, 256])
@pytest.mark.parametrize(("n_kv", "group"), [(4, 1), (3, 3), (2, 4), (1, 8)])
def test_kernel_equals_one_softmax_over_the_sets(n_kv, group, dim, dtype):
    block, n_blocks, wk, wv, sk, sv, pk, pv, q0, q1 = _case(n_kv, group, dim, dtype)
    ws, we = 5, 61  # window columns read
    picked = torch.tensor([[1, 4, 9], [2, 4, 11]])[torch.arange(n_kv) % 2]  # per head
    slots = torch.arange(n_kv).unsqueeze(1) * n_blocks + picked
    heads = torch.arange(n_kv).unsqueeze(1)
    sets = [
        (wk, wv, 0, n_kv * dim, we - ws, (ws * n_kv + heads) * dim),
        (sk, sv, 1, dim, block, heads * block * dim),
        (pk, pv, 1, dim, block, slots * block * dim),
    ]
    got = cpu_kernel.decode_attention(q0, q1, sets, n_kv)

    # The reference in fp32 on the same (rounded) values: the kernel computes in fp32.
    def up(*ts):
        return [t.float() for t in ts]

    far_k = torch.cat([sk.float(), pk.float()[slots].flatten(1, 2)], dim=1)
    far_v = torch.cat([sv.float(), pv.float()[slots].flatten(1, 2)], dim=1)
    parts = [
        (*up(q0), *up(wk[ws:we].transpose(0, 1), wv[ws:we].transpose(0, 1))),
        (*up(q1), far_k, far_v),
    ]
    want, _ = decode_attention(parts)
    assert got.dtype == dtype and got.shape == q0.shape
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("rows", [1, 15, 16, 17, 33, 64])
def test_ragged_runs(rows):
    """Runs whose rows are not a multiple of the kernel's 16-row scores or 2-row value pairs."""
    n_kv, group, dim = 3, 3, 64
    block, _, wk, wv, sk, sv, pk, pv, q0, q1 = _case(n_kv, group, dim, torch.bfloat16, seed=4)
    heads = torch.arange(n_kv).unsqueeze(1)
    sets = [
        (wk, wv, 0, n_kv * dim, rows, (2 * n_kv + heads) * dim),
        (sk, sv, 1, dim, min(rows, block), heads * block * dim),
    ]
    got = cpu_kernel.decode_attention(q0, q1, sets, n_kv)
    window = wk[2 : 2 + rows].transpose(0, 1).float(), wv[2 : 2 + rows].transpose(0, 1).float()
    sinks = sk[:, : min(rows, block)].float(), sv[:, : min(rows, block)].float()
    want, _ = decode_attention([(q0.float(), *window), (q1.float(), *sinks)])
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)


def test_long_runs_split_across_threads_merge_exactly():
    """One head's keys in runs of very different lengths: the parts the threads take are
    merged by their softmax statistics into the one softmax."""
    n_kv, group, dim = 1, 2, 64
    _, _, wk, wv, _, _, pk, pv, q0, q1 = _case(n_kv, group, dim, torch.float32, seed=3)
    sets = [
        (wk, wv, 0, n_kv * dim, 70, torch.tensor([[0]])),
        (pk, pv, 1, dim, 16, torch.tensor([[0, 7 * 16 * dim, 3 * 16 * dim]])),
    ]
    got = cpu_kernel.decode_attention(q0, q1, sets, n_kv)
    far = torch.cat([pk[0], pk[7], pk[3]]), torch.cat([pv[0], pv[7], pv[3]])
    want, _ = decode_attention(
        [(q0, wk[:, 0].unsqueeze(0), wv[:, 0].unsqueeze(0)), (q1, far[0][None], far[1][None])]
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_run_outside_its_source_is_refused():
    _, _, wk, wv, _, _, _, _, q0, q1 = _case(1, 1, 32, torch.float32)
    beyond = torch.tensor([[(70 - 4) * 32]])  # 8 rows from row 66 of 70
    with pytest.raises(RuntimeError, match="reads outside its source"):
        cpu_kernel.decode_attention(q0, q1, [(wk, wv, 0, 32, 8, beyond)], 1)


def _quantized_pools(
    kv_type: str, n_kv: int, n_blocks: int, block: int, dim: int, dtype: torch.dtype
):
    gen = torch.Generator().manual_seed(7)
    pools = []
    for _ in range(2):
        pool = BlockPool(n_kv * n_blocks, block, dim, kv_type, dtype)
        # Groups of very different ranges and offsets, so per-group scales and minimums matter.
        blocks = torch.randn(n_kv * n_blocks, block, dim, generator=gen)
        blocks *= torch.logspace(-3, 3, dim // 32).repeat_interleave(32)
        blocks += torch.linspace(-2, 5, dim // 32).repeat_interleave(32)
        pool.write(torch.arange(n_kv * n_blocks), blocks)
        pools.append(pool)
    return pools


@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
def test_quantized_blocks_read_in_place_equal_their_gathered_copy(dim, dtype, kv_type):
    """The kernel dequantizes INT8 / INT4 blocks tile by tile into exactly the values
    BlockPool.gather makes (q * scale, + minimum for INT4, in fp32, one rounding), so reading
    them where they lie gives the output of reading the gathered copy, bit for bit. Blocks of
    160 rows span a full and a partial tile."""
    n_kv, group, block, n_blocks = 3, 3, 160, 6
    _, _, wk, wv, sk, sv, _, _, q0, q1 = _case(n_kv, group, dim, dtype, seed=5)
    pool_k, pool_v = _quantized_pools(kv_type, n_kv, n_blocks, block, dim, dtype)
    heads = torch.arange(n_kv).unsqueeze(1)
    slots = heads * n_blocks + torch.tensor([[0, 4, 5], [1, 2, 4], [3, 4, 5]])
    local = [
        (wk, wv, 0, n_kv * dim, 60, (5 * n_kv + heads) * dim),
        (sk, sv, 1, dim, 16, heads * 16 * dim),
    ]
    starts = slots * pool_k.bytes_per_slot
    in_place = (pool_k.storage, pool_v.storage, 1, dim, block, starts, kv_type)
    got = cpu_kernel.decode_attention(q0, q1, [*local, in_place], n_kv)

    out = torch.empty(slots.numel(), block, dim, dtype=dtype)
    k = pool_k.gather(slots.reshape(-1), out.clone())
    v = pool_v.gather(slots.reshape(-1), out.clone())
    runs = torch.arange(slots.numel()).view(n_kv, -1) * block * dim
    want = cpu_kernel.decode_attention(q0, q1, [*local, (k, v, 1, dim, block, runs)], n_kv)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
def test_a_quantized_run_outside_its_source_is_refused(kv_type):
    _, _, wk, wv, _, _, _, _, q0, q1 = _case(1, 1, 64, torch.float32)
    pool_k, pool_v = _quantized_pools(kv_type, 1, 2, 32, 64, torch.float32)
    window = (wk, wv, 0, 64, 8, torch.tensor([[0]]))
    last = torch.tensor([[pool_k.bytes_per_slot]])  # the second of 2 slots: inside
    past = torch.tensor([[pool_k.bytes_per_slot + 1]])  # one byte further: its metadata outside
    sets = [window, (pool_k.storage, pool_v.storage, 1, 64, 32, last, kv_type)]
    cpu_kernel.decode_attention(q0, q1, sets, 1)
    sets[1] = (pool_k.storage, pool_v.storage, 1, 64, 32, past, kv_type)
    with pytest.raises(RuntimeError, match="reads outside its source"):
        cpu_kernel.decode_attention(q0, q1, sets, 1)


@pytest.mark.parametrize("mode", HEAD_SELECT_MODES)
@pytest.mark.parametrize("anchor_type", ANCHOR_TYPES)
@pytest.mark.parametrize("k", [5, 40])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pinned", [[], [2, 3, 30, 36, 44]])
def test_block_selection_equals_score_blocks_and_select_top(dtype, anchor_type, mode, k, pinned):
    gen = torch.Generator().manual_seed(2)
    n_kv, group, dim, n_blocks, first, last = 3, 3, 64, 50, 1, 37
    shape = (n_blocks, n_kv, anchor_rows(anchor_type), dim)
    anchors = torch.randn(*shape, generator=gen).to(dtype)
    query = torch.randn(n_kv * group, dim, generator=gen)
    pinned = torch.tensor(pinned, dtype=torch.long)  # 44: not a candidate, ignored
    got = cpu_kernel.select_blocks(query, anchors, first, last, k, anchor_type, mode, pinned)
    scores = score_blocks(query, anchors[first:last], anchor_type, mode)
    want = first + select_top(pin(scores, torch.arange(first, last), pinned), k)
    assert torch.equal(got, want)
    assert got.shape[-1] == min(k, last - first)
    chosen = got.reshape(-1, got.shape[-1])
    assert all(set(pinned[pinned < last].tolist()) <= set(row.tolist()) for row in chosen)


CASES = {
    "FP16 SHARED": {},
    "FP16 SEPARATE": {"head_select_mode": "SEPARATE"},
    "FP16 no dense layer": {"dense_layer_num": 0},
    "INT8 BLOCK_MAX": {"kv_type": "INT8", "anchor_type": "BLOCK_MAX"},
    "INT4 FIXED SEPARATE": {
        "kv_type": "INT4",
        "anchor_type": "FIXED",
        "head_select_mode": "SEPARATE",
    },
}


@pytest.mark.parametrize("position_mode", ["native", "extrapolate"])
@pytest.mark.parametrize("changes", CASES.values(), ids=CASES.keys())
def test_sparse_decode_with_the_kernel_equals_the_torch_path(changes, position_mode):
    model = tiny_model()
    ids = torch.randint(0, model.cfg.vocab_size, (600,), generator=torch.Generator().manual_seed(1))
    settings = small_settings(**({"anchor_type": "QUEST"} | changes))
    reference = sparse_cache(model, settings, position_mode, ops_backend="torch")
    cache = sparse_cache(model, settings, position_mode, ops_backend="auto")
    assert isinstance(cache.path, CpuKernelPath)
    assert not isinstance(reference.path, CpuKernelPath)
    want = run(model, reference, ids, 64, 24)
    got = run(model, cache, ids, 64, 24)
    # Both compute in fp32, in different orders: logits of scale ~16 (this tiny model's)
    # differ by up to ~1e-4 on an AMD EPYC and ~1.5e-4 on an Intel Xeon (1e-5 of the
    # largest); a wrong key, block or scale moves them by orders of magnitude more.
    torch.testing.assert_close(got, want, atol=2e-5 * want.abs().max().item(), rtol=1e-4)
    s, ref = cache.stats(), reference.stats()
    assert [layer.selected for layer in s.layers] == [layer.selected for layer in ref.layers]
    assert any(layer.selected for layer in s.layers)
    assert (s.hits, s.misses) == (ref.hits, ref.misses)


def test_dynamic_anchors_keep_the_torch_path():
    """DYNAMIC anchors need the window's attention probabilities, which the kernel does not
    return."""
    cache = sparse_cache(tiny_model(), small_settings(anchor_type="DYNAMIC"), ops_backend="auto")
    assert not isinstance(cache.path, CpuKernelPath)


@pytest.mark.parametrize(
    ("shape", "dim"), [((9, 1), 64), ((3, 17), 64), ((2, 5), 128), ((40,), 32)]
)
def test_rotate_equals_the_torch_rotation_bit_for_bit(shape, dim):
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(*shape, dim, generator=gen) * 5).bfloat16()
    tokens = shape[-1] if len(shape) > 1 else 1
    angles = torch.randn(tokens, dim, generator=gen) * 3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    if len(shape) == 1:
        x = x.unsqueeze(-2)
    assert torch.equal(cpu_kernel.rotate(x, cos, sin), rotate(x, cos, sin))
    # A strided view (the query heads of a fused projection) is read where it lies.
    wide = torch.cat([x, x], dim=-1)[..., dim:]
    assert torch.equal(cpu_kernel.rotate(wide, cos, sin), rotate(x, cos, sin))


def test_the_caches_rotate_bf16_with_the_kernel_and_the_rest_with_torch():
    assert rotation("cpu", torch.bfloat16) is cpu_kernel.rotate
    assert rotation("cpu", torch.float32) is rotate
    assert rotation("cpu", torch.bfloat16, "torch") is rotate
    with pytest.raises(RuntimeError, match="bf16"):
        cpu_kernel.rotate(torch.randn(1, 64), torch.randn(1, 64), torch.randn(1, 64))


def _dequantized_by_torch(pool: BlockPool, slots: torch.Tensor) -> torch.Tensor:
    """The pool's rows at `slots` split into values, scales (and minimums) and dequantized by
    kv/quant.py's torch functions: the reference of every gather."""
    rows = pool.storage[slots]
    n, block, dim, groups = len(slots), pool.block_size, pool.head_dim, pool.head_dim // 32
    if pool.kv_type == "INT8":
        q = rows[:, : block * dim].view(torch.int8).view(n, block, dim)
        scale = rows[:, block * dim :].view(torch.float16).view(n, block, groups)
        return dequantize_int8(q, scale, pool.dtype)
    packed = rows[:, : block * dim // 2].view(n, block, dim // 2)
    meta = rows[:, block * dim // 2 :].view(torch.float16).view(n, 2, block, groups)
    return dequantize_int4(packed, meta[:, 0], meta[:, 1], pool.dtype)


@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_gathered_blocks_equal_torchs_dequantization(dim, dtype, kv_type):
    n_kv, n_blocks, block = 2, 5, 160
    pool, _ = _quantized_pools(kv_type, n_kv, n_blocks, block, dim, dtype)
    slots = torch.tensor([9, 0, 4, 4, 7])
    out = torch.full((8, block, dim), float("nan"), dtype=dtype)
    got = cpu_kernel.gather_blocks(pool.storage, slots, out, kv_type)
    assert got.data_ptr() == out.data_ptr() and got.shape == (5, block, dim)
    assert torch.equal(got, _dequantized_by_torch(pool, slots))
    assert out[5:].isnan().all()
    assert torch.equal(pool.gather(slots, out), got)  # the pool gathers with the kernel


def test_a_slot_outside_the_pool_is_refused():
    pool, _ = _quantized_pools("INT4", 1, 3, 16, 64, torch.float32)
    out = torch.empty(2, 16, 64)
    with pytest.raises(RuntimeError, match="slot 3 is outside the pool"):
        cpu_kernel.gather_blocks(pool.storage, torch.tensor([0, 3]), out, "INT4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_max_equals_torchs_amax(dtype):
    scores = torch.randn(3, 7 * 128, 96, generator=torch.Generator().manual_seed(2)).to(dtype)
    got = cpu_kernel.block_max(scores, 128)
    assert got.dtype == torch.float32 and got.shape == (3, 7, 96)
    assert torch.equal(got, scores.unflatten(1, (7, 128)).amax(2).float())
