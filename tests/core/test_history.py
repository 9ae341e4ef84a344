"""The conversation store: a real SQLite file in a temporary folder."""

from __future__ import annotations

import sqlite3
import threading
from pathlib import Path

import pytest

from kvchat.core.documents import read_document
from kvchat.core.history import (
    DB_NAME,
    History,
    HistoryError,
    SavedDocument,
    SavedMessage,
    export_markdown,
    to_markdown,
)

DOC = SavedDocument("/data/contract.txt", "contract.txt", 12_345, 3_210, "ab" * 32)


@pytest.fixture
def history(tmp_path: Path) -> History:
    return History(tmp_path / "home" / DB_NAME)


def test_a_conversation_round_trips(history: History) -> None:
    cid = history.create("SmolLM2-135M", "Answer briefly.", DOC)
    history.add_message(cid, SavedMessage("user", "Who signs the contract?\nAnd when?"))
    history.add_message(cid, SavedMessage("assistant", "The tenant, on"))
    history.add_message(cid, SavedMessage("user", "Where?"))
    history.add_message(cid, SavedMessage("assistant", "In Paris.", stopped=True))
    saved = history.load(cid)
    assert saved.title == "Who signs the contract?"  # the first line of the first question
    assert (saved.model, saved.system, saved.document) == ("SmolLM2-135M", "Answer briefly.", DOC)
    assert [m.text for m in saved.messages] == [
        "Who signs the contract?\nAnd when?",
        "The tenant, on",
        "Where?",
        "In Paris.",
    ]
    assert [m.stopped for m in saved.messages] == [False, False, False, True]
    assert saved.created <= saved.updated
    # The folder was created and the file is in WAL mode.
    with sqlite3.connect(history.path) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


def test_turns_pair_questions_with_answers_and_skip_an_unanswered_one(history: History) -> None:
    cid = history.create("m", None, None)
    for role, text in [("user", "q1"), ("assistant", "a1"), ("user", "q2")]:
        history.add_message(cid, SavedMessage(role, text))
    saved = history.load(cid)
    assert saved.document is None and saved.system is None
    assert saved.turns() == [
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "a1"},
    ]


def test_summaries_list_the_most_recent_first_with_counts(history: History) -> None:
    older = history.create("m", None, DOC)
    history.add_message(older, SavedMessage("user", "first"))
    newer = history.create("m", None, None)
    history.add_message(newer, SavedMessage("user", "second"))
    history.add_message(newer, SavedMessage("assistant", "reply"))
    history.add_message(older, SavedMessage("assistant", "late reply"))  # older is used last
    [a, b] = history.summaries()
    assert (a.id, a.title, a.document_name, a.message_count) == (older, "first", DOC.name, 2)
    assert (b.id, b.title, b.document_name, b.message_count) == (newer, "second", None, 2)


def test_drop_last_reply_only_drops_an_answer(history: History) -> None:
    cid = history.create("m", None, None)
    history.add_message(cid, SavedMessage("user", "q"))
    history.drop_last_reply(cid)  # the last message is a question: kept
    assert len(history.load(cid).messages) == 1
    history.add_message(cid, SavedMessage("assistant", "a"))
    history.drop_last_reply(cid)
    history.add_message(cid, SavedMessage("assistant", "b"))
    assert [m.text for m in history.load(cid).messages] == ["q", "b"]


def test_set_system(history: History) -> None:
    cid = history.create("m", "old", None)
    history.set_system(cid, None)
    assert history.load(cid).system is None
    history.set_system(cid, "Be terse.")
    assert history.load(cid).system == "Be terse."


def test_writes_from_another_thread(history: History) -> None:
    cid = history.create("m", None, None)
    worker = threading.Thread(
        target=history.add_message, args=(cid, SavedMessage("user", "from a thread"))
    )
    worker.start()
    worker.join()
    assert history.load(cid).messages[0].text == "from a thread"


def test_markdown_export(history: History, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    cid = history.create("SmolLM2-135M", "Answer briefly.", DOC)
    history.add_message(cid, SavedMessage("user", "Who signs [the] contract?"))
    history.add_message(cid, SavedMessage("assistant", "The tenant", stopped=True))
    saved = history.load(cid)
    text = to_markdown(saved)
    assert text.startswith("# Who signs [the] contract?\n")
    assert "- model: SmolLM2-135M" in text
    assert "- document: contract.txt (12,345 bytes, 3,210 tokens), `/data/contract.txt`" in text
    assert "## System prompt\n\nAnswer briefly." in text
    assert text.endswith(
        "## You\n\nWho signs [the] contract?\n\n## Assistant\n\nThe tenant\n\n*[stopped]*\n"
    )

    default = export_markdown(saved)
    assert default.parent == tmp_path / "home" / "exports"
    assert default.name.endswith(f"-who-signs-the-contract-{cid}.md")
    assert default.read_text() == text
    into_folder = export_markdown(saved, tmp_path)
    assert into_folder == tmp_path / default.name
    named = export_markdown(saved, tmp_path / "out" / "chat.md")
    assert named.read_text() == text


def test_the_export_names_each_path_of_a_document_read_from_several(history: History) -> None:
    several = SavedDocument("/data/notes.txt\n/data/src", "notes.txt and 1 more", 90, 30, "cd" * 32)
    cid = history.create("SmolLM2-135M", None, several)
    text = to_markdown(history.load(cid))
    assert "- document: notes.txt and 1 more (90 bytes, 30 tokens), `/data/notes.txt`, " in text
    assert "`/data/src`\n" in text


def test_bad_files_give_a_readable_error(tmp_path: Path, history: History) -> None:
    not_db = tmp_path / "notes.sqlite3"
    not_db.write_text("this is not a database, just text " * 100)
    with pytest.raises(HistoryError, match=r"notes\.sqlite3: file is not a database"):
        History(not_db).summaries()
    with pytest.raises(HistoryError, match="no conversation 42"):
        history.load(42)
    cid = history.create("m", None, None)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(HistoryError, match="cannot write the export"):
        export_markdown(history.load(cid), blocker / "sub" / "chat.md")


def test_the_document_hash_tells_a_changed_file(tmp_path: Path) -> None:
    path = tmp_path / "doc.txt"
    path.write_text("The meeting is on Tuesday.")
    first = read_document(path).sha256
    assert read_document(path).sha256 == first and len(first) == 64
    path.write_text("The meeting is on Friday.")
    assert read_document(path).sha256 != first


def _conversation(history: History, question: str, answer: str) -> int:
    cid = history.create("SmolLM2-135M", None, None)
    history.add_message(cid, SavedMessage("user", question))
    history.add_message(cid, SavedMessage("assistant", answer))
    return cid


def test_search_finds_titles_and_message_text_in_any_case(history: History) -> None:
    lease = _conversation(history, "When does the lease end?", "On 31 March, at 100% rent.")
    deed = _conversation(history, "Who owns the house?", "Ada Fenwick owns it.")
    assert [s.id for s in history.summaries("LEASE")] == [lease]
    assert [s.id for s in history.summaries("fenwick")] == [deed]
    assert [s.id for s in history.summaries("")] == [deed, lease]
    assert history.summaries("nothing like this") == []
    # LIKE's wildcards are searched as the characters they are.
    assert [s.id for s in history.summaries("100%")] == [lease]
    assert [s.id for s in history.summaries("%")] == [lease]
    assert history.summaries("_") == []


def test_rename_keeps_one_line_and_later_questions_keep_it(history: History) -> None:
    cid = _conversation(history, "When does the lease end?", "In March.")
    assert history.rename(cid, "  Lease dates\nsecond line") == "Lease dates"
    history.add_message(cid, SavedMessage("user", "And the rent?"))
    assert history.load(cid).title == "Lease dates"
    with pytest.raises(HistoryError, match="cannot be empty"):
        history.rename(cid, "  \n ")
    with pytest.raises(HistoryError, match="no conversation 999"):
        history.rename(999, "x")


def test_delete_removes_the_conversation_and_its_messages(history: History) -> None:
    keep = _conversation(history, "Who owns the house?", "Ada.")
    gone = _conversation(history, "When does the lease end?", "In March.")
    history.delete(gone)
    assert [s.id for s in history.summaries()] == [keep]
    with sqlite3.connect(history.path) as db:
        assert db.execute(
            "SELECT COUNT(*) FROM messages WHERE conversation_id = ?", (gone,)
        ).fetchone() == (0,)
    with pytest.raises(HistoryError, match=f"no conversation {gone}"):
        history.delete(gone)
