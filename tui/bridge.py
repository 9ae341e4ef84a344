"""The engine steps the app runs in its worker thread: load the model, load a document,
resume a saved conversation, answer a question (or the last one again), rebuild the cache.

Each step talks to the UI only through `post` (the app's thread-safe post_message) and
rate-limits what it posts: reply text at most every 50 ms, progress at most 10 times a
second, so a fast engine never floods the UI's message queue.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO, Protocol

from textual.message import Message

from kvchat.client.engine import RemoteConversation, RemoteEngine
from kvchat.config import Settings
from kvchat.core.cancel import Cancelled
from kvchat.core.conversation import Conversation
from kvchat.core.documents import Document, DocumentError
from kvchat.core.engine import Engine
from kvchat.core.errors import USER_ERRORS
from kvchat.core.fit import Fit
from kvchat.core.history import SavedConversation
from kvchat.core.plan import PlanRefusedError
from kvchat.core.snapshot import PrefillReport
from kvchat.core.sources import STDIN
from kvchat.core.turns import ReplyEnd
from kvchat.core.units import format_size
from kvchat.native import build_reports

from .messages import (
    LOAD_PHASE,
    SAVE_PHASE,
    ConversationResumed,
    DocumentInfo,
    DocumentLoaded,
    FitOffered,
    KernelBuild,
    ModelLoaded,
    Notice,
    PendingDocument,
    Progress,
    ReplyPiece,
    StepFinished,
)

Post = Callable[[Message], object]
AnyEngine = Engine | RemoteEngine  # a model in this process, or on a server


TOKEN_INTERVAL_S = 0.05
PROGRESS_INTERVAL_S = 0.1
CARD_LINES = 5
CARD_LINE_CHARS = 160


class TokenBatcher:
    """Collects reply pieces and posts them together at most every `interval` seconds."""

    def __init__(
        self,
        post: Post,
        interval: float = TOKEN_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.post, self.interval, self.clock = post, interval, clock
        self.pending: list[str] = []
        self.last = clock()

    def add(self, text: str) -> None:
        self.pending.append(text)
        if self.clock() - self.last >= self.interval:
            self.flush()

    def flush(self) -> None:
        if self.pending:
            self.post(ReplyPiece("".join(self.pending)))
            self.pending.clear()
        self.last = self.clock()


def progress_reporter(
    post: Post, phase: str, interval: float = PROGRESS_INTERVAL_S
) -> Callable[[int, int], None]:
    """An on_progress callback posting Progress at most every `interval` s (and at the end)."""
    started = time.monotonic()
    last = -interval

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if done < total and now - last < interval:
            return
        last = now
        post(Progress(phase, done, total, now - started))

    return report


class Steps(Protocol):
    """The steps that differ between a model run here and one on a server (remote_steps.py);
    the app picks its steps once, at start. Answering is the same for both (`ask`)."""

    def load_model(self, settings: Settings, model_spec: str | None, post: Post) -> str: ...

    def load_document(
        self,
        engine: Any,
        paths: Sequence[str | Path],
        post: Post,
        cancel: threading.Event,
        stdin: BinaryIO | None = None,
    ) -> str: ...

    def resume(
        self, engine: Any, saved: SavedConversation, post: Post, cancel: threading.Event
    ) -> str: ...


def run_step(kind: str, post: Post, cancel: threading.Event, body: Callable[[], str]) -> None:
    """Run `body` and always post one StepFinished, whatever happened.

    `body` returns a detail line for a normal end. Unexpected exceptions are reported too,
    so a bug in one step leaves the app (and the session) usable.
    """
    try:
        detail = body()
    except Cancelled as e:
        post(StepFinished(kind, stopped=True, detail=str(e)))
    except USER_ERRORS as e:
        post(StepFinished(kind, error=str(e)))
    except Exception as e:  # noqa: BLE001 - shown to the user instead of killing the app
        post(StepFinished(kind, error=f"unexpected {type(e).__name__}: {e}"))
    else:
        post(StepFinished(kind, stopped=cancel.is_set(), detail=detail))


def load_model(settings: Settings, model_spec: str | None, post: Post) -> str:
    with build_reports(lambda progress: post(KernelBuild(progress))):
        engine = Engine.load(settings, model_spec, progress_reporter(post, LOAD_PHASE))
    post(ModelLoaded(engine))
    return f"loaded {engine.source.name}"


def load_document(
    engine: Engine,
    paths: Sequence[str | Path],
    post: Post,
    cancel: threading.Event,
    stdin: BinaryIO | None = None,
) -> str:
    """Read and tokenize the document `paths` make (`stdin`: what "-" reads), check it fits,
    then (only then) replace the session and prefill the document so the first question only
    prefills itself. A document the settings cannot hold but a fit can is offered that fit
    (FitOffered) instead.

    Any refusal before the swap leaves the current document and session untouched.
    """
    doc = engine.read_document(*paths, stdin=stdin, fitting=True)
    return _open_document(engine, doc, Conversation(), post, cancel, DocumentLoaded)


def resume(engine: Engine, saved: SavedConversation, post: Post, cancel: threading.Event) -> str:
    """Replace the session with a saved conversation: its system prompt and turns, over its
    document when its files are still there and unchanged (reloaded like `load_document`),
    else without it. The next question prefills what the cache does not hold yet."""
    history = Conversation(system=saved.system, messages=saved.turns())
    return resume_with(
        engine,
        saved,
        history,
        post,
        lambda doc, announce: _open_document(engine, doc, history, post, cancel, announce),
    )


def resume_with(
    engine: AnyEngine,
    saved: SavedConversation,
    history: Conversation | RemoteConversation,
    post: Post,
    open_document: Callable[[Document, Callable[[DocumentInfo], Message]], str],
) -> str:
    """Resume `saved` as `history`: over its document, read again, by `open_document`, or
    without it when it cannot be (the conversation says why)."""
    doc, problem = _saved_document(engine, saved)
    if doc is not None:
        return open_document(doc, lambda info: ConversationResumed(saved, info, ""))
    engine.new_session(history)  # type: ignore[arg-type]
    post(ConversationResumed(saved, None, problem))
    return f"resumed “{saved.title}”" + (" without its document" if problem else "")


def _saved_document(engine: AnyEngine, saved: SavedConversation) -> tuple[Document | None, str]:
    """The document of `saved`, read again; None with the reason when there is none to read:
    no document, from standard input, gone, or changed since."""
    if saved.document is None:
        return None, ""
    paths = saved.document.path.split("\n")
    if STDIN in paths:
        return None, "it came from standard input, which cannot be read again"
    try:
        doc = engine.read_document(*paths, fitting=True)
    except (DocumentError, PlanRefusedError) as e:
        return None, str(e)
    if doc.sha256 != saved.document.sha256:
        what = "its files" if doc.files else "the file"
        return None, f"{', '.join(paths)}: {what} changed since then"
    return doc, ""


def _open_document(
    engine: Engine,
    doc: Document,
    history: Conversation,
    post: Post,
    cancel: threading.Event,
    announce: Callable[[DocumentInfo], Message],
) -> str:
    """Tokenize `doc`; if it fits, start a new session on it continuing `history`, post
    `announce(info)` and prefill the document; if only a fit holds it, offer the fit."""
    report = progress_reporter(post, "tokenize")
    report(0, len(doc.text))  # the phase shows at once, not after the first batch
    ids = engine.encode_document(doc, report, cancel, fitting=True)
    pending = PendingDocument(doc, ids, history, announce)
    fit = engine.fit(len(_candidate(pending).document_prefix_ids(engine.tokenizer)))
    if fit is not None:
        post(FitOffered(fit, pending))
        return ""
    return open_pending(engine, pending, post, cancel)


def open_pending(
    engine: Engine,
    pending: PendingDocument,
    post: Post,
    cancel: threading.Event,
    fit: Fit | None = None,
) -> str:
    """Start a new session on `pending`'s document (after taking `fit`, when given), post its
    announcement and prefill the document."""
    if fit is not None:
        engine.apply_fit(fit)
    doc, ids, history = pending.doc, pending.ids, pending.history
    candidate = _candidate(pending)
    prefix = candidate.document_prefix_ids(engine.tokenizer)
    engine.check_fits(len(prefix), engine.settings.generation.max_new_tokens)
    session = engine.new_session(replace(candidate, messages=list(history.messages)))
    post(pending.announce(document_info(doc, len(ids))))
    report = progress_reporter(post, "prefill")
    report(0, len(prefix))
    saving = progress_reporter(post, SAVE_PHASE)
    prefill = session.prefill_document(
        prefix, report, cancel, on_saving=lambda done, size: saving(done >> 20, size >> 20)
    )
    for warning in prefill.warnings:
        post(Notice(warning, title="snapshot", severity="warning"))
    return _ready(doc.name, len(prefix), prefill)


def _candidate(pending: PendingDocument) -> Conversation:
    """The conversation over `pending`'s document before its turns: what its prefill holds."""
    return Conversation(
        system=pending.history.system, document_ids=pending.ids, document_name=pending.doc.name
    )


def document_info(doc: Document, tokens: int | None) -> DocumentInfo:
    """What the chat shows of `doc` and a saved conversation keeps of it."""
    return DocumentInfo(
        doc.name,
        doc.size_bytes,
        tokens,
        _head(doc.text),
        _saved_paths(doc),
        doc.sha256,
        len(doc.files),
        doc.skipped,
    )


def _saved_paths(doc: Document) -> str:
    """The paths `resume` reads again, absolute, one a line; "-" (standard input) stays, for
    `resume` to say it cannot be read again."""
    return "\n".join(str(p) if str(p) == STDIN else str(p.resolve()) for p in doc.paths)


def _ready(name: str, n_tokens: int, prefill: PrefillReport) -> str:
    """The line that says a document is ready, and what a snapshot did for it."""
    restored = prefill.describe_restore()
    if restored is None:
        text = f"{name} is ready: {n_tokens} tokens prefilled"
    else:
        text = f"{name} is ready: {restored}"
        if prefill.prefilled:
            text += f", {prefill.prefilled} more prefilled"
    if prefill.saved is not None:
        text += f"; saved as snapshot {prefill.saved.id} ({format_size(prefill.saved.size_bytes)})"
    return text


def ask(engine: AnyEngine, question: str, post: Post, cancel: threading.Event) -> str:
    """Answer `question` as a new turn, posting the reply as it comes; returns what cut the
    reply short, if anything did."""
    on_progress = progress_reporter(post, "prefill")
    _stream(engine.session.ask(question, on_progress=on_progress, cancel=cancel), post)
    return cut_short(engine)


def regenerate(engine: AnyEngine, post: Post, cancel: threading.Event) -> str:
    """Answer the last question again in place of its reply, posting the new one as it
    comes; returns what cut the reply short, if anything did."""
    on_progress = progress_reporter(post, "prefill")
    _stream(engine.session.regenerate(on_progress=on_progress, cancel=cancel), post)
    return cut_short(engine)


def cut_short(engine: AnyEngine) -> str:
    """What ended the last reply before the model did, and what to change for a longer one
    ("" when the model ended it)."""
    settings = engine.settings
    end = engine.session.reply_end
    if end is ReplyEnd.MAX_NEW_TOKENS:
        return (
            f"The reply reached generation.max_new_tokens ({settings.generation.max_new_tokens:,})"
            ": raise it in /settings for longer replies."
        )
    if end is ReplyEnd.FULL_CONTEXT:
        return (
            f"The context is full (long_context.max_seq_len "
            f"{settings.long_context.max_seq_len:,}): /clear starts again on the document."
        )
    return ""


def _stream(pieces: Iterator[str], post: Post) -> None:
    batcher = TokenBatcher(post)
    try:
        for piece in pieces:
            batcher.add(piece)
    finally:
        batcher.flush()  # the partial reply is kept, even when cancelled or failed


def rebuild_cache(engine: Engine, post: Post, cancel: threading.Event) -> str:
    """Prefill the cached context again into a cache made with the current settings."""
    n = engine.session.rebuild(progress_reporter(post, "prefill"), cancel)
    return f"cache rebuilt: {n} tokens prefilled"


def _head(text: str, n_lines: int = CARD_LINES, width: int = CARD_LINE_CHARS) -> str:
    """The first non-blank lines of `text`, each cut to `width`: a preview, never the file."""
    lines: list[str] = []
    for line in text.splitlines():
        if line.strip():
            lines.append(line if len(line) <= width else line[:width] + "…")
            if len(lines) == n_lines:
                break
    return "\n".join(lines)


class LocalSteps:
    """A model loaded in this process."""

    load_model = staticmethod(load_model)
    load_document = staticmethod(load_document)
    resume = staticmethod(resume)
