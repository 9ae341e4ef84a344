"""Saved conversations: one SQLite file in the data folder, written a message at a time.

Every call opens its own short connection and commits one transaction, so any thread may
call it, a crash loses at most the message being written, and a second kvchat reading the
list never sees half a write (the file is in WAL mode). The document itself is never
stored: only where it was, its size, token count and content hash, so a resumed
conversation reloads it only when the file is still there and unchanged.
"""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from kvchat.config.home import Place, create_private_file, folder_for, private_folder
from kvchat.config.store import atomic_write_text

from .errors import UserError

DB_NAME = "conversations.sqlite3"
TITLE_CHARS = 60
STOPPED_MARK = "*[stopped]*"

_SCHEMA = """
CREATE TABLE IF NOT EXISTS conversations (
    id INTEGER PRIMARY KEY,
    title TEXT NOT NULL DEFAULT '',
    created REAL NOT NULL,
    updated REAL NOT NULL,
    model TEXT NOT NULL,
    system TEXT,
    doc_path TEXT,
    doc_name TEXT,
    doc_size INTEGER,
    doc_tokens INTEGER,
    doc_sha256 TEXT
);
CREATE TABLE IF NOT EXISTS messages (
    id INTEGER PRIMARY KEY,
    conversation_id INTEGER NOT NULL REFERENCES conversations (id) ON DELETE CASCADE,
    seq INTEGER NOT NULL,
    role TEXT NOT NULL CHECK (role IN ('user', 'assistant')),
    text TEXT NOT NULL,
    stopped INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    UNIQUE (conversation_id, seq)
);
"""


class HistoryError(UserError):
    """The conversation file cannot be read or written; the message names it and says why."""


@dataclass(frozen=True)
class SavedDocument:
    path: str  # absolute, as it was when loaded
    name: str
    size_bytes: int
    tokens: int | None  # None: read by a server that did not say
    sha256: str


@dataclass(frozen=True)
class SavedMessage:
    role: str  # "user" or "assistant"
    text: str
    stopped: bool = False


@dataclass(frozen=True)
class ConversationSummary:
    """One row of the sessions list."""

    id: int
    title: str
    updated: float
    model: str
    document_name: str | None
    message_count: int


@dataclass(frozen=True)
class SavedConversation:
    id: int
    title: str
    created: float
    updated: float
    model: str
    system: str | None
    document: SavedDocument | None
    messages: tuple[SavedMessage, ...]

    def turns(self) -> list[dict[str, str]]:
        """The question / answer pairs as Conversation.messages holds them; a question
        without a saved answer (the app ended during the reply) is left out."""
        turns: list[dict[str, str]] = []
        for question, answer in pairwise(self.messages):
            if question.role == "user" and answer.role == "assistant":
                turns += [
                    {"role": "user", "content": question.text},
                    {"role": "assistant", "content": answer.text},
                ]
        return turns


class History:
    """The saved conversations in `path` (default: conversations.sqlite3 in the data folder), a
    file (and -wal, -shm files) only the user can read."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or folder_for(Place.DATA) / DB_NAME
        self._ready = False  # the folder, WAL mode and tables exist (checked on first use)

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """A connection inside one transaction: committed when the block ends, rolled back
        when it raises."""
        try:
            if not self._ready:
                private_folder(self.path.parent)
                create_private_file(self.path)
            db = sqlite3.connect(self.path, timeout=5.0)
            try:
                db.execute("PRAGMA foreign_keys = ON")
                if not self._ready:
                    db.execute("PRAGMA journal_mode = WAL")
                    db.executescript(_SCHEMA)
                    self._ready = True
                with db:
                    yield db
            finally:
                db.close()
        except (sqlite3.Error, OSError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else e
            raise HistoryError(f"conversation history {self.path}: {reason}") from e

    def create(self, model: str, system: str | None, document: SavedDocument | None) -> int:
        """A new, empty conversation; returns its id. The first question becomes its title."""
        now = time.time()
        doc = (
            (document.path, document.name, document.size_bytes, document.tokens, document.sha256)
            if document is not None
            else (None,) * 5
        )
        with self._db() as db:
            cursor = db.execute(
                "INSERT INTO conversations (created, updated, model, system, doc_path, doc_name,"
                " doc_size, doc_tokens, doc_sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (now, now, model, system, *doc),
            )
            assert cursor.lastrowid is not None
            return cursor.lastrowid

    def add_message(self, conversation_id: int, message: SavedMessage) -> None:
        now = time.time()
        title = message.text.strip().splitlines()[0][:TITLE_CHARS] if message.text.strip() else ""
        with self._db() as db:
            db.execute(
                "INSERT INTO messages (conversation_id, seq, role, text, stopped, created)"
                " VALUES (?, (SELECT COALESCE(MAX(seq), -1) + 1 FROM messages"
                " WHERE conversation_id = ?), ?, ?, ?, ?)",
                (
                    conversation_id,
                    conversation_id,
                    message.role,
                    message.text,
                    message.stopped,
                    now,
                ),
            )
            db.execute(
                "UPDATE conversations SET updated = ?,"
                " title = CASE WHEN title = '' AND ? = 'user' THEN ? ELSE title END WHERE id = ?",
                (now, message.role, title, conversation_id),
            )

    def drop_last_reply(self, conversation_id: int) -> None:
        """Delete the last message when it is an answer (it is about to be regenerated)."""
        with self._db() as db:
            db.execute(
                "DELETE FROM messages WHERE id = (SELECT id FROM messages WHERE conversation_id"
                " = ? ORDER BY seq DESC LIMIT 1) AND role = 'assistant'",
                (conversation_id,),
            )

    def set_system(self, conversation_id: int, system: str | None) -> None:
        with self._db() as db:
            db.execute(
                "UPDATE conversations SET system = ?, updated = ? WHERE id = ?",
                (system, time.time(), conversation_id),
            )

    def summaries(self, search: str = "") -> list[ConversationSummary]:
        """Every conversation, the most recently used first; with `search`, those whose title
        or any message holds it (ASCII letters in any case)."""
        where, params = "", ()
        if search:
            where = (
                " WHERE c.title LIKE ?1 ESCAPE '\\' OR EXISTS (SELECT 1 FROM messages s"
                " WHERE s.conversation_id = c.id AND s.text LIKE ?1 ESCAPE '\\')"
            )
            params = ("%" + re.sub(r"([\\%_])", r"\\\1", search) + "%",)
        with self._db() as db:
            rows = db.execute(
                "SELECT c.id, c.title, c.updated, c.model, c.doc_name, COUNT(m.id)"
                " FROM conversations c LEFT JOIN messages m ON m.conversation_id = c.id"
                f"{where} GROUP BY c.id ORDER BY c.updated DESC, c.id DESC",
                params,
            ).fetchall()
        return [ConversationSummary(*row) for row in rows]

    def rename(self, conversation_id: int, title: str) -> str:
        """Give the conversation `title` (its first line, at most TITLE_CHARS); returns the
        title kept."""
        kept = title.strip().splitlines()[0][:TITLE_CHARS].strip() if title.strip() else ""
        if not kept:
            raise HistoryError("a conversation's title cannot be empty")
        with self._db() as db:
            found = db.execute(
                "UPDATE conversations SET title = ? WHERE id = ?", (kept, conversation_id)
            ).rowcount
        if not found:
            raise self._missing(conversation_id)
        return kept

    def delete(self, conversation_id: int) -> None:
        """Delete the conversation and its messages."""
        with self._db() as db:
            found = db.execute(
                "DELETE FROM conversations WHERE id = ?", (conversation_id,)
            ).rowcount
        if not found:
            raise self._missing(conversation_id)

    def _missing(self, conversation_id: int) -> HistoryError:
        return HistoryError(f"conversation history {self.path}: no conversation {conversation_id}")

    def load(self, conversation_id: int) -> SavedConversation:
        with self._db() as db:
            row = db.execute(
                "SELECT id, title, created, updated, model, system, doc_path, doc_name,"
                " doc_size, doc_tokens, doc_sha256 FROM conversations WHERE id = ?",
                (conversation_id,),
            ).fetchone()
            messages = db.execute(
                "SELECT role, text, stopped FROM messages WHERE conversation_id = ? ORDER BY seq",
                (conversation_id,),
            ).fetchall()
        if row is None:
            raise self._missing(conversation_id)
        document = SavedDocument(*row[6:]) if row[6] is not None else None
        return SavedConversation(
            *row[:6],
            document=document,
            messages=tuple(
                SavedMessage(role, text, bool(stopped)) for role, text, stopped in messages
            ),
        )


def to_markdown(conversation: SavedConversation) -> str:
    """The conversation as a Markdown page: title, facts, system prompt, then the turns."""
    lines = [
        f"# {conversation.title or 'Untitled conversation'}",
        "",
        f"- date: {_date(conversation.created)}",
        f"- model: {conversation.model}",
    ]
    doc = conversation.document
    if doc is not None:
        paths = ", ".join(f"`{path}`" for path in doc.path.split("\n"))  # one a line, if several
        tokens = "" if doc.tokens is None else f", {doc.tokens:,} tokens"
        lines.append(f"- document: {doc.name} ({doc.size_bytes:,} bytes{tokens}), {paths}")
    if conversation.system:
        lines += ["", "## System prompt", "", conversation.system]
    for message in conversation.messages:
        lines += ["", "## You" if message.role == "user" else "## Assistant", "", message.text]
        if message.stopped:
            lines += ["", STOPPED_MARK]
    return "\n".join(lines) + "\n"


def export_markdown(conversation: SavedConversation, target: Path | None = None) -> Path:
    """Write the conversation as Markdown to `target`, a file or a folder (default
    exports/ in the data folder); in a folder the file is named from its date and title.
    Returns the path written; a new file is readable by the user alone, wherever it is."""
    if target is None or target.is_dir():
        path = (target or folder_for(Place.DATA) / "exports") / export_name(conversation)
    else:
        path = target
    try:
        atomic_write_text(path, to_markdown(conversation))
    except OSError as e:
        raise HistoryError(f"{path}: cannot write the export ({e.strerror or e})") from e
    return path


def export_name(conversation: SavedConversation) -> str:
    """e.g. 2026-11-30-1052-where-is-the-meeting-3.md: when it started, its title, its id."""
    slug = re.sub(r"[^a-z0-9]+", "-", conversation.title.lower()).strip("-")[:40].strip("-")
    stamp = time.strftime("%Y-%m-%d-%H%M", time.localtime(conversation.created))
    return f"{stamp}-{slug or 'conversation'}-{conversation.id}.md"


def _date(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M", time.localtime(timestamp))
