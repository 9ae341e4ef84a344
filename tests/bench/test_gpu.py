"""`kvchat bench gpu`: the dry run end to end (CPU, Triton interpreter), and the benchmark's
cache checked against dense attention so its speed numbers are of a correct computation."""

from __future__ import annotations

import json

import pytest
import torch

from kvchat.bench.gpu import (
    LLAMA3_8B,
    TINY_LLAMA,
    CacheShape,
    FilledSparseCache,
    choose_kv_type,
    random_model,
)
from kvchat.kv.dense import DenseBackend
from kvchat.kv.kernels import attention_ops
from kvchat.tui.cli import main

GIB = 1 << 30


def test_dry_run_writes_every_section(tmp_path, capsys):
    pytest.importorskip("triton")
    out = tmp_path / "gpu.json"
    assert main(["bench", "gpu", "--dry-run", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == report
    assert report["dry_run"] is True and report["errors"] == []
    assert report["bandwidth"]["device_copy_gbs"] > 0 and report["bandwidth"]["h2d_gbs"] > 0
    correctness = report["correctness"]
    assert correctness["failed"] == 0 and correctness["passed"] == len(correctness["results"])
    kernels = {r["kernel"] for r in correctness["results"]}
    assert {"sparse_attention.out", "score_blocks", "write_blocks", "decode_attention"} <= kernels
    models = {m["model"]: m for m in report["models"]}
    assert set(models) == {TINY_LLAMA.name, "smollm2-135m (bundled GGUF)"}
    assert models[TINY_LLAMA.name]["ops"] == "triton"
    for model in models.values():
        for run in model["runs"]:
            assert run["decode_tok_s"] > 0 and run["prefill_tok_s"] > 0
            assert run["random_fill_tokens"] + run["prefill_tokens"] == run["context"]
            assert run["hbm_bytes_per_token"] > run["hbm_weight_bytes_per_token"] > 0
            assert 0 < run["hbm_roofline_fraction"] and 0 <= run["pcie_roofline_fraction"]
    # The 512-token context selects among blocks the 256-token one never read: some misses.
    assert any(run["pcie_bytes_per_token"] > 0 for run in models[TINY_LLAMA.name]["runs"])


def test_kv_type_is_the_most_precise_that_fits():
    # An 8B model's KV at 1M tokens: FP16 128 GiB, INT8 68 GiB, INT4 40 GiB.
    assert choose_kv_type(LLAMA3_8B, 2, 1 << 20, "FP16", 48 * GIB) == "INT4"
    assert choose_kv_type(LLAMA3_8B, 2, 1 << 20, "FP16", 70 * GIB) == "INT8"
    assert choose_kv_type(LLAMA3_8B, 2, 1 << 20, "FP16", 130 * GIB) == "FP16"
    assert choose_kv_type(LLAMA3_8B, 2, 32_768, "INT8", 48 * GIB) == "INT8"


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_cache_with_every_block_selected_is_dense_attention(backend):
    # The benchmark's cache reads {window, sink, selected blocks}; selecting every candidate
    # must give exact attention over the whole context, prefill chunks and decode steps alike.
    if backend == "triton":
        pytest.importorskip("triton")
    model = random_model(TINY_LLAMA, torch.float32, torch.device("cpu"))
    cfg = model.cfg
    ops = attention_ops("cpu", backend=backend)
    cpu, f32 = torch.device("cpu"), torch.float32

    def sparse_cache(select: int) -> FilledSparseCache:
        shape = CacheShape(32, 64, select, 32, "QUEST", "FP16")
        return FilledSparseCache(cfg, model.rope, f32, cpu, ops, shape, 512)

    sparse, narrow = sparse_cache(100), sparse_cache(1)
    dense = DenseBackend(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.rope, f32, cpu, 512)
    gen = torch.Generator().manual_seed(0)
    worst, narrow_gap = 0.0, 0.0
    passes = [32] * 6 + [1, 1]  # 192 tokens of prefill (blocks leave the window), 2 decodes
    for n in passes:
        for cache in (sparse, dense, narrow):
            cache.begin(n)
        for layer in range(cfg.num_layers):
            q = torch.randn(cfg.num_heads, n, cfg.head_dim, generator=gen)
            k = torch.randn(cfg.num_kv_heads, n, cfg.head_dim, generator=gen)
            v = torch.randn(cfg.num_kv_heads, n, cfg.head_dim, generator=gen)
            want = dense.attend(layer, q, k, v)
            worst = max(worst, (sparse.attend(layer, q, k, v) - want).abs().max().item())
            narrow_gap = max(narrow_gap, (narrow.attend(layer, q, k, v) - want).abs().max().item())
        for cache in (sparse, dense, narrow):
            cache.commit()
    assert worst < 1e-4
    assert narrow_gap > 1e-2  # one selected block of three misses real attention mass
    assert sparse.tier.stats().misses > 0 and sparse.stored_tokens == 192


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_without_a_gpu_the_real_run_is_refused(capsys):
    assert main(["bench", "gpu"]) == 2
    assert "needs a CUDA GPU; use --dry-run" in capsys.readouterr().err
