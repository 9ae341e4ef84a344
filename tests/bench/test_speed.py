"""`kvchat bench speed` end to end at a small size, with the real model."""

from __future__ import annotations

import pytest

from kvchat.bench.speed import WARMUP_TOKENS, memory_copy_rate, run_speed_bench
from kvchat.config import load_settings
from kvchat.native.cpu import cpu_name

SMALL = [
    "long_context.chunk_size=64",
    "long_context.block_size=32",
    "long_context.local_windows_len=128",
    "long_context.second_select_num=4",
    "long_context.max_seq_len=2048",
]


@pytest.mark.slow
def test_speed_bench_reports_ratios_and_roofline():
    settings = load_settings(overrides=SMALL).settings
    lines: list[str] = []
    result = run_speed_bench(
        settings,
        [256, 400],
        decode_tokens=4,
        baselines=(),
        compare_dense=[400],
        log=lines.append,
    )
    assert result["memory_copy_bytes_per_s"] > 1e8
    assert result["machine"]["cpu"] == cpu_name()
    first, row = result["results"]
    ours = row["kvchat"]
    assert ours["attention"] == "sparse" and row["dense"]["attention"] == "dense"
    assert set(row["dense_ratio"]) == {"prefill", "decode"}
    weights = result["weights_read_bytes_per_token"]
    # At least the weights and some cache are read per token.
    assert weights > 50e6
    assert ours["decode_bytes_per_token"] > weights
    assert row["dense"]["decode_bytes_per_token"] > weights
    assert 0 < ours["decode_roofline_fraction"] < 2
    # The steps before the timed ones (right after the prefill) are reported apart.
    assert ours["warmup_tok_s"] > 0 and f"the {WARMUP_TOKENS} before" in lines[-2]
    # The peak is this context's own (not the model loading's) and holds what remains.
    assert ours["peak_rss_scope"] == "context"
    assert ours["peak_rss_bytes"] >= ours["rss_bytes"] * 0.99
    assert "peak RSS" in lines[-2] and "/ plan" in lines[-2]
    assert "x" in lines[-2] and "GB/s" in lines[-2]
    # Decode at 400 against decode at 256 in alternating rounds, both caches alive.
    assert "decode_vs_first" not in first
    vs = row["decode_vs_first"]
    assert vs["first_context"] == 256 and vs["tokens"] == 8
    assert vs["ratio"] == vs["decode_tok_s"] / vs["first_decode_tok_s"]
    assert "of 256's, interleaved" in lines[-2]
    # The roofline is the best copy rate of the run: before and after each context.
    assert len(result["memory_copy_samples"]) == 3
    assert result["memory_copy_bytes_per_s"] == max(result["memory_copy_samples"])
    assert "roofline" in lines[-1] and "400: " in lines[-1]


def test_memory_copy_rate_is_a_plausible_bandwidth():
    rate = memory_copy_rate(64 * 1024**2, repeats=3)
    assert 1e8 < rate < 1e13


def test_llama_cpp_runs_beside_kvchat_on_the_same_gguf():
    """Where the optional extra is installed: llama.cpp's rates and kvchat's ratios to them."""
    pytest.importorskip("llama_cpp")
    from kvchat.bench.baselines import BaselineName

    settings = load_settings(overrides=SMALL).settings
    result = run_speed_bench(
        settings, [256], decode_tokens=4, baselines=[BaselineName.LLAMA_CPP], log=lambda _: None
    )
    assert result["baselines"] == ["llama.cpp"]
    row = result["results"][0]
    assert row["llama.cpp"]["prefill_tok_s"] > 0 and row["llama.cpp"]["decode_tok_s"] > 0
    ratios = row["llama.cpp_ratio"]
    assert ratios["decode"] == row["kvchat"]["decode_tok_s"] / row["llama.cpp"]["decode_tok_s"]
