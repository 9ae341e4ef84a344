"""Messages the engine worker posts to the app.

The worker thread never touches a widget: it posts one of these (post_message is
thread-safe) and the app updates the screen on its own thread.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from textual.message import Message

from kvchat.client.engine import RemoteEngine
from kvchat.core.conversation import Conversation
from kvchat.core.documents import Document, Skipped
from kvchat.core.engine import Engine
from kvchat.core.fit import Fit
from kvchat.core.history import SavedConversation
from kvchat.native import BuildProgress

# The phase of Progress while the model loads: it counts weight tensors and cannot be stopped.
LOAD_PHASE = "load model"
# The phase of Progress while a snapshot of the prefill is written: it counts MiB.
SAVE_PHASE = "save snapshot"


class ModelLoaded(Message):
    def __init__(self, engine: Engine | RemoteEngine) -> None:
        super().__init__()
        self.engine = engine


class KernelBuild(Message):
    """The C++ kernels compiling for this CPU (a first start), while the model loads."""

    def __init__(self, progress: BuildProgress) -> None:
        super().__init__()
        self.progress = progress


class Progress(Message):
    """Throttled progress of a long step: `phase` is "tokenize" (characters) or "prefill"."""

    def __init__(self, phase: str, done: int, total: int, elapsed: float) -> None:
        super().__init__()
        self.phase, self.done, self.total, self.elapsed = phase, done, total, elapsed


@dataclass(frozen=True)
class DocumentInfo:
    """What the chat shows of a loaded document: never the whole text."""

    name: str
    size_bytes: int
    tokens: int | None  # None: read by a server that did not say
    head: str  # the first few lines, cut short
    # The paths, absolute, one a line ("-": standard input); with sha256, what a saved
    # conversation reloads on resume.
    path: str = ""
    sha256: str = ""
    files: int = 0  # files read under header lines (a folder, several paths); 0: one file
    skipped: tuple[Skipped, ...] = ()


class DocumentLoaded(Message):
    """The document replaced the previous one; its prefix prefill follows."""

    def __init__(self, info: DocumentInfo) -> None:
        super().__init__()
        self.info = info


class ConversationResumed(Message):
    """A saved conversation replaced the session; `info` is its document, reloaded, or None
    when it has none or `problem` says why it could not be reloaded."""

    def __init__(self, saved: SavedConversation, info: DocumentInfo | None, problem: str) -> None:
        super().__init__()
        self.saved, self.info, self.problem = saved, info, problem


class Notice(Message):
    """A line for the user from a worker step, shown as a notification (e.g. a snapshot that
    could not be used)."""

    def __init__(self, text: str, title: str = "", severity: str = "information") -> None:
        super().__init__()
        self.text, self.title, self.severity = text, title, severity


class ReplyPiece(Message):
    """Batched text of the reply being generated."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text


class StepFinished(Message):
    """A worker step ("model", "document" or "reply") ended.

    `stopped`: Esc cancelled it (detail says where); `error`: it failed, in words for the user.
    """

    def __init__(
        self, kind: str, *, stopped: bool = False, detail: str = "", error: str | None = None
    ) -> None:
        super().__init__()
        self.kind, self.stopped, self.detail, self.error = kind, stopped, detail, error


@dataclass(frozen=True)
class PendingDocument:
    """A document read and tokenized, waiting for its session: what `open_pending` needs."""

    doc: Document
    ids: list[int]
    history: Conversation
    announce: Callable[[DocumentInfo], Message]


class FitOffered(Message):
    """A document the settings cannot hold but `fit` can: the app offers the fit, and on a
    yes opens `pending` under it (bridge.open_pending)."""

    def __init__(self, fit: Fit, pending: PendingDocument) -> None:
        super().__init__()
        self.fit, self.pending = fit, pending
