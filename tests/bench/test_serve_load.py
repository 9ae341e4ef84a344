"""`kvchat bench serve`: concurrent clients against the real server, without a document."""

from __future__ import annotations

import json

from kvchat.tui.cli import main


def test_concurrent_clients_all_get_their_one_at_a_time_answer(tmp_path, capsys):
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--clients", "6", "--decode-tokens", "8", "--json", str(out)]
    # fp32: an answer does not depend on which prompt the cache held before (bf16 rounds the
    # prompt's uncached part differently after different cached prefixes; docs/serving.md).
    assert main([*argv, "--set", "model.dtype=float32"]) == 0
    result = json.loads(out.read_text())
    assert json.loads(capsys.readouterr().out) == result
    assert (result["completed"], result["failed"]) == (6, [])
    assert result["equal_to_one_at_a_time"] == 6, result["unequal"]
    # Every stream says where it queued; some waited behind others.
    assert result["queue_positions_reported"] == 6 and result["largest_position"] >= 1
    assert result["completion_tokens"] > 0
    assert 0 < result["peak_rss_bytes"] <= result["plan"]["max_seq_len_total_bytes"]
    assert result["within_plan"] is True
