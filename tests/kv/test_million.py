"""A 1M-token context end to end with a tiny random model, in CI time, inside its plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.slow
def test_one_million_tokens_prefill_and_decode_stay_under_the_plan():
    result = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("million_run.py"))],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["tokens"] == (1 << 20) + 16
    assert report["blocks_in_dram"] == report["tokens"] // 128
    assert report["finite"]
    assert 0 < len(report["selected"]) <= 8
    # Peak RSS growth of the whole run stays within what the planner promised.
    assert report["rss_growth"] <= report["plan_cache_bytes"], report
