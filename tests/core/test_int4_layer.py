"""The int4 decode calls (core/csrc/int4_layer.cpp, core/int4_layer.py): the product against
the exact weights within its inputs' 16-bit rounding, the fused layer calls against the single
ops one after another (bit for bit), and the bundled model's decode steps through them against
its torch int4 path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kvchat.core import cpu_ops
from kvchat.core.int4_layer import Int4DecodeLayer, pack_int4
from kvchat.core.linear import LinearKind, PackedInt4Linear, linear_kind
from kvchat.core.weights import Int4Groups
from kvchat.native.cpu import cpu_level, machine_level, widened_products

OPS = cpu_ops.load()
pytestmark = pytest.mark.skipif(
    OPS is None or not OPS.int4_vectorized,
    reason="the int4 decode calls need the C++ ops with a vector path (AVX-512 VNNI or AVX2)",
)


# The int4 groups' scales: fp16 per 32 (Q4_0, Q4_1), fp32 per 32 (Q4_K), fp32 per 16 (Q2_K,
# Q3_K).
SCALES = ["fp16", "fp32", "per-16"]


def _groups(out_features: int, in_features: int, seed: int = 0, scales: str = "fp16") -> Int4Groups:
    """Q4_1-like groups: fp16 scales and minimums, as a GGUF holds them; Q4_K-like ones
    ("fp32"): an fp16 super-block scale times a 6-bit integer per group of 32, exact only in
    fp32; or Q2_K / Q3_K-like ones ("per-16"): such scales, signed as Q3_K's, and minimums
    per 16 inputs."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out_features, in_features), generator=gen, dtype=torch.uint8)
    shape = (out_features, in_features // (16 if scales == "per-16" else 32))
    if scales != "fp16":
        d, dmin = ((torch.rand(out_features, 1, generator=gen) * 1e-3).half().float() for _ in "dm")
        low, high = (-32, 32) if scales == "per-16" else (1, 64)
        scale = d * torch.randint(low, high, shape, generator=gen)
        minimum = -dmin * torch.randint(0, 64, shape, generator=gen)
    else:
        scale = (torch.rand(shape, generator=gen) * 0.02 + 1e-3).half().float()
        minimum = (-8 * scale + torch.rand(shape, generator=gen) * 1e-3).half().float()
    return Int4Groups(q, scale, minimum)


def _bf16(*shape, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * scale).bfloat16()


def _linear(x: torch.Tensor, groups: Int4Groups) -> torch.Tensor:
    pack = pack_int4(groups)
    assert pack is not None
    return OPS.int4_linear(x, *pack.parts)


@pytest.mark.parametrize("scales", SCALES)
@pytest.mark.parametrize(("rows", "out_features", "in_features"), [(1, 960, 576), (3, 48, 64)])
def test_int4_linear_is_the_exact_weights_product_within_its_inputs_rounding(
    rows, out_features, in_features, scales
):
    """An odd number of 16-row tiles (48 rows) too: the last one alone. The inputs go in as
    16-bit integers per group of 32 (dx = max |x| / 32512), each within dx / 2 of its value,
    so a row's product moves by at most the sum of |scale| q dx / 2 over its inputs; then
    one rounding to bf16 (2^-8 relative at most) and fp32 sums. The K-quants' scales and
    minimums stay fp32 in the pack, so their weights are exact too."""
    groups = _groups(out_features, in_features, scales=scales)
    pack = pack_int4(groups)
    wide = torch.float16 if scales == "fp16" else torch.float32
    assert pack is not None and pack.scale.dtype == wide
    x = _bf16(rows, in_features, seed=1)
    got = _linear(x, groups)
    exact = x.double() @ groups.dequantize().double().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, out_features)
    dx = x.double().view(rows, -1, 32).abs().amax(-1) / 32512  # [rows, groups of 32]
    size = groups.group_size
    weight_bound = groups.scale.double().abs().repeat_interleave(size, 1) * groups.q.double()
    rounding = (dx.repeat_interleave(32, 1) / 2) @ weight_bound.T
    error = (got.double() - exact).abs()
    assert (error <= rounding + exact.abs() * 2**-8 + 1e-5 * exact.abs().max()).all()


def test_int4_products_equal_the_machine_levels_bit_for_bit(at_level):
    """At a lowered CPU level (make test's second pass), the int4 products and the fused
    decode calls are the machine level's bit for bit: the same integer sums, the same fp32
    arithmetic after them."""
    if cpu_level() is machine_level():
        pytest.skip("runs at the machine's own level: nothing to compare")
    with at_level(None):
        native = cpu_ops.build()
    assert native is not None and native.int4_vectorized
    x = _bf16(3, 576, seed=9)
    for scales in SCALES:
        pack = pack_int4(_groups(960, 576, scales=scales))
        assert pack is not None
        assert torch.equal(OPS.int4_linear(x, *pack.parts), native.int4_linear(x, *pack.parts))
        assert torch.equal(OPS.int4_dequantize(*pack.parts), native.int4_dequantize(*pack.parts))
        many = _bf16(70, 576, seed=12)  # the AVX2 level's path for many rows
        ours, theirs = OPS.int4_linear(many, *pack.parts), native.int4_linear(many, *pack.parts)
        assert torch.equal(ours, theirs)
    layers = [_layer(576, 1536, 960, True, ops, "per-16")[0] for ops in (OPS, native)]
    token, attn = _bf16(1, 576, seed=10), _bf16(9, 1, 64, seed=11)
    for ours, theirs in zip(layers[0].qkv(token), layers[1].qkv(token), strict=True):
        assert torch.equal(ours, theirs)
    assert torch.equal(layers[0].tail(token, attn), layers[1].tail(token, attn))


def test_the_baseline_level_products_equal_the_vector_ones_bit_for_bit(at_level):
    """Below AVX2 the int4 products run one value at a time, and the model takes them there
    for Q2_K's and Q3_K's scales per 16, which torch's int4 kernel cannot hold: the same
    integer sums and fp32 arithmetic, in the same order, as this machine's vector path."""
    with at_level("baseline"):
        baseline = cpu_ops.build()
    assert baseline is not None and not baseline.int4_vectorized
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    assert linear_kind(96, 576, True, False, "int4", bf16, cpu, baseline) is LinearKind.TORCH_INT4
    per_16 = linear_kind(96, 576, True, False, "int4", bf16, cpu, baseline, 16)
    assert per_16 is LinearKind.PACKED_INT4
    fp32 = linear_kind(96, 576, True, False, "int4", torch.float32, cpu, OPS, 16)
    assert fp32 is LinearKind.DENSE  # neither kernel takes fp32 activations with these
    for scales in SCALES:
        pack = pack_int4(_groups(96, 576, scales=scales))
        assert pack is not None
        for x in (_bf16(1, 576, seed=13), _bf16(5, 576, seed=14)):
            ours = baseline.int4_linear(x, *pack.parts)
            assert torch.equal(ours, OPS.int4_linear(x, *pack.parts))
        assert torch.equal(baseline.int4_dequantize(*pack.parts), OPS.int4_dequantize(*pack.parts))


def test_pack_int4_declines_what_the_layout_cannot_hold():
    assert pack_int4(_groups(40, 64)) is None  # rows not a multiple of 16


def test_the_calls_refuse_mismatched_weights():
    pack = pack_int4(_groups(32, 64))
    assert pack is not None
    with pytest.raises(RuntimeError, match="for 96 inputs"):
        OPS.int4_linear(_bf16(1, 96), *pack.parts)
    norm = _bf16(64)
    with pytest.raises(RuntimeError, match="o must give H rows"):
        Int4DecodeLayer(pack, pack, pack, pack, norm, norm, 1e-5, None, [1, 0, 1], OPS)
    square = pack_int4(_groups(64, 64))
    down = pack_int4(_groups(64, 32))
    layer = Int4DecodeLayer(square, square, square, down, norm, norm, 1e-5, None, [2, 1, 1], OPS)
    with pytest.raises(RuntimeError, match="bf16"):
        layer.qkv(torch.randn(1, 64))
    with pytest.raises(RuntimeError, match="64 values"):
        layer.tail(_bf16(1, 64), _bf16(2, 1, 16))


def _layer(
    hidden: int, intermediate: int, heads_out: int, bias: bool, ops=OPS, scales: str = "fp16"
) -> tuple:
    """A layer's packs; o and down hold `scales` (a file mixing Q4_0 with Q4_K or Q3_K
    projections)."""
    qkv, o = _groups(heads_out, hidden, 1), _groups(hidden, hidden, 2, scales)
    gate_up, down = _groups(2 * intermediate, hidden, 3), _groups(hidden, intermediate, 4, scales)
    attn_norm, mlp_norm = _bf16(hidden, seed=5), _bf16(hidden, seed=6)
    qkv_bias = _bf16(heads_out, seed=7) if bias else None
    packs = [pack_int4(g) for g in (qkv, o, gate_up, down)]
    heads = [heads_out // 64 - 6, 3, 3]  # head_dim 64, SmolLM2's 9 / 3 / 3 at 960
    layer = Int4DecodeLayer(*packs, attn_norm, mlp_norm, 1e-5, qkv_bias, heads, ops)
    return layer, (qkv, o, gate_up, down, attn_norm, mlp_norm, qkv_bias)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(
    ("bias", "scales"), [(False, "fp16"), (True, "fp16"), (False, "fp32"), (False, "per-16")]
)
def test_the_fused_calls_equal_the_single_ops_one_after_another(threads, bias, scales):
    """SmolLM2's shapes (hidden 576, intermediate 1536, q + k + v 960): bit for bit."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        layer, (qkv, o, gate_up, down, attn_norm, mlp_norm, qkv_bias) = _layer(
            576, 1536, 960, bias, scales=scales
        )
        x, attn = _bf16(1, 576, scale=2.0, seed=8), _bf16(1, 576, seed=9)
        want_qkv = _linear(OPS.rms_norm(x, attn_norm, 1e-5), qkv)
        if qkv_bias is not None:
            want_qkv = want_qkv + qkv_bias
        q, k, v = layer.qkv(x)
        assert (q.shape, k.shape, v.shape) == ((9, 1, 64), (3, 1, 64), (3, 1, 64))
        assert torch.equal(torch.cat([q, k, v]).view(1, -1), want_qkv)
        y = x + _linear(attn, o)
        mlp = _linear(OPS.silu_mul(_linear(OPS.rms_norm(y, mlp_norm, 1e-5), gate_up)), down)
        assert torch.equal(layer.tail(x, attn), y + mlp)
        # The attention's [heads, 1, head_dim] as it comes, and the same values strided.
        assert torch.equal(layer.tail(x, attn.view(9, 1, 64)), y + mlp)
        spaced = torch.zeros(1, 2 * 576, dtype=torch.bfloat16)
        spaced[:, ::2] = attn
        assert torch.equal(layer.tail(x, spaced[:, ::2]), y + mlp)
    finally:
        torch.set_num_threads(before)


def test_many_rows_go_through_the_unpacked_bf16_weight_where_bf16_products_are_in_hardware():
    for scales in SCALES:  # one rounding, as torch's, from fp16 or fp32 scales
        pack = pack_int4(groups := _groups(96, 128, scales=scales))
        assert pack is not None
        assert torch.equal(OPS.int4_dequantize(*pack.parts), groups.dequantize().bfloat16())
    pack = pack_int4(groups := _groups(96, 128))
    assert pack is not None
    unpacked = OPS.int4_dequantize(*pack.parts)
    bias = _bf16(96, seed=2)
    linear = PackedInt4Linear(pack, bias, OPS)
    few, many = _bf16(2, 128, seed=3), _bf16(PackedInt4Linear.UNPACK_ROWS, 128, seed=4)
    assert torch.equal(linear(few), OPS.int4_linear(few, *pack.parts) + bias)
    # Many rows: the bf16 product in hardware, else the int4 product (it beats fp32 products
    # on the widened values).
    if widened_products(unpacked.device, unpacked.dtype):
        assert torch.equal(linear(many), OPS.int4_linear(many, *pack.parts) + bias)
    else:
        assert torch.equal(linear(many), F.linear(many, unpacked, bias))
    assert torch.equal(linear(many.unsqueeze(0)), linear(many).unsqueeze(0))  # [B, T, K] too


def test_the_int4_product_of_many_rows_equals_its_rows_one_at_a_time():
    """A prefill chunk's rows share each weight tile (four at a time, in blocks); every row
    still gets the bits of its own single-row product, remainders of 1-3 rows included."""
    for scales in ("fp16", "per-16"):
        groups = _groups(160, 256, scales=scales)
        pack = pack_int4(groups)
        assert pack is not None
        for n_rows in (4, 67, 130):
            x = _bf16(n_rows, 256, seed=n_rows)
            many = OPS.int4_linear(x, *pack.parts)
            single = torch.cat([OPS.int4_linear(x[r : r + 1], *pack.parts) for r in range(n_rows)])
            assert torch.equal(many, single), (scales, n_rows)
            assert (many.float() - x.float() @ groups.dequantize().T).abs().max() < 0.05


def test_the_bundled_model_runs_on_the_packed_weights_close_to_its_exact_weights(engine_fp32):
    """bf16 with the GGUF's int4 weights: every projection is packed and every layer has its
    decode calls. Its prompt pass (the bf16 products of unpacked weights) and decode steps
    (the fused calls, bit for bit the single products) pick the fp32 engine's tokens, its
    logits within bf16's reach of the exact weights' (the fp32 engine holds them exactly)."""
    from kvchat.core.model import Transformer
    from kvchat.core.model_files import load_weights
    from kvchat.kv.dense import DenseBackend

    weights = load_weights(engine_fp32.source)
    model = Transformer(weights, dtype=torch.bfloat16, weight_format="int4")
    fused = model._decode_layers
    assert fused is not None and len(fused) == model.cfg.num_layers
    cfg = model.cfg
    prompt = torch.tensor(engine_fp32.tokenizer.encode("The capital of France is the city of"))

    def run(m: Transformer, dtype: torch.dtype, tokens: list[int]) -> list[torch.Tensor]:
        """Logits after the prompt and after each of `tokens` fed one at a time (greedy
        where `tokens` is filled as it goes)."""
        cache = DenseBackend(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, m.rope, dtype, "cpu", 64
        )
        logits = [m.forward(prompt, cache)]
        for step in range(4):
            if len(tokens) == step:
                tokens.append(int(logits[-1].argmax()))
            logits.append(m.forward(torch.tensor([tokens[step]]), cache))
        return logits

    tokens: list[int] = []
    exact = run(engine_fp32.model, torch.float32, tokens)
    ours = run(model, torch.bfloat16, tokens)
    model._decode_layers = None
    try:
        single = run(model, torch.bfloat16, tokens)
    finally:
        model._decode_layers = fused
    for step, (a, b, c) in enumerate(zip(ours, single, exact, strict=True)):
        assert torch.equal(a, b), step  # fused or one product at a time: the same values
        assert torch.equal(a.argmax(-1), c.argmax(-1)), step
        # bf16 activations through 30 layers: 0.7-2.3% of the largest logit here.
        torch.testing.assert_close(a, c, rtol=0, atol=0.05 * c.abs().max().item())
