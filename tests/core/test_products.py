"""bf16 products at every CPU level this machine runs: in hardware where the level has bf16
products, else in fp32 on the widened values; either way the exact products, rounded once.
int4 weights below bf16 hardware run the integer kernel, whose one other rounding (the inputs
to 16-bit integers) has its own bound."""

from __future__ import annotations

import pytest
import torch

from kvchat.core import cpu_ops
from kvchat.core.int4_layer import pack_int4
from kvchat.core.linear import DenseLinear, PackedInt4Linear
from kvchat.core.weights import Int4Groups
from kvchat.kv.attention import decode_attention, partial_attention
from kvchat.native.cpu import CpuLevel, machine_level, widened_products

LEVELS = [lv.value for lv in CpuLevel if lv.rank <= machine_level().rank]


def _bf16(*shape, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


def _within_bf16_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """got is exact's value rounded to bf16, but for fp32 sums in another order: within 2^-8
    of each value (two bf16 roundings) plus fp32's error on the sum."""
    assert got.dtype == torch.bfloat16
    bound = 2**-8 * exact.abs() + 1e-5 * exact.abs().max()
    assert ((got.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("rows", [1, 300])
def test_dense_products_are_exact_at_every_level(level, rows, at_level):
    weight, bias, x = _bf16(200, 576, seed=1), _bf16(200, seed=2), _bf16(rows, 576, seed=3)
    exact = x.double() @ weight.double().T + bias.double()
    with at_level(level):
        kept = DenseLinear(weight, bias)
        widened_per_call = DenseLinear(weight, bias, copy=False)
        _within_bf16_rounding(kept(x), exact)
        _within_bf16_rounding(widened_per_call(x), exact)


@pytest.mark.parametrize("level", LEVELS)
def test_a_prefill_chunk_through_int4_weights_is_exact_at_every_level(level, at_level):
    ops = cpu_ops.load()
    if ops is None:
        pytest.skip("no C++ compiler: the torch int4 kernel is used")
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (64, 576), generator=gen, dtype=torch.uint8)
    scale = (torch.rand(64, 18, generator=gen) * 0.02 + 1e-3).half().float()
    minimum = (-8 * scale).half().float()
    groups = Int4Groups(q, scale, minimum)
    pack = pack_int4(groups)
    assert pack is not None
    x = _bf16(PackedInt4Linear.UNPACK_ROWS, 576, seed=5)
    with at_level(level):
        got = PackedInt4Linear(pack, None, ops)(x)
        widened = widened_products(torch.device("cpu"), torch.bfloat16)
    if not widened:
        # The chunk's product multiplies the weight as rounded to bf16 once.
        _within_bf16_rounding(got, x.double() @ groups.dequantize().bfloat16().double().T)
        return
    # Below bf16 hardware the integer kernel multiplies the exact int4 weight by each row
    # rounded to 16-bit integers per group of 32: within 1/65024 of the group's largest value.
    weight = q.double() * scale.double().repeat_interleave(32, 1)
    weight += minimum.double().repeat_interleave(32, 1)
    exact = x.double() @ weight.T
    group_max = x.double().abs().reshape(x.shape[0], -1, 32).amax(-1)
    group_weight = weight.abs().reshape(weight.shape[0], -1, 32).sum(-1)
    bound = 2**-8 * exact.abs() + group_max @ group_weight.T / 65024 + 1e-5 * exact.abs().max()
    assert got.dtype == torch.bfloat16
    assert ((got.double() - exact).abs() <= bound).all()


def _within_probability_rounding(got: torch.Tensor, exact: torch.Tensor) -> None:
    """As _within_bf16_rounding, where the bf16 paths also round the probabilities to bf16
    before the values multiply them."""
    assert got.dtype == torch.bfloat16
    bound = 2**-7 * exact.abs() + 2**-8 * exact.abs().max()
    assert ((got.double() - exact).abs() <= bound).all()


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
    group = q.shape[0] // k.shape[0]
    k, v = k.double().repeat_interleave(group, 0), v.double().repeat_interleave(group, 0)
    scores = q.double() @ k.transpose(1, 2) * q.shape[-1] ** -0.5
    if causal:
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("causal", [False, True])
def test_chunk_attention_is_exact_at_every_level(level, causal, at_level):
    # Causal: the chunk's own keys (square); else the keys before it.
    keys = 40 if causal else 100
    q, k, v = _bf16(9, 40, 64, seed=6), _bf16(3, keys, 64, seed=7), _bf16(3, keys, 64, seed=8)
    with at_level(level):
        out, lse = partial_attention(q, k, v, causal)
    assert lse.dtype == torch.float32
    _within_probability_rounding(out, _reference(q, k, v, causal))


@pytest.mark.parametrize("level", LEVELS)
def test_decode_attention_is_exact_at_every_level(level, at_level):
    q, k, v = _bf16(9, 1, 64, seed=9), _bf16(3, 300, 64, seed=10), _bf16(3, 300, 64, seed=11)
    with at_level(level):
        out, received = decode_attention([(q, k[:, :200], v[:, :200]), (q, k[:, 200:], v[:, 200:])])
    assert received.shape == (3, 200)
    _within_probability_rounding(out, _reference(q, k, v, causal=False))
