"""A 1M-token document end to end through the engine's public API with a tiny random model,
INT8 and INT4 blocks, in CI time and inside its plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
def test_a_million_token_document_is_answered_within_the_plan_and_reloaded(kv_type, tmp_path):
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("million_run.py")), kv_type, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    tokens = (1 << 20) + 40 + 15  # document, question, the reply's cached tokens
    assert report["tokens"] == tokens and report["blocks_in_dram"] == tokens // 128
    assert report["finite"] and len(report["reply"]) == 16
    # Peak RSS growth of the whole run stays within what the planner promised.
    assert report["rss_growth"] <= report["plan_cache_bytes"], report
    # The prefill saved a snapshot; a new session loads it instead of prefilling, and the
    # same greedy reply follows.
    assert report["saved"] and report["restored"], report["warnings"]
    assert report["warm_reply"] == report["reply"]
