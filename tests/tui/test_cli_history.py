"""`kvchat history`: the saved conversations listed, exported and deleted from the command
line, on a real conversation file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.core.history import History, SavedDocument, SavedMessage
from kvchat.tui.cli import EXIT_USAGE, main

DOC = SavedDocument("/data/lease.txt", "lease.txt", 2_048, 512, "cd" * 32)


@pytest.fixture
def history(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> History:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    history = History()
    lease = history.create("SmolLM2-135M", None, DOC)
    history.add_message(lease, SavedMessage("user", "When does the lease end?"))
    history.add_message(lease, SavedMessage("assistant", "On 31 March 2031."))
    deed = history.create("SmolLM2-135M", None, None)
    history.add_message(deed, SavedMessage("user", "Who owns the house?\x1b]52;c;eA==\x07"))
    return history


def test_list_shows_every_conversation_most_recent_first(history: History, capsys) -> None:
    assert main(["history", "list"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["ID", "UPDATED", "MESSAGES", "DOCUMENT", "TITLE"]
    assert out[1].split()[0] == "2" and "Who owns the house?" in out[1] and "\x1b" not in out[1]
    assert (
        out[2].split()[0] == "1" and "lease.txt" in out[2] and "When does the lease end?" in out[2]
    )
    assert out[3] == f"2 conversations in {history.path}"


def test_list_searches_and_prints_json(history: History, capsys) -> None:
    assert main(["history", "list", "--search", "31 march", "--json"]) == 0
    [row] = json.loads(capsys.readouterr().out)
    assert (row["id"], row["title"], row["document_name"], row["message_count"]) == (
        1,
        "When does the lease end?",
        "lease.txt",
        2,
    )


def test_export_writes_markdown_where_asked(history: History, tmp_path: Path, capsys) -> None:
    target = tmp_path / "lease.md"
    assert main(["history", "export", "1", str(target)]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {target}"
    text = target.read_text()
    assert text.startswith("# When does the lease end?") and "On 31 March 2031." in text


def test_rm_deletes_one(history: History, capsys) -> None:
    assert main(["history", "rm", "2"]) == 0
    assert capsys.readouterr().out.strip() == "deleted conversation 2"
    assert [s.id for s in history.summaries()] == [1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["history", "export"], "which conversation?"),
        (["history", "rm", "7"], "no conversation 7"),
        (["history", "export", "7"], "no conversation 7"),
    ],
)
def test_bad_ids_are_one_line_and_exit_2(history: History, capsys, argv, message) -> None:
    assert main(argv) == EXIT_USAGE
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err
