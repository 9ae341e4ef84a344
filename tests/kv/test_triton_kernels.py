"""The Triton kernels against the torch reference, run on the CPU by the Triton interpreter.

tests/conftest.py sets TRITON_INTERPRET=1 before any kernel module is imported. The
interpreter is slow (shapes are tiny) and wrong in bf16, so fp32 and fp16 are tested here;
`kvchat bench gpu` runs the same checks (bench/kernel_checks.py) on a GPU in bf16 too.
Tolerances (bench/kernel_checks.py): attention outputs 1e-4 (fp32) / 4e-3 (fp16) absolute
against the reference in fp32 on the same rounded inputs, LSE 1e-3, scores 1e-4 relative,
quantized append bit-exact.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from kvchat.bench import kernel_checks as checks  # noqa: E402
from kvchat.kv.anchors import ANCHOR_TYPES  # noqa: E402
from kvchat.kv.kernels import TORCH_OPS, attention_ops, gather_blocks  # noqa: E402
from kvchat.kv.quant import KV_TYPES, BlockPool  # noqa: E402
from kvchat.kv.selection import HEAD_SELECT_MODES  # noqa: E402

OPS = attention_ops("cpu", backend="triton")
DTYPES = [torch.float32, torch.float16]
DTYPE_IDS = ["fp32", "fp16"]


def _assert_all(results: list[checks.CheckResult]) -> None:
    failed = [r for r in results if not r.passed]
    assert not failed, "\n".join(
        f"{r.kernel} [{r.case}]: error {r.max_abs_err:.3g} > {r.tolerance:.3g}" for r in failed
    )


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("kv_type", KV_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_decode_step_matches_reference(dtype, kv_type, group):
    # One query per head over a ragged window (45 keys), a sink block and 3 stored blocks.
    _assert_all(checks.check_sparse_attention(OPS, "cpu", dtype, kv_type, group))


@pytest.mark.parametrize("kv_type", KV_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_prefill_chunk_matches_reference(dtype, kv_type):
    # A 9-token chunk at the end of a 45-key local window: causal there, unmasked elsewhere;
    # 27 rows of 4 query heads per KV head span two row tiles.
    results = checks.check_sparse_attention(OPS, "cpu", dtype, kv_type, 3, t_len=9)
    results += checks.check_sparse_attention(OPS, "cpu", dtype, kv_type, 8, t_len=3, n_sel=2)
    _assert_all(results)


@pytest.mark.parametrize("kv_type", KV_TYPES)
def test_zero_selected_blocks_and_edge_lengths(kv_type):
    results = checks.check_sparse_attention(OPS, "cpu", torch.float32, kv_type, 3, n_sel=0)
    # The very first token: one local key, no sinks, nothing stored yet.
    results += checks.check_sparse_attention(
        OPS, "cpu", torch.float32, kv_type, 4, local_len=1, sink_len=0, n_sel=0
    )
    # A chunk that is the whole local set (square causal), head_dim 96 (a masked tile),
    # 64-token blocks.
    results += checks.check_sparse_attention(
        OPS, "cpu", torch.float16, kv_type, 1, t_len=6, local_len=6, block=64, dim=96
    )
    _assert_all(results)


@pytest.mark.parametrize("splits", [2, 5])
def test_key_splits_merge_to_the_same_result(splits):
    from kvchat.kv.triton.attention import sparse_attention

    gen = torch.Generator().manual_seed(4)
    k_pool = BlockPool(12, 32, 64, "INT4", torch.float32)
    v_pool = BlockPool(12, 32, 64, "INT4", torch.float32)
    k_pool.write(torch.arange(12), torch.randn(12, 32, 64, generator=gen))
    v_pool.write(torch.arange(12), torch.randn(12, 32, 64, generator=gen))
    q = torch.randn(8, 1, 64, generator=gen)
    local = torch.randn(2, 70, 64, generator=gen), torch.randn(2, 70, 64, generator=gen)
    sinks = torch.randn(2, 32, 64, generator=gen), torch.randn(2, 32, 64, generator=gen)
    slots = torch.tensor([[0, 3, 4], [6, 11, 9]])
    whole = sparse_attention(q, q, *local, *sinks, k_pool, v_pool, slots, splits=1)
    split = sparse_attention(q, q, *local, *sinks, k_pool, v_pool, slots, splits=splits)
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)
    far_k, far_v = gather_blocks(k_pool, v_pool, slots, torch.float32)
    want = TORCH_OPS.sparse_attention(
        q, q, *local, torch.cat([sinks[0], far_k], 1), torch.cat([sinks[1], far_v], 1),
        None, None, None,
    )  # fmt: skip
    torch.testing.assert_close(split, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("group", [1, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_reference_mirrors(dtype, group):
    # partial_attention, chunk_attention (with an empty past set), decode_attention (its
    # output and the probabilities its first set received) and merge_partials.
    _assert_all(checks.check_mirrors(OPS, "cpu", dtype, group))


@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("mode", HEAD_SELECT_MODES)
@pytest.mark.parametrize("anchor_type", ANCHOR_TYPES)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_scoring_matches_reference(dtype, anchor_type, mode, group):
    # QUEST and BLOCK_MAX anchors come in the keys' dtype (fp16 here), the others in fp32.
    _assert_all([checks.check_scoring(OPS, "cpu", dtype, anchor_type, mode, group)])


def test_scoring_picks_the_same_blocks():
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(12, 64, generator=gen)
    anchors = torch.randn(300, 3, 2, 64, generator=gen)
    got = OPS.select_top(OPS.score_blocks(q, anchors, "QUEST", "SEPARATE"), 16)
    want = TORCH_OPS.select_top(TORCH_OPS.score_blocks(q, anchors, "QUEST", "SEPARATE"), 16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_append_is_bit_exact(dtype, kv_type):
    # Outlier and offset channels, an all-zero block, a constant group, values near 6e4.
    results = [checks.check_append(OPS, "cpu", dtype, kv_type)]
    results.append(checks.check_append(OPS, "cpu", dtype, kv_type, block=64, dim=96))
    _assert_all(results)


def test_quantize_rows_are_the_pool_rows():
    from kvchat.kv.triton.append import quantize_rows

    blocks = torch.randn(3, 32, 64, generator=torch.Generator().manual_seed(6))
    for kv_type in ("INT8", "INT4"):
        pool = BlockPool(3, 32, 64, kv_type, torch.float32)
        pool.write(torch.arange(3), blocks)
        assert torch.equal(quantize_rows(blocks, kv_type), pool.storage)


def test_bad_inputs_are_refused_with_a_reason():
    q = torch.randn(6, 1, 64)
    k = torch.randn(4, 10, 64)
    with pytest.raises(ValueError, match="multiple of n_kv"):
        OPS.partial_attention(q, k, k, causal=False)
    with pytest.raises(ValueError, match="must include"):
        OPS.sparse_attention(q, q, k[:3, :0], k[:3, :0], k[:3], k[:3], None, None, None)
    with pytest.raises(ValueError, match="head select mode"):
        OPS.score_blocks(q[:, 0], torch.randn(5, 3, 1, 64), "FIXED", "BOTH")
    from kvchat.kv.triton.append import quantize_rows

    with pytest.raises(ValueError, match="INT8 or INT4"):
        quantize_rows(torch.randn(1, 32, 64), "FP16")


def test_dispatch():
    assert attention_ops("cpu") is TORCH_OPS
    assert attention_ops("cpu", backend="torch") is TORCH_OPS
    assert OPS.name == "triton"
    with pytest.raises(ValueError, match="unknown ops backend"):
        attention_ops("cpu", backend="cuda")


def test_kvchat_imports_and_runs_without_triton():
    # A fresh interpreter where `import triton` fails, as on a CPU-only torch install.
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import kvchat.core.engine, kvchat.bench.kernel_checks\n"
        "from kvchat.kv.kernels import attention_ops, TORCH_OPS\n"
        "assert attention_ops('cpu') is TORCH_OPS\n"
        "try:\n"
        "    attention_ops('cpu', backend='triton')\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton installed' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('triton backend without triton')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
