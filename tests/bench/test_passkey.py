"""`kvchat bench passkey` with the real SmolLM2 model and dense attention at short lengths."""

from __future__ import annotations

import json

import pytest

from kvchat.bench.grid import depth_grid
from kvchat.bench.passkey import cell_passkey, run_passkey_bench
from kvchat.config import load_settings
from kvchat.core.engine import Engine
from kvchat.core.plan import PlanRefusedError
from kvchat.tui.cli import _parse_depths, main


@pytest.fixture(scope="module")
def dense_settings():
    return load_settings(overrides=["long_context.attention=dense"]).settings


def test_depth_grid_and_keys():
    assert depth_grid(5) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert depth_grid(2) == [0.0, 1.0]
    assert depth_grid(1) == [0.5]
    assert depth_grid([0.1, 0.9]) == [0.1, 0.9]
    with pytest.raises(ValueError):
        depth_grid(0)
    with pytest.raises(ValueError):
        depth_grid([1.5])
    key = cell_passkey(0, 4096, 0.5, 0)
    assert 10_000 <= key <= 99_999
    assert key == cell_passkey(0, 4096, 0.5, 0)  # reproducible
    others = {cell_passkey(0, 4096, d, 0) for d in depth_grid(5)}
    assert len(others) == 5  # every depth its own key


@pytest.mark.slow
def test_grid_with_dense_attention(dense_settings):
    lines: list[str] = []
    progress: list[tuple[int, int]] = []
    result = run_passkey_bench(
        dense_settings,
        [512, 1024],
        2,
        log=lines.append,
        on_progress=lambda done, total: progress.append((done, total)),
    )
    assert json.loads(json.dumps(result)) == result  # JSON-ready as is
    assert result["benchmark"] == "passkey"
    assert result["depths"] == [0.0, 1.0]
    assert result["cache"]["attention"] == "dense"
    assert result["cache"]["position_mode"] == "native"
    for key in ("kv_type", "anchor_type", "block_size", "local_windows_len", "second_select_num"):
        assert key in result["cache"]
    assert result["machine"]["cores"] >= 1
    cells = result["cells"]
    assert [(c["length"], c["depth"]) for c in cells] == [
        (512, 0.0),
        (512, 1.0),
        (1024, 0.0),
        (1024, 1.0),
    ]
    for cell in cells:
        assert abs(cell["document_tokens"] - cell["length"]) <= 16
        assert cell["prompt_tokens"] > cell["document_tokens"]
        assert cell["prefill_tok_s"] > 0 and cell["seconds"] > 0
        assert cell["ok"] == (str(cell["passkey"]) in cell["answer"])
        # The cell's peak RSS beside the plan for what its cache holds (prompt and reply).
        assert cell["prompt_tokens"] <= cell["cache_tokens"] <= cell["prompt_tokens"] + 16
        assert 0 < cell["peak_rss_bytes"] <= cell["plan_total_bytes"], cell
    assert [r["length"] for r in result["per_length"]] == [512, 1024]
    for row in result["per_length"]:
        assert row["total"] == 2 and 0.0 <= row["accuracy"] <= 1.0
    assert 0.0 <= result["overall_accuracy"] <= 1.0
    assert result["correct"] >= 1, [c["answer"] for c in cells]
    assert result["compare_dense"] is None and result["skipped"] == []
    # one line per cell as it goes, then the summary
    assert sum(line.startswith("main ") for line in lines) == 4
    assert any(line.startswith(" overall") for line in lines)
    # every prefill is announced with (0, n) and ends at (n, n)
    starts = [total for done, total in progress if done == 0]
    ends = [total for done, total in progress if done == total]
    assert starts == ends == [c["prompt_tokens"] for c in cells]


@pytest.mark.slow
def test_dense_comparison_reports_what_does_not_fit(monkeypatch):
    check_fits = Engine.check_fits

    def small_machine(self, n_prompt, max_new_tokens):
        if n_prompt > 1500:
            raise PlanRefusedError(f"{n_prompt} tokens do not fit (test)")
        check_fits(self, n_prompt, max_new_tokens)

    monkeypatch.setattr(Engine, "check_fits", small_machine)
    lines: list[str] = []
    # a max_seq_len too small for the grid is raised to fit it, not refused
    overrides = ["long_context.attention=dense", "long_context.max_seq_len=512"]
    small = load_settings(overrides=[*overrides, "long_context.chunk_size=256"]).settings
    result = run_passkey_bench(small, [1024], 1, compare_dense=[1024, 2048], log=lines.append)
    assert result["max_seq_len"] >= 2048 + result["cells"][0]["prompt_tokens"] - 1024 + 16
    dense = result["compare_dense"]
    assert [c["length"] for c in dense["cells"]] == [1024]
    assert dense["cells"][0]["passkey"] == result["cells"][0]["passkey"]  # the same cell
    assert [s["length"] for s in dense["skipped"]] == [2048]
    assert "do not fit (test)" in dense["skipped"][0]["reason"]
    skipped_row = dense["per_length"][1]
    assert skipped_row["skipped"] and skipped_row["accuracy"] is None
    assert any("2048 skipped" in line for line in lines)
    assert any("skipped" in line and line.strip().startswith("2048") for line in lines)
    json.dumps(result)


@pytest.mark.slow
def test_cli(tmp_path, capsys):
    out = tmp_path / "passkey.json"
    code = main(
        [
            "bench",
            "passkey",
            "--lengths",
            "1k",
            "--depths",
            "2",
            "--set",
            "long_context.attention=dense",
            "--json",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    result = json.loads(out.read_text())
    assert result["lengths"] == [1024] and len(result["cells"]) == 2
    assert "main " in captured.out and '"benchmark": "passkey"' in captured.out
    assert "prefill:" in captured.err


def test_cli_rejects_zero_depths(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "passkey", "--depths", "0"])
    assert exc.value.code == 2
    assert "at least 1" in capsys.readouterr().err


def test_cli_takes_depths_as_a_count_or_a_list():
    assert _parse_depths("3") == 3
    assert _parse_depths("0.25,0.5,0.75") == [0.25, 0.5, 0.75]
    assert _parse_depths("0.5") == [0.5]


def test_cli_rejects_depths_outside_zero_to_one(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "passkey", "--depths", "0.5,1.5"])
    assert exc.value.code == 2
    assert "between 0 and 1" in capsys.readouterr().err
