"""KV block storage: quantizer error bounds, degenerate groups, the pool's gather and sizes."""

from __future__ import annotations

import pytest
import torch

from kvchat.kv import quant
from kvchat.kv.quant import (
    GROUP,
    KV_TYPES,
    BlockPool,
    bytes_per_token,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
)

BLOCK, DIM = 16, 64
# Slack on the stated bounds for fp32 arithmetic (the fp16 scales are rounded down, so their
# rounding only tightens the bounds).
SLACK = 1 + 1e-3
# Below this the scale is clamped at SCALE_MIN, so the error floor is SCALE_MIN / 2.
FLOOR = quant.SCALE_MIN / 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _keys_like(seed: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Gaussian values with a few large outlier channels, the way real keys look."""
    x = torch.randn(shape, generator=_gen(seed))
    x[..., 5] *= 40
    x[..., 37] += 300
    return x


def _roundtrip(kv_type: str, x: torch.Tensor) -> torch.Tensor:
    if kv_type == "INT8":
        return dequantize_int8(*quantize_int8(x), torch.float32)
    return dequantize_int4(*quantize_int4(x), torch.float32)


def _int8_bound(x: torch.Tensor) -> torch.Tensor:
    """Per-value bound: half the scale, max|x_group| / 254."""
    g = x.view(*x.shape[:-1], -1, GROUP)
    per_group = (g.abs().amax(-1) / 254).clamp(min=FLOOR) * SLACK
    return per_group.repeat_interleave(GROUP, -1)


def _int4_bound(x: torch.Tensor) -> torch.Tensor:
    """Per-value bound: half the scale, (max - min) / 30, where min is first rounded down to fp16
    (it moves by at most one fp16 ulp, <= |min| * 2**-10)."""
    g = x.view(*x.shape[:-1], -1, GROUP)
    lo, hi = g.amin(-1), g.amax(-1)
    ulp = lo.abs() * 2.0**-10 + 2.0**-24
    per_group = ((hi - lo + ulp) / 30).clamp(min=FLOOR) * SLACK
    return per_group.repeat_interleave(GROUP, -1)


@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
# At 30 the outlier channel peaks near 1e4, as real keys can.
@pytest.mark.parametrize("scale", [1e-3, 1.0, 30.0])
def test_roundtrip_error_within_bound_per_group(kv_type: str, scale: float) -> None:
    x = _keys_like(0, (4, BLOCK, DIM)) * scale
    bound = _int8_bound(x) if kv_type == "INT8" else _int4_bound(x)
    err = (_roundtrip(kv_type, x) - x).abs()
    assert (err <= bound).all(), (err / bound).max()


def test_int4_minimum_is_rounded_down() -> None:
    # A narrow range far from zero: rounding the minimum to *nearest* fp16 (ulp 0.5 here) would
    # put values below the stored minimum, with errors up to 0.25 against a bound of 1/30.
    x = 1000.3 + torch.rand(8, 2 * GROUP, generator=_gen(1))
    err = (_roundtrip("INT4", x) - x).abs()
    assert (err <= _int4_bound(x)).all()
    assert err.max() < 0.06


@pytest.mark.parametrize(
    ("kv_type", "limit"),
    # Measured on this data: INT8 0.53 %, INT4 7.8 % relative RMS error.
    [("INT8", 0.006), ("INT4", 0.085)],
)
def test_relative_rms_error_on_gaussian_data(kv_type: str, limit: float) -> None:
    x = torch.randn(8, 128, DIM, generator=_gen(2))
    rel = (_roundtrip(kv_type, x) - x).norm() / x.norm()
    assert rel < limit


def test_formats() -> None:
    x = torch.randn(3, BLOCK, DIM, generator=_gen(3)).to(torch.bfloat16)
    q, scale = quantize_int8(x)
    assert (q.dtype, q.shape) == (torch.int8, x.shape)
    assert (scale.dtype, scale.shape) == (torch.float16, (3, BLOCK, DIM // GROUP))
    assert q.abs().max() <= 127
    packed, scale4, minimum = quantize_int4(x)
    assert (packed.dtype, packed.shape) == (torch.uint8, (3, BLOCK, DIM // 2))
    assert scale4.dtype == minimum.dtype == torch.float16
    assert scale4.shape == minimum.shape == (3, BLOCK, DIM // GROUP)
    # Low nibble = even index: rebuild q by hand and compare with the dequantized values.
    q4 = torch.stack((packed & 15, packed >> 4), dim=-1).view(x.shape).float()
    grouped = q4.view(3, BLOCK, -1, GROUP) * scale4.float()[..., None] + minimum.float()[..., None]
    assert torch.equal(
        grouped.view(x.shape), dequantize_int4(packed, scale4, minimum, torch.float32)
    )


def test_dequantize_rounds_once_to_the_output_dtype() -> None:
    x = _keys_like(4, (2, BLOCK, DIM))
    q, scale = quantize_int8(x)
    exact = dequantize_int8(q, scale, torch.float32)
    assert torch.equal(dequantize_int8(q, scale, torch.bfloat16), exact.to(torch.bfloat16))
    parts = quantize_int4(x)
    exact4 = dequantize_int4(*parts, torch.float32)
    assert torch.equal(dequantize_int4(*parts, torch.bfloat16), exact4.to(torch.bfloat16))


DEGENERATE = {
    "zeros": torch.zeros(GROUP),
    "constant": torch.full((GROUP,), 3.25),
    "negative constant": torch.full((GROUP,), -1e4),
    "tiny": torch.full((GROUP,), 1e-30),
    "single huge outlier": torch.cat(
        [torch.full((1,), 1e4), torch.randn(GROUP - 1, generator=_gen(10)) * 1e-3]
    ),
    "near fp16 max": torch.linspace(-65504, 65504, GROUP),
    "beyond fp16 range": torch.linspace(-1e9, 1e9, GROUP),
}


@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
@pytest.mark.parametrize("name", list(DEGENERATE))
def test_degenerate_groups_stay_finite(kv_type: str, name: str) -> None:
    x = DEGENERATE[name].repeat(2, 2)  # [2, 64]: two groups per row
    parts = quantize_int8(x) if kv_type == "INT8" else quantize_int4(x)
    for part in parts[1:]:
        assert torch.isfinite(part).all(), f"non-finite scale/minimum for {name}"
    y = _roundtrip(kv_type, x)
    assert torch.isfinite(y).all() and torch.isfinite(y.to(torch.bfloat16)).all()
    if name == "beyond fp16 range":
        return  # saturates, by design; no fp16 output can hold these values anyway
    # Within the fp16 range the grid never leaves [min, max], so fp16 outputs are finite too.
    dequant = dequantize_int8 if kv_type == "INT8" else dequantize_int4
    assert torch.isfinite(dequant(*parts, torch.float16)).all()
    bound = _int8_bound(x) if kv_type == "INT8" else _int4_bound(x)
    assert ((y - x).abs() <= bound).all()
    if name == "zeros" or (kv_type == "INT4" and name.endswith("constant")):
        assert torch.equal(y, x)


def _filled_pool(
    kv_type: str, dtype: torch.dtype, n_slots: int = 12
) -> tuple[BlockPool, torch.Tensor]:
    """A pool with every slot written, and the values written to each slot."""
    pool = BlockPool(n_slots, BLOCK, DIM, kv_type, dtype)
    written = _keys_like(5, (n_slots, BLOCK, DIM))
    # The second half arrives as bf16: write() takes any float dtype.
    half = n_slots // 2
    order = torch.randperm(n_slots, generator=_gen(6))
    written[order[half:]] = written[order[half:]].to(torch.bfloat16).float()
    # Two batches, out of order, to exercise slot addressing.
    pool.write(order[:half], written[order[:half]])
    pool.write(order[half:], written[order[half:]].to(torch.bfloat16))
    return pool, written


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp16_pool_is_exact(dtype: torch.dtype) -> None:
    pool, written = _filled_pool("FP16", dtype)
    expected = written.to(dtype)
    out = torch.empty(20, BLOCK, DIM, dtype=dtype)
    slots = torch.tensor([11, 0, 3, 3, 7])
    assert torch.equal(pool.gather(slots, out), expected[slots])
    assert all(torch.equal(pool.read(i), expected[i]) for i in range(12))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
def test_pool_stores_what_the_quantizer_gives(kv_type: str, dtype: torch.dtype) -> None:
    pool = BlockPool(3, BLOCK, DIM, kv_type, dtype)
    x = _keys_like(8, (3, BLOCK, DIM))
    pool.write(torch.tensor([2, 0, 1]), x)
    for slot, i in ((2, 0), (0, 1), (1, 2)):
        assert torch.equal(pool.read(slot), _roundtrip(kv_type, x[i]).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_gather_any_order_equals_read(kv_type: str, dtype: torch.dtype) -> None:
    pool, _ = _filled_pool(kv_type, dtype)
    reads = torch.stack([pool.read(i) for i in range(pool.n_slots)])
    out = torch.full((40, BLOCK, DIM), float("nan"), dtype=dtype)
    for slots in ([5, 5, 5, 0], list(range(11, -1, -1)), [3], [7, 1, 7, 2, 11, 0, 0]):
        idx = torch.tensor(slots)
        got = pool.gather(idx, out)
        assert got.data_ptr() == out.data_ptr() and got.shape == (len(slots), BLOCK, DIM)
        assert torch.equal(got, reads[idx])


# The torch path's scratch: fp16 pools take it on every CPU (the kernel dequantizes into
# bf16 and fp32 only).
@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
def test_gather_grows_scratch_and_stays_correct(
    kv_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quant, "_workspace", quant._Workspace())  # sizes from this test only
    pool, _ = _filled_pool(kv_type, torch.float16)
    reads = torch.stack([pool.read(i) for i in range(pool.n_slots)])
    out = torch.empty(40, BLOCK, DIM, dtype=torch.float16)
    idx = torch.randint(0, pool.n_slots, (40,), generator=_gen(9))
    for n in (3, 40, 7):  # grow past every earlier gather, then shrink again
        before = quant._workspace.buffers["raw", pool.device].numel()
        assert torch.equal(pool.gather(idx[:n], out), reads[idx[:n]])
        after = quant._workspace.buffers["raw", pool.device].numel()
        assert after == max(before, n * pool.bytes_per_slot)


@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
def test_gather_allocates_nothing_in_the_steady_state(kv_type: str) -> None:
    pool, _ = _filled_pool(kv_type, torch.float16)
    out = torch.empty(8, BLOCK, DIM, dtype=torch.float16)
    idx = torch.tensor([1, 4, 4, 9])
    pool.gather(idx, out)
    buffers = {key: buf.data_ptr() for key, buf in quant._workspace.buffers.items()}
    for _ in range(3):
        pool.gather(idx.flip(0), out)
    assert {key: buf.data_ptr() for key, buf in quant._workspace.buffers.items()} == buffers


def test_pools_share_scratch_without_interference() -> None:
    a, _ = _filled_pool("INT4", torch.float16)
    b = BlockPool(2, BLOCK, DIM, "INT4", torch.float16)
    b.write(torch.arange(2), torch.ones(2, BLOCK, DIM))
    out_a = torch.empty(4, BLOCK, DIM, dtype=torch.float16)
    out_b = torch.empty(4, BLOCK, DIM, dtype=torch.float16)
    got_a = a.gather(torch.tensor([0, 1]), out_a).clone()
    b.gather(torch.tensor([1, 0]), out_b)
    assert torch.equal(out_a[:2], got_a)
    assert torch.equal(out_b[:2], torch.ones(2, BLOCK, DIM, dtype=torch.float16))


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_pool_and_scratch_made_under_inference_mode_work_outside_it(
    kv_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(quant, "_workspace", quant._Workspace())  # scratch made in the block
    x = torch.randn(3, BLOCK, DIM, generator=_gen(11))
    out = torch.empty(3, BLOCK, DIM, dtype=torch.float16)
    with torch.inference_mode():
        pool = BlockPool(3, BLOCK, DIM, kv_type, torch.float16)
        pool.write(torch.arange(2), x[:2])
        inside = pool.gather(torch.tensor([1, 0]), out).clone()
    pool.write(torch.tensor([2]), x[2:])
    assert torch.equal(pool.gather(torch.tensor([1, 0]), out), inside)
    with torch.inference_mode():
        assert torch.equal(pool.gather(torch.tensor([2]), out), pool.read(2)[None])


@pytest.mark.parametrize(
    ("kv_type", "dtype", "expected"),
    [
        ("FP16", torch.bfloat16, 16384),
        ("FP16", torch.float32, 32768),
        ("INT8", torch.bfloat16, 8192 + 512),
        ("INT4", torch.bfloat16, 4096 + 512 + 512),
    ],
)
def test_sizes(kv_type: str, dtype: torch.dtype, expected: int) -> None:
    pool = BlockPool(10, 128, 64, kv_type, dtype)
    assert pool.bytes_per_slot == expected
    assert pool.nbytes == 10 * expected
    assert bytes_per_token(64, kv_type, dtype.itemsize) * 128 == expected
    # Allocated bytes match the accounting.
    assert pool._data.numel() * pool._data.element_size() == pool.nbytes


def test_sizes_for_head_dim_128() -> None:
    assert bytes_per_token(128, "FP16", 2) == 256
    assert bytes_per_token(128, "INT8", 2) == 128 + 8
    assert bytes_per_token(128, "INT4", 2) == 64 + 8 + 8


def test_bad_arguments_raise_value_error_naming_the_value() -> None:
    with pytest.raises(ValueError, match="'FP8'"):
        BlockPool(4, BLOCK, DIM, "FP8", torch.bfloat16)
    with pytest.raises(ValueError, match="'int8'"):
        bytes_per_token(DIM, "int8", 2)
    for kv_type in ("INT8", "INT4"):
        with pytest.raises(ValueError, match="48"):
            BlockPool(4, BLOCK, 48, kv_type, torch.bfloat16)
        with pytest.raises(ValueError, match="48"):
            bytes_per_token(48, kv_type, 2)
    BlockPool(4, BLOCK, 48, "FP16", torch.bfloat16)  # any head_dim is fine unquantized
    BlockPool(4, BLOCK, DIM, "INT4", torch.bfloat16, pin=True)  # ignored without CUDA
    with pytest.raises(ValueError, match="48"):
        quantize_int8(torch.zeros(2, 48))
    pool = BlockPool(4, BLOCK, DIM, "INT8", torch.bfloat16)
    with pytest.raises(ValueError, match=r"\[2, 8, 64\]"):
        pool.write(torch.arange(2), torch.zeros(2, 8, DIM))
