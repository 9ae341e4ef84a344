"""The chat pane: one Markdown widget per message, the reply streamed as it is generated."""

from __future__ import annotations

import re

from textual import events
from textual.await_complete import AwaitComplete
from textual.containers import VerticalScroll
from textual.message import Message
from textual.widgets import Markdown
from textual.widgets.markdown import MarkdownStream

from kvchat.core.folders import skip_summary
from kvchat.core.terminal_text import terminal_safe
from kvchat.tui.messages import DocumentInfo

STOPPED_MARK = "\n\n*[stopped]*"
NO_ANSWER_MARK = "\n\n*[no answer]*"
SKIPPED_SHOWN = 10  # names of skipped files a document card lists; the count says the rest
WAITING_MARK = "\n\n*[waiting: asked when the running step ends; Esc stops that step]*"
# The punctuation that can start inline Markdown (emphasis, code, links, images, HTML,
# entities, tables); a backslash before any ASCII punctuation shows it as itself.
_MARKDOWN_PUNCTUATION = re.compile(r"([\\`*_{}\[\]()<>!#|~&+])")


class ChatMessage(Markdown):
    """One message; `role` (user, assistant, note, document) is also its CSS class. Its
    text goes to the terminal through terminal_safe: Textual passes ESC and the C1 controls
    of a document or a reply through to the screen."""

    what = ""  # what a copy of it is called ("the reply"); empty: it is not copied

    class CopyRequested(Message):
        """The user double-clicked a question or a reply: copy `text`."""

        def __init__(self, text: str, what: str) -> None:
            super().__init__()
            self.text, self.what = text, what

    def __init__(self, text: str, role: str) -> None:
        super().__init__(terminal_safe(text), classes=role)
        self.role = role
        self.text = text

    def on_click(self, event: events.Click) -> None:
        if event.chain == 2 and self.what and self.text:
            self.post_message(self.CopyRequested(self.text, self.what))

    def update(self, markdown: str) -> AwaitComplete:
        return super().update(terminal_safe(markdown))

    def append(self, markdown: str) -> AwaitComplete:
        return super().append(terminal_safe(markdown))


class Question(ChatMessage):
    """A question as typed. One that got no answer (stopped before its reply began, refused,
    failed) stays, marked, as the saved history keeps it."""

    what = "the question"

    def __init__(self, text: str) -> None:
        super().__init__(text, "user")

    @property
    def answered(self) -> bool:
        return not self.has_class("unanswered")

    async def mark_unanswered(self) -> None:
        self.add_class("unanswered")
        await self.update(self.text + NO_ANSWER_MARK)

    @property
    def waiting(self) -> bool:
        return self.has_class("waiting")

    async def set_waiting(self, waiting: bool) -> None:
        """Show the question as queued behind the running step, or as asked."""
        self.set_class(waiting, "waiting")
        await self.update(self.text + (WAITING_MARK if waiting else ""))


class Reply(ChatMessage):
    """An assistant reply: streamed while generated, then set once in full.

    The stream coalesces fragments that arrive faster than Markdown can render; the final
    `update` makes the widget hold exactly the reply text (plus a stopped mark).
    """

    what = "the reply"

    def __init__(self) -> None:
        super().__init__("", "assistant")
        self._stream: MarkdownStream | None = None

    async def add_text(self, fragment: str) -> None:
        if self._stream is None:
            self._stream = Markdown.get_stream(self)
        self.text += fragment
        await self._stream.write(fragment)

    async def finish(self, stopped: bool) -> None:
        if self._stream is not None:
            await self._stream.stop()
            self._stream = None
        if stopped:
            self.add_class("stopped")
        body = self.text if self.text or not stopped else ""
        await self.update(body + (STOPPED_MARK if stopped else ""))


class ChatPane(VerticalScroll):
    async def add(self, message: ChatMessage) -> ChatMessage:
        await self.mount(message)
        self.scroll_end(animate=False)
        return message

    def move_to_end(self, message: ChatMessage) -> None:
        """Show `message` last (a waiting question goes below what arrived after it)."""
        if self.children and self.children[-1] is not message:
            self.move_child(message, after=self.children[-1])
        self.scroll_end(animate=False)

    async def add_user(self, text: str) -> Question:
        # The question as typed, rendered as Markdown like the replies (it is the user's own).
        question = Question(text)
        await self.add(question)
        return question

    async def add_note(self, markdown: str) -> ChatMessage:
        return await self.add(ChatMessage(markdown, "note"))

    async def add_reply(self) -> Reply:
        reply = Reply()
        await self.add(reply)
        return reply

    async def add_saved_reply(self, text: str, stopped: bool) -> Reply:
        """A reply already finished, e.g. one of a resumed conversation."""
        reply = await self.add_reply()
        reply.text = text
        await reply.finish(stopped)
        return reply

    async def add_document_card(self, info: DocumentInfo) -> ChatMessage:
        return await self.add(ChatMessage(document_card(info), "document"))

    def replies(self) -> list[Reply]:
        return list(self.query(Reply))

    def last_question(self) -> Question | None:
        questions = list(self.query(Question))
        return questions[-1] if questions else None


def document_card(info: DocumentInfo) -> str:
    """The card that stands for a document in the chat: never the whole text. A folder's (or
    several paths') says how many files it read and names what it left out."""
    head = info.head.replace("```", "ʼʼʼ")  # keep the preview inside its code fence
    tokens = [] if info.tokens is None else [f"{info.tokens:,} tokens"]
    if not info.files:
        facts = ", ".join([human_bytes(info.size_bytes), *tokens])
    else:
        files = f"{info.files:,} file" + ("" if info.files == 1 else "s")
        parts = [files, *tokens, human_bytes(info.size_bytes)]
        if info.skipped:
            parts.append(skip_summary(info.skipped))
        facts = " · ".join(parts)
    card = f"**{markdown_escape(info.name)}** — {facts}\n\n"
    if info.skipped:
        shown = ", ".join(
            f"{markdown_escape(s.path)} ({s.reason})" for s in info.skipped[:SKIPPED_SHOWN]
        )
        more = len(info.skipped) - SKIPPED_SHOWN
        card += f"Skipped: {shown}" + (f" and {more:,} more" if more > 0 else "")
        card += "\n\n"
    return card + f"```text\n{head}\n```"


def markdown_escape(text: str) -> str:
    """`text` (a file name, a path, an error) to show as itself inside Markdown, on one line:
    no emphasis, link or HTML made of its characters."""
    return _MARKDOWN_PUNCTUATION.sub(r"\\\1", " ".join(text.splitlines()))


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")
