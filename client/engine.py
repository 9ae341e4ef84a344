"""A model on a server, with the part of Engine and Session the app drives: the same
conversation (the document at the start of the first user message, then the turns), sent
whole with each question as OpenAI chat messages. The server renders and tokenizes them, and
one that caches prompts (kvchat serve, llama-server, vLLM, SGLang) prefills only what is new.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO

from kvchat.config import GenerationSettings, Settings, changed_keys
from kvchat.core.cancel import Cancelled
from kvchat.core.documents import Document, DocumentError, DocumentTooLongError
from kvchat.core.engine import ApplyResult, Throughput
from kvchat.core.sources import read_sources
from kvchat.core.turns import ProgressFn, ReplyEnd, Turns

from .http import Delta, Finished, OpenAIServer, PromptProgress, ServerError
from .stats import ServerStats, StatsPoller

# A server's finish_reason: "length" is its max_tokens (or its context) reached.
FINISH_REASONS = {"stop": ReplyEnd.END_OF_TURN, "length": ReplyEnd.MAX_NEW_TOKENS}
# A document past this is refused before it is sent: 8x the text of a 1M-token prompt.
MAX_DOCUMENT_BYTES = 32 << 20


@dataclass
class RemoteConversation:
    system: str | None = None
    document_text: str = ""
    document_name: str | None = None
    messages: list[dict[str, str]] = field(default_factory=list)  # user/assistant turns

    def chat_messages(self, question: str) -> list[dict[str, str]]:
        """The request's messages: the system prompt, the turns, and `question` as the last
        user message; the document opens the first user message, as in Conversation."""
        turns = [dict(m) for m in self.messages] + [{"role": "user", "content": question}]
        if self.document_text:
            turns[0]["content"] = f"{self.document_text}\n\n{turns[0]['content']}"
        system = [{"role": "system", "content": self.system}] if self.system else []
        return system + turns

    @property
    def has_document(self) -> bool:
        return bool(self.document_text)


class RemoteSession(Turns[RemoteConversation]):
    """One conversation on the server. The server holds its cache: `tokens` is empty here."""

    tokens: Sequence[int] = ()

    def __init__(self, engine: RemoteEngine, conversation: RemoteConversation | None) -> None:
        super().__init__(conversation or RemoteConversation())
        self.engine = engine

    def prefill_document(
        self, on_progress: ProgressFn | None = None, cancel: threading.Event | None = None
    ) -> int | None:
        """Ask the server for one token after the document alone, so that it prefills the
        document now (and keeps it, where it caches prompts) and the first question only
        prefills itself. Returns the prompt's tokens, when the server says."""
        params = replace(self.engine.settings.generation, max_new_tokens=1, temperature=0.0)
        prefix = replace(self._conversation, messages=[])
        finished = None
        for event in self._stream(prefix.chat_messages(""), params, on_progress, cancel):
            if isinstance(event, Finished):
                finished = event
        return None if finished is None else finished.prompt_tokens

    def _reply(
        self,
        before: RemoteConversation,
        question: str,
        params: GenerationSettings,
        on_progress: ProgressFn | None,
        cancel: threading.Event | None,
    ) -> Iterator[str]:
        """Send the conversation and wait for the reply to begin (a refusal, or a stop while
        the server prefills, raises here); then its text, until its end or a stop."""
        events = self._stream(before.chat_messages(question), params, on_progress, cancel)
        first = next(events, None)
        return iter(()) if first is None else _texts(first, events)

    def _stream(
        self,
        messages: list[dict[str, str]],
        params: GenerationSettings,
        on_progress: ProgressFn | None,
        cancel: threading.Event | None,
    ) -> Generator[Delta | Finished]:
        """The reply's text and end, timed here: the prefill until the first text (queue and
        network included), the decode after it."""
        engine, throughput = self.engine, self.engine.throughput
        throughput.begin_prefill()
        throughput.begin_decode()
        self.reply_end = None
        started = time.perf_counter()
        body = engine.request(messages, params)
        events = engine.server.stream_chat(body, cancel or threading.Event())
        first, pieces = None, 0
        with closing(events):
            try:
                for event in events:
                    if isinstance(event, PromptProgress):
                        if on_progress is not None and event.total:
                            on_progress(event.processed, event.total)
                        continue
                    now = time.perf_counter()
                    if isinstance(event, Delta):
                        if first is None:
                            first = now
                            throughput.record_first_token()
                            throughput.record_prefill(0, now - started)
                        pieces += 1
                        throughput.record_decode(pieces, now - first)
                    else:
                        self._finished(event, (first or now) - started, now - (first or now))
                    yield event
            except Cancelled:
                self.reply_end = ReplyEnd.STOPPED
                raise

    def _finished(self, event: Finished, prefill_s: float, decode_s: float) -> None:
        """Why the reply ended, and its token counts where the usage says them."""
        engine, throughput = self.engine, self.engine.throughput
        self.reply_end = FINISH_REASONS.get(event.finish_reason or "", ReplyEnd.END_OF_TURN)
        if event.prompt_tokens is None:
            engine.context_tokens = None
            return
        throughput.record_prefill(event.prompt_tokens - (event.cached_tokens or 0), prefill_s)
        if event.completion_tokens is not None:
            throughput.record_decode(event.completion_tokens, decode_s)
            engine.context_tokens = event.prompt_tokens + event.completion_tokens


def _texts(first: Delta | Finished, events: Generator[Delta | Finished]) -> Iterator[str]:
    """The text of a reply that has begun with `first`. A stop mid-reply ends it: what came
    is the answer, as a stopped local reply is."""
    try:
        for event in itertools.chain([first], events):
            if isinstance(event, Delta):
                yield event.text
    except Cancelled:
        pass
    finally:
        events.close()


class RemoteEngine:
    """A model on an OpenAI-compatible server. Create with `RemoteEngine.connect`; drive from
    one thread at a time, as Engine."""

    def __init__(
        self,
        server: OpenAIServer,
        model: str,
        settings: Settings,
        poller: StatsPoller | None,
    ) -> None:
        self.server, self.model, self.settings, self.poller = server, model, settings, poller
        self.throughput = Throughput()
        # The last reply's prompt and reply, as the server counted (None: it reports no usage).
        self.context_tokens: int | None = 0
        self.session = RemoteSession(self, None)

    @classmethod
    def connect(cls, server: OpenAIServer, settings: Settings, model: str | None) -> RemoteEngine:
        """The server's `model` (None: the first it lists), checked by listing its models;
        its engine statistics are polled where it reports them (kvchat serve)."""
        models = server.models()
        if model is None:
            if not models:
                raise ServerError(f"{server.url}: the server lists no model (GET /models)")
            model = models[0]
        elif models and model not in models:
            raise ServerError(f"{server.url} serves {', '.join(models)}, not {model}")
        poller = StatsPoller(server, 1 / settings.ui.stats_refresh_hz)
        try:
            poller.latest = poller.fetch()
        except ServerError:
            poller = None  # a server without kvchat's extension: the panels say so
        return cls(server, model, settings, poller)

    def new_session(self, conversation: RemoteConversation | None = None) -> RemoteSession:
        self.session = RemoteSession(self, conversation)
        return self.session

    def read_document(
        self, *paths: str | Path, stdin: BinaryIO | None = None, fitting: bool = False
    ) -> Document:
        """The document `paths` make, as Engine.read_document reads it; the server, which
        tokenizes it, says whether it fits. `fitting` changes nothing here."""
        try:
            return read_sources(paths, max_bytes=MAX_DOCUMENT_BYTES, stdin=stdin)
        except DocumentTooLongError as e:
            raise DocumentError(
                f"{e.path}: {e.size_bytes:,} bytes, more than the {MAX_DOCUMENT_BYTES >> 20} MiB "
                "kvchat sends a server"
            ) from None

    def apply_settings(self, settings: Settings) -> ApplyResult:
        """Take `settings`: the generation settings go with the next request; the others are
        the server's business and change nothing here."""
        changed = tuple(changed_keys(self.settings, settings))
        self.settings = settings
        return ApplyResult(live=changed, cache=(), reload=())

    def request(self, messages: list[dict[str, str]], params: GenerationSettings) -> dict[str, Any]:
        """The chat completion request for `messages` under `params` (streamed, with usage)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream_options": {"include_usage": True},
        }
        if params.seed >= 0:
            body["seed"] = params.seed
        return body

    def stats(self) -> ServerStats:
        """The throughput measured here, and the server's engine statistics where it reports
        them; never waits on the network."""
        t = self.throughput
        return ServerStats(
            url=self.server.url,
            model=self.model,
            context_tokens=self.context_tokens,
            prefill_tokens=t.prefill[0],
            prefill_seconds=t.prefill[1],
            decode_tokens=t.decode[0],
            decode_seconds=t.decode[1],
            time_to_first_token=t.time_to_first_token,
            engine=None if self.poller is None else self.poller.poke(),
        )
