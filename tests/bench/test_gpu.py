"""`kvchat bench gpu`: the dry run end to end (CPU, Triton interpreter) on the engine's cache
(its random fill is checked in tests/kv/test_sparse_parts.py)."""

from __future__ import annotations

import json

import pytest
import torch

from kvchat.bench.gpu import LLAMA3_8B, TINY_LLAMA, choose_kv_type
from kvchat.tui.cli import main

GIB = 1 << 30


@pytest.mark.slow
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


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA"
)
def test_without_a_gpu_the_real_run_is_refused(capsys):
    assert main(["bench", "gpu"]) == 2
    assert "needs a CUDA GPU; use --dry-run" in capsys.readouterr().err
