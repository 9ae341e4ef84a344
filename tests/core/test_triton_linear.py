"""core/triton_linear.py, the layer that runs a GGUF's int4 and int8 groups on CUDA, checked on
the CPU by the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1; it is wrong in
bf16, so fp32 and fp16 here; `kvchat bench gpu` runs the same checks on a GPU in bf16 too)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kvchat.bench import kernel_checks as checks  # noqa: E402
from kvchat.core.linear import LinearKind, linear_kind, planned_bytes  # noqa: E402
from kvchat.core.triton_linear import UNPACK_ROWS, TritonGroupsLinear  # noqa: E402
from kvchat.core.weights import Int4Groups, Int8Groups  # noqa: E402

CPU = torch.device("cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("groups_format", checks.GROUP_FORMATS)
@pytest.mark.parametrize("rows", [1, 3, UNPACK_ROWS + 24])
def test_the_product_matches_the_exact_weight(dtype, groups_format, rows):
    result = checks.check_groups_linear(CPU, dtype, groups_format, rows)
    assert result.passed, f"{result.case}: error {result.max_abs_err:.3g} > {result.tolerance:.3g}"


def test_a_real_files_groups_run_as_the_file_says(smollm2_weights):
    """SmolLM2's Q4_1 query projection and Q8_0 token table (its first 80 rows), through both
    paths, against the product with gguf's dequantized weight (core/weights.py's groups are
    checked against gguf bit for bit)."""
    q4 = smollm2_weights.int4["model.layers.0.self_attn.q_proj.weight"]
    q8 = smollm2_weights.int8["model.embed_tokens.weight"]
    for groups in (
        Int4Groups(q4.q[:80], q4.scale[:80], q4.minimum[:80]),
        Int8Groups(q8.q[:80], q8.scale[:80]),
    ):
        layer = TritonGroupsLinear(groups, None, CPU, torch.float32)
        assert torch.equal(layer.unpacked(), groups.dequantize())
        x = torch.randn(
            UNPACK_ROWS + 1, groups.q.shape[1], generator=torch.Generator().manual_seed(1)
        )
        want = x.double() @ groups.dequantize().double().t()
        for rows in (x[:1], x[:2], x):
            got = layer(rows)
            assert (got.double() - want[: rows.shape[0]]).abs().max() < 1e-4


@pytest.mark.parametrize("groups_format", checks.GROUP_FORMATS)
def test_the_plan_counts_what_the_layer_holds(groups_format):
    n, k = 72, 160
    if groups_format.startswith("int4"):
        size = 16 if groups_format == "int4 per 16" else 32
        scales = torch.ones(n, k // size)
        groups = Int4Groups(torch.zeros(n, k, dtype=torch.uint8), scales, torch.zeros_like(scales))
        kind, minimum = LinearKind.TRITON_INT4, True
    else:
        size = 32 if groups_format == "int8 per 32" else 16
        minimum = size == 16
        groups = Int8Groups(
            torch.zeros(n, k, dtype=torch.int8),
            torch.ones(n, k // size),
            torch.zeros(n, k // size) if minimum else None,
        )
        kind = LinearKind.TRITON_INT8
    layer = TritonGroupsLinear(groups, torch.zeros(n), CPU, torch.float32)
    cuda = torch.device("cuda")
    assert layer.format == kind.format
    assert layer.nbytes == planned_bytes(kind, n, k, torch.float32, cuda, True, size, 4, minimum)


def test_on_cuda_the_files_groups_stay_groups():
    cuda = torch.device("cuda")
    kind = linear_kind(896, 896, True, False, "int4", torch.bfloat16, cuda, None)
    assert kind is LinearKind.TRITON_INT4
    assert linear_kind(896, 896, False, True, "int4", torch.bfloat16, cuda, None) is (
        LinearKind.TRITON_INT8
    )
    # No groups, inputs not in whole groups, or weights asked dense: a matrix.
    assert linear_kind(896, 896, False, False, "int4", torch.bfloat16, cuda, None) is (
        LinearKind.DENSE
    )
    assert linear_kind(896, 900, True, False, "int4", torch.bfloat16, cuda, None) is (
        LinearKind.DENSE
    )
    assert linear_kind(896, 896, True, True, "dense", torch.bfloat16, cuda, None) is (
        LinearKind.DENSE
    )


def test_each_kind_names_the_format_its_layers_hold():
    assert {kind: kind.format for kind in LinearKind} == {
        LinearKind.PACKED_INT4: "int4",
        LinearKind.TORCH_INT4: "int4",
        LinearKind.INT8: "int8",
        LinearKind.TRITON_INT4: "int4",
        LinearKind.TRITON_INT8: "int8",
        LinearKind.DENSE: None,
    }
