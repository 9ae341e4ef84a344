"""The turns of one conversation, asked and answered again: what a session on this machine
(engine.Session) and one on a server (client.engine.RemoteSession) share. They differ only in
how a reply is made (`_reply`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from enum import StrEnum
from typing import Generic, Protocol, TypeVar

from kvchat.config import GenerationSettings, Settings

from .conversation import turn_messages

ProgressFn = Callable[[int, int], None]


class ReplyEnd(StrEnum):
    """Why a reply ended. OpenAI's finish_reason is "stop" for END_OF_TURN, "length" for
    MAX_NEW_TOKENS and FULL_CONTEXT."""

    END_OF_TURN = "end of turn"
    MAX_NEW_TOKENS = "max_new_tokens"
    FULL_CONTEXT = "full context"
    STOPPED = "stopped"


class TurnsConversation(Protocol):
    system: str | None
    messages: list[dict[str, str]]

    @property
    def has_document(self) -> bool: ...


class HasSettings(Protocol):
    settings: Settings


C = TypeVar("C", bound=TurnsConversation)


class Turns(Generic[C]):
    """A conversation's turns: ask a question, answer the last one again, clear them. A turn
    counts once its reply begins; a refusal or a stop before that leaves the conversation as
    it was."""

    engine: HasSettings

    def __init__(self, conversation: C) -> None:
        self._conversation = conversation
        self._answer_count = 0
        self.reply_end: ReplyEnd | None = None  # why the last reply ended (None: it runs)

    @property
    def conversation(self) -> C:
        """The conversation, to read: the methods here change it."""
        return self._conversation

    @property
    def messages(self) -> list[dict[str, str]]:
        """A copy of the conversation's user and assistant turns, in order."""
        return [dict(m) for m in self._conversation.messages]

    @property
    def system(self) -> str | None:
        return self._conversation.system

    def set_system(self, prompt: str | None) -> None:
        """Set (None or empty: clear) the system prompt. It comes first, so the next question
        prefills the whole context again."""
        self._conversation.system = prompt or None

    @property
    def has_document(self) -> bool:
        return self._conversation.has_document

    @property
    def answer_count(self) -> int:
        """How many answers `ask` and `regenerate` put into the conversation (each counts once
        its reply begins): a turn that leaves it unchanged got no answer."""
        return self._answer_count

    def clear(self) -> None:
        """Start a new conversation with the same system prompt and document, without the
        turns. A cache stays: the next question shares the document prefix with it, so only
        the question is prefilled."""
        self._conversation = replace(self._conversation, messages=[])  # type: ignore[type-var]

    def ask(
        self,
        question: str,
        params: GenerationSettings | None = None,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[str]:
        """One chat turn: prefill what is new, then stream the reply as text pieces."""
        kept = len(self._conversation.messages)
        yield from self._answer(question, kept, params, on_progress, cancel)

    def regenerate(
        self,
        params: GenerationSettings | None = None,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[str]:
        """Answer the last question again, in place of its reply; streams the new reply as
        text pieces. The old turn stays until the new reply begins. When sampling, a new seed:
        the same one would draw the same reply."""
        messages = self._conversation.messages
        if len(messages) < 2:
            raise ValueError("nothing to regenerate: no question has an answer yet")
        params = params or self.engine.settings.generation
        if params.temperature > 0:
            params = replace(params, seed=-1)
        kept = len(messages) - 2
        yield from self._answer(messages[kept]["content"], kept, params, on_progress, cancel)

    def _answer(
        self,
        question: str,
        kept: int,
        params: GenerationSettings | None,
        on_progress: ProgressFn | None,
        cancel: threading.Event | None,
    ) -> Iterator[str]:
        """Answer `question` after the first `kept` turns of the conversation; once the reply
        begins, the new turn takes the place of any turns after them."""
        params = params or self.engine.settings.generation
        before = replace(self._conversation, messages=self._conversation.messages[:kept])  # type: ignore[type-var]
        reply = self._reply(before, question, params, on_progress, cancel)
        pieces: list[str] = []
        try:
            for text in reply:
                pieces.append(text)
                yield text
        finally:
            self._conversation.messages[kept:] = turn_messages(question, "".join(pieces))
            self._answer_count += 1

    def _reply(
        self,
        before: C,
        question: str,
        params: GenerationSettings,
        on_progress: ProgressFn | None,
        cancel: threading.Event | None,
    ) -> Iterator[str]:
        """Start the reply to `question` after `before` and return its text pieces: returns
        once the reply has begun (raising, with nothing changed, when it cannot); the
        iterator ends at the reply's end or at `cancel`."""
        raise NotImplementedError
