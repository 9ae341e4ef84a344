"""The decoder's C++ ops (core/csrc/decoder_ops.cpp) against the torch code they replace, and
the Q8_0 output layer against its exact float weights (within its inputs' 16-bit rounding), on
the real model too."""

from __future__ import annotations

import pytest
import torch

from kvchat.core import cpu_ops
from kvchat.core.linear import DenseLinear, Int8Linear, pack_int8, widened_linear
from kvchat.core.model import rms_norm, silu_mul
from kvchat.core.weights import Int8Groups
from kvchat.native.cpu import cpu_level, machine_level, widened_products

OPS = cpu_ops.load()
pytestmark = pytest.mark.skipif(OPS is None, reason="no C++ compiler: the torch code is used")


def _bf16(*shape, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


def _equal_but_rare_roundings(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal but for rare last-bit roundings (the C++ code sums and takes exp in another
    order): a value rounded the other way, and at most one rounding after it."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert (got == want).float().mean() > 0.998
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=0)


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_rms_norm_equals_the_torch_norm(rows):
    x, weight = _bf16(rows, 576, scale=3.0), _bf16(576, seed=1)
    _equal_but_rare_roundings(OPS.rms_norm(x, weight, 1e-5), rms_norm(x, weight, 1e-5))
    # A row of a strided view (the model's last-token slice) reads the right values.
    view = _bf16(4, 2, 576, seed=2)[:, 1]
    _equal_but_rare_roundings(OPS.rms_norm(view, weight, 1e-5), rms_norm(view, weight, 1e-5))


@pytest.mark.parametrize("rows", [1, 7, 300])
def test_silu_mul_equals_silu_of_gate_times_up(rows):
    gate_up = _bf16(rows, 2 * 1536, scale=4.0)
    _equal_but_rare_roundings(OPS.silu_mul(gate_up), silu_mul(gate_up))


def test_the_ops_refuse_what_they_do_not_compute():
    with pytest.raises(RuntimeError, match="must be bf16"):
        OPS.rms_norm(torch.randn(1, 64), torch.randn(64), 1e-5)
    with pytest.raises(RuntimeError, match="weight must have"):
        OPS.rms_norm(_bf16(1, 64), _bf16(32), 1e-5)
    with pytest.raises(RuntimeError, match="must be even"):
        OPS.silu_mul(_bf16(1, 63))
    with pytest.raises(RuntimeError, match="multiple of 32"):
        OPS.int8_linear(
            torch.randn(1, 48), torch.zeros(1, 16 * 48, dtype=torch.uint8), torch.ones(1, 1, 16)
        )
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        OPS.int8_linear(torch.randn(1, 64).half(), *pack_int8(_groups(16, 64)))


def _groups(
    out_features: int, in_features: int, group_size: int = 32, minimum: bool = False
) -> Int8Groups:
    """Q8_0-like groups (a scale per 32), or Q6_K-like ones (`group_size` 16); with a minimum
    per group (Q5_1, Q5_K). Scales and minimums of fp16's precision, as a file's are (Q5_K's
    d * sc has 17 bits): q * scale is exact in fp32, so adding the minimum rounds once
    whatever the order."""
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    shape = (out_features, in_features // group_size)
    scale = (torch.rand(shape, generator=gen) * 0.02).half().float()
    low = -torch.rand(shape, generator=gen).half().float() if minimum else None
    return Int8Groups(q, scale, low)


def _input_rounding(x: torch.Tensor, groups: Int8Groups) -> torch.Tensor:
    """The most the inputs' rounding to 16-bit integers per group of 32 (each within
    max |x| / 32512 / 2 of its value) can move each product: [rows, out_features]. A minimum
    multiplies the inputs' exact sum, so only q * scale counts."""
    dx = x.double().view(x.shape[0], -1, 32).abs().amax(-1) / 32512
    scaled = Int8Groups(groups.q, groups.scale).dequantize().double().abs()
    return (dx / 2) @ scaled.view(groups.q.shape[0], -1, 32).sum(-1).T


GROUPS = [(32, False), (16, False), (32, True), (16, True)]
GROUP_IDS = ["per-32", "per-16", "per-32-minimum", "per-16-minimum"]


@pytest.mark.parametrize(("group_size", "minimum"), GROUPS, ids=GROUP_IDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_is_the_exact_weights_product_within_its_inputs_rounding(
    dtype, group_size, minimum
):
    """1000 rows: the last of 63 tiles of 16 is padded with zero rows."""
    groups = _groups(1000, 576, group_size, minimum)
    x = _bf16(3, 576, seed=4).to(dtype)
    if dtype == torch.float32:
        x = x + torch.randn(3, 576, generator=torch.Generator().manual_seed(5)) * 1e-3
    got = OPS.int8_linear(x, *pack_int8(groups))[:, :1000]
    want = x.double() @ groups.dequantize().double().T
    assert got.dtype == torch.float32
    # fp32 sums: relative error ~1e-6 of the row's magnitude.
    bound = _input_rounding(x, groups) + 1e-6 * want.abs().max()
    assert ((got.double() - want).abs() <= bound).all()


def test_int8_products_equal_the_machine_levels_bit_for_bit(at_level):
    """At a lowered CPU level (make test's second pass), the int8 products are the machine
    level's bit for bit: the same integer sums, the same fp32 arithmetic after them."""
    if cpu_level() is machine_level():
        pytest.skip("runs at the machine's own level: nothing to compare")
    with at_level(None):
        native = cpu_ops.build()
    assert native is not None
    x = _bf16(3, 576, seed=8)
    for group_size, minimum in GROUPS:
        packed = pack_int8(_groups(1000, 576, group_size, minimum))
        assert torch.equal(OPS.int8_linear(x, *packed), native.int8_linear(x, *packed))


@pytest.mark.parametrize(("group_size", "minimum"), GROUPS, ids=GROUP_IDS)
def test_int8_dequantize_is_the_weight_rounded_to_bf16(group_size, minimum):
    groups = _groups(1000, 576, group_size, minimum)
    got = OPS.int8_dequantize(*pack_int8(groups))
    assert got.dtype == torch.bfloat16 and got.shape == (1008, 576)  # 63 tiles of 16
    assert torch.equal(got[:1000], groups.dequantize().bfloat16())
    assert not got[1000:].any()  # the padding rows
    with pytest.raises(RuntimeError, match="multiple of 32"):
        OPS.int8_dequantize(torch.zeros(1, 16 * 48, dtype=torch.uint8), torch.ones(1, 1, 16))
    with pytest.raises(RuntimeError, match="S 1 or 2"):  # a scale per 8 inputs
        OPS.int8_dequantize(torch.zeros(1, 16 * 64, dtype=torch.uint8), torch.ones(1, 8, 16))


def test_a_weight_of_many_tiles_packs_in_blocks_and_unpacks_to_its_values():
    """Past _PACK_TILES tiles (a vocabulary-sized output layer), rows not a multiple of 16."""
    groups = _groups(4100, 64, 16)
    got = OPS.int8_dequantize(*pack_int8(groups))
    assert got.shape == (4112, 64)
    assert torch.equal(got[:4100], groups.dequantize().bfloat16()) and not got[4100:].any()


def test_projections_of_mixed_group_sizes_fuse_on_the_finer():
    """A fused projection of Q5_K and Q6_K parts (a Q5_K_M file's q, k and v) keeps each
    part's exact weights, on a scale per 16 and minimums (zero for the Q6_K part)."""
    parts = [_groups(32, 64, 32, minimum=True), _groups(16, 64, 16)]
    fused = Int8Groups.cat(parts)
    assert fused.group_size == 16 and fused.minimum is not None
    assert torch.equal(fused.dequantize(), torch.cat([g.dequantize() for g in parts]))


def test_int8_linear_runs_a_few_rows_as_int8_and_more_on_the_unpacked_weight():
    groups = _groups(500, 576)
    bias = _bf16(500, seed=9)
    layer = Int8Linear(groups, bias, OPS, torch.bfloat16)
    x = _bf16(1, 576, seed=5)
    exact = x.double() @ groups.dequantize().double().T + bias.double()
    got = layer(x)
    assert got.shape == (1, 500) and got.dtype == torch.bfloat16
    # The int8 product's bound, then the rounding of the result to bf16.
    bound = _input_rounding(x, groups) + 1e-6 * exact.abs().max() + exact.abs() * 2**-8
    assert ((got.double() - exact).abs() <= bound).all()
    assert layer.read_bytes == 512 * 576 + 512 * 18 * 4 + 500 * 2  # 32 tiles of 16, the bias

    hardware = not widened_products(torch.device("cpu"), torch.bfloat16)
    rows = _bf16(Int8Linear.UNPACK_ROWS if hardware else Int8Linear.WIDEN_ROWS, 576, seed=6)
    if not hardware and OPS.integer_products == "avx512-vnni":  # the int8 product still
        assert layer._unpack_rows is None
        exact = rows.double() @ groups.dequantize().double().T + bias.double()
        bound = _input_rounding(rows, groups) + 1e-6 * exact.abs().max() + exact.abs() * 2**-8
        assert ((layer(rows).double() - exact).abs() <= bound).all()
        return
    # The weight unpacked to bf16: in bf16 products where they are in hardware, else in fp32
    # on the widened values.
    product = torch.nn.functional.linear if hardware else widened_linear
    assert torch.equal(layer(rows), product(rows, groups.dequantize().bfloat16(), bias))
    # With a bf16 table the model holds anyway (a tied embedding), that table.
    table = _bf16(500, 576, seed=10)
    head = Int8Linear(groups, None, OPS, torch.float32, table)
    assert torch.equal(head(rows), product(rows, table).float())


def test_the_bundled_model_reads_its_q8_0_head_as_stored(engine_fp32):
    """bf16 on the CPU: the output layer is the GGUF's int8 table, and its logits are the
    exact table's but for the inputs' 16-bit rounding (the fp32 engine's dense head holds the
    same exact values)."""
    from kvchat.core.model import Transformer
    from kvchat.core.model_files import load_weights

    weights = load_weights(engine_fp32.source)
    model = Transformer(weights, dtype=torch.bfloat16, weight_format="int4")
    assert isinstance(model.lm_head, Int8Linear)
    x = _bf16(1, model.cfg.hidden_size, seed=7)
    exact = x.double() @ weights.tensors["model.embed_tokens.weight"].double().T
    got = model.lm_head(x)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-4 * exact.abs().max())
    # The bf16 table's product (what the head was) is off by the table's rounding, >10x more.
    rounded = model.embed.weight.double()
    assert (x.double() @ rounded.T - exact).abs().max() > 10 * (got.double() - exact).abs().max()
    plain = Transformer(weights, dtype=torch.bfloat16, weight_format="dense")
    assert isinstance(plain.lm_head, DenseLinear)
    assert model.nbytes < plain.nbytes - 20 * 2**20  # no bf16 prepacked copy of the table
