"""The decoder's C++ ops (core/csrc/decoder_ops.cpp) against the torch code they replace, and
the Q8_0 output layer against its exact float weights, on the real model too."""

from __future__ import annotations

import pytest
import torch

from kvchat.core import cpu_ops
from kvchat.core.linear import DenseLinear, Int8Linear
from kvchat.core.model import rms_norm, silu_mul
from kvchat.core.weights import Int8Groups

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
        OPS.int8_linear(torch.randn(1, 48), torch.zeros(4, 48, dtype=torch.int8), torch.ones(4, 1))


def _groups(out_features: int, in_features: int) -> Int8Groups:
    gen = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (out_features, in_features), generator=gen, dtype=torch.int8)
    scale = torch.rand(out_features, in_features // 32, generator=gen) * 0.02
    return Int8Groups(q, scale)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int8_linear_is_the_exact_weights_product(dtype):
    groups = _groups(1000, 576)
    x = _bf16(3, 576, seed=4).to(dtype)
    got = OPS.int8_linear(x, groups.q, groups.scale)
    want = x.double() @ groups.dequantize().double().T
    assert got.dtype == torch.float32
    # fp32 sums of 576 products: relative error ~1e-6 of the row's magnitude.
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * want.abs().max().item())


def test_int8_head_takes_one_row_and_leaves_more_to_the_dense_matrix():
    groups = _groups(500, 576)
    dense = DenseLinear(groups.dequantize().bfloat16(), None, prepack=False)
    head = Int8Linear(groups, dense, OPS)
    x = _bf16(1, 576, seed=5)
    exact = x.double() @ groups.dequantize().double().T
    torch.testing.assert_close(head(x).double(), exact, rtol=0, atol=1e-5 * exact.abs().max())
    rows = _bf16(6, 576, seed=6)
    assert torch.equal(head(rows), dense(rows).float())
    assert head.read_bytes == 500 * 576 + 500 * 18 * 4


def test_the_bundled_model_reads_its_q8_0_head_as_stored(engine_fp32):
    """bf16 on the CPU: the output layer is the GGUF's int8 table, and its logits are the
    exact table's (the fp32 engine's dense head holds the same exact values)."""
    from kvchat.core.model import Transformer
    from kvchat.core.weights import load_weights

    weights = load_weights(engine_fp32.source)
    model = Transformer(weights, dtype=torch.bfloat16, weight_format="int4")
    assert isinstance(model.lm_head, Int8Linear)
    x = _bf16(1, model.cfg.hidden_size, seed=7)
    exact = x.double() @ weights.tensors["model.embed_tokens.weight"].double().T
    got = model.lm_head(x)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=1e-5 * exact.abs().max())
    # The bf16 table's product (what the head was) is off by the table's rounding, >10x more.
    rounded = model.embed.double()
    assert (x.double() @ rounded.T - exact).abs().max() > 10 * (got.double() - exact).abs().max()
    plain = Transformer(weights, dtype=torch.bfloat16, weight_format="dense")
    assert isinstance(plain.lm_head, DenseLinear)
    assert model.nbytes < plain.nbytes - 20 * 2**20  # no bf16 prepacked copy of the table
