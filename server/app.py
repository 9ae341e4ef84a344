"""The OpenAI-compatible HTTP API over one engine (Starlette, served by uvicorn).

Starlette is the ASGI toolkit FastAPI is built on; kvchat needs its routing, streaming
responses and disconnect detection, and checks its few request bodies itself
(server/requests.py), so the smaller dependency serves. Routes:

- GET /health, GET /v1/models
- POST /v1/chat/completions, POST /v1/completions: streamed as server-sent events or whole
- GET /v1/kvchat/stats: kvchat's extension, the engine's statistics and the queue

Every route but /health checks, before anything else, that the Host header names this
server (when it listens on loopback: a web page whose name is rebound to 127.0.0.1 reaches
the port but not with its own name) and that a POST's body is declared JSON, which a
page cannot send to another origin without the browser asking first (CORS preflight).

A streamed reply carries the request's queue position and prompt-processing progress as
SSE comment lines (`: ...`), which every SSE client skips; with `"return_progress": true`
also as chunks with empty `choices` and a `prompt_progress` object, as llama-server sends.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kvchat.core.conversation import Conversation
from kvchat.core.errors import USER_ERRORS
from kvchat.core.plan import PlanRefusedError
from kvchat.core.tokenizer import Tokenizer, TooManyTokensError

from .requests import ApiError, Sampling, chat_request, completion_request, parse_json
from .worker import Done, EngineWorker, Event, Failed, Job, Progress, Queued, QueueFullError, Text

Handler = Callable[[Request], Awaitable[Response]]
# A body past this is refused unread: 4x the text of a 1M-token prompt.
MAX_BODY_BYTES = 64 << 20
# A body that stops arriving for this long is refused (408): a slow sender holds a
# connection, not the server.
BODY_TIMEOUT_S = 30.0
# How often a whole (unstreamed) reply checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25


class KvchatApi:
    """The routes, over `worker`'s engine; `document` is the conversation every chat request
    continues (its document prefix, when the server was given documents)."""

    def __init__(
        self,
        worker: EngineWorker,
        model_name: str,
        document: Conversation,
        api_key: str | None,
        hosts: frozenset[str] | None,
        body_timeout_s: float = BODY_TIMEOUT_S,
    ) -> None:
        """`hosts`: the Host headers this server answers (serve.local_hosts); None: any."""
        self.worker, self.model_name, self.document = worker, model_name, document
        self.api_key, self.hosts, self.body_timeout_s = api_key, hosts, body_timeout_s
        self.created = int(time.time())

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/v1/models", self._guard(self.models), methods=["GET"]),
            Route("/v1/chat/completions", self._guard(self.chat), methods=["POST"]),
            Route("/v1/completions", self._guard(self.completions), methods=["POST"]),
            Route("/v1/kvchat/stats", self._guard(self.stats), methods=["GET"]),
        ]
        return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

    def _guard(self, handler: Handler) -> Handler:
        async def guarded(request: Request) -> Response:
            try:
                self._check_host(request)
                if self.api_key is not None:
                    given = request.headers.get("authorization", "")
                    expected = f"Bearer {self.api_key}"
                    if not hmac.compare_digest(given.encode(), expected.encode()):
                        raise ApiError(
                            401,
                            "invalid or missing API key (Authorization: Bearer KEY)",
                            kind="authentication_error",
                            code="invalid_api_key",
                        )
                if request.method == "POST":
                    _check_json(request)
                return await handler(request)
            except ApiError as e:
                return JSONResponse(e.body(), status_code=e.status)

        return guarded

    def _check_host(self, request: Request) -> None:
        host = request.headers.get("host", "").lower()
        if self.hosts is not None and host not in self.hosts:
            raise ApiError(
                421,
                f"the Host header {host[:100]!r} does not name this server; use "
                + " or ".join(sorted(h for h in self.hosts if ":" in h.rpartition("]")[2])),
                code="misdirected_request",
            )

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        model = {
            "id": self.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "kvchat",
        }
        return JSONResponse({"object": "list", "data": [model]})

    async def stats(self, request: Request) -> Response:
        engine = self.worker.engine
        stats = engine.stats()
        # What the process should stay under: at the context held (and a reply), and at the
        # largest one the settings allow.
        context = stats.context_tokens + engine.settings.generation.max_new_tokens
        plans = {
            "context_tokens": context,
            "context_total_bytes": engine.plan(context).total_bytes,
            "max_seq_len": stats.max_seq_len,
            "max_seq_len_total_bytes": engine.plan(stats.max_seq_len).total_bytes,
        }
        body = {
            "model": self.model_name,
            "queue": self.worker.queue_state(),
            "last_request": self.worker.last,
            "document_tokens": len(self.document.document_ids),
            "plan": plans,
            "engine": dataclasses.asdict(stats),
        }
        return JSONResponse(json.loads(json.dumps(body, default=str)))

    async def chat(self, request: Request) -> Response:
        body = parse_json(await self._body(request))
        req = chat_request(body, self.worker.engine.settings.generation)
        if self.document.has_document:
            # The served document's prefix stays the one every request shares.
            conversation = dataclasses.replace(
                self.document, after_document=req.system, messages=req.turns
            )
        else:
            conversation = dataclasses.replace(
                self.document, system=req.system or self.document.system, messages=req.turns
            )
        tokenizer = self.worker.engine.tokenizer
        texts = [req.system or "", *(turn["content"] for turn in req.turns), req.question]
        ids = await self._prompt(
            lambda: conversation.prompt_ids(tokenizer, req.question),
            req.sampling,
            texts,
            len(conversation.document_ids),
        )
        return await self._respond(request, ids, req.sampling, _ChatShape(self.model_name))

    async def completions(self, request: Request) -> Response:
        body = parse_json(await self._body(request))
        req = completion_request(body, self.worker.engine.settings.generation)
        if self.document.has_document:
            raise ApiError(
                400,
                "this server answers about its document through /v1/chat/completions; a "
                "completion's prompt would replace the document in the shared cache",
            )
        tokenizer = self.worker.engine.tokenizer
        ids = await self._prompt(lambda: tokenizer.encode(req.prompt), req.sampling, [req.prompt])
        return await self._respond(request, ids, req.sampling, _CompletionShape(self.model_name))

    async def _body(self, request: Request) -> bytes:
        """The request's body once the queue has room for it: refused with 503 before it is
        read when the queue is full, with 413 past MAX_BODY_BYTES before more is read, and
        with 408 when it stops arriving for body_timeout_s."""
        try:
            self.worker.check_room()
        except QueueFullError as e:
            raise _busy(e) from None
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
        chunks, size = [], 0
        stream = request.stream().__aiter__()
        while True:
            try:
                chunk = await asyncio.wait_for(anext(stream), self.body_timeout_s)
            except StopAsyncIteration:
                return b"".join(chunks)
            except TimeoutError:
                raise ApiError(
                    408, f"the body stopped arriving for {self.body_timeout_s:g} s"
                ) from None
            size += len(chunk)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the body is larger than {MAX_BODY_BYTES >> 20} MiB")
            chunks.append(chunk)

    async def _prompt(
        self,
        encode: Callable[[], list[int]],
        sampling: Sampling,
        texts: list[str],
        known_tokens: int = 0,
    ) -> list[int]:
        """The prompt's ids, refused (400, with the plan's numbers) when the settings or the
        memory cannot hold it and its reply. `texts`, what the prompt is made of besides
        `known_tokens` (a document's), are counted first, in batches that stop past what can
        fit: a 60 MB message takes minutes to tokenize whole, and the tokenizer's one-text
        path holds the GIL, stalling every other request meanwhile."""
        engine = self.worker.engine
        max_new = sampling.params.max_new_tokens

        def checked() -> list[int]:
            budget = engine.settings.long_context.max_seq_len - max_new - known_tokens
            past = _tokens_past(engine.tokenizer, texts, budget)
            if past is not None:
                try:
                    engine.check_fits(known_tokens + past, max_new)
                except PlanRefusedError as refused:
                    raise PlanRefusedError(
                        f"its text alone holds {past:,} tokens or more: {refused}"
                    ) from None
            ids = encode()
            engine.check_fits(len(ids), max_new)
            return ids

        try:
            return await run_in_threadpool(checked)
        except PlanRefusedError as e:
            raise ApiError(400, str(e), code="context_length_exceeded") from None
        except USER_ERRORS as e:  # e.g. a chat template that refuses the messages
            raise ApiError(400, str(e)) from None

    async def _respond(
        self, request: Request, ids: list[int], sampling: Sampling, shape: _Shape
    ) -> Response:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue[Event] = asyncio.Queue()

        def emit(event: Event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the server has shut down: nobody reads the reply
                job.cancel.set()

        job = Job(ids, sampling.params, sampling.stop, emit)
        try:
            self.worker.submit(job)
        except QueueFullError as e:
            raise _busy(e) from None
        if sampling.stream:
            return _JobStream(job, _stream(events, sampling, shape))
        return await _whole(request, job, events, shape)


class _Shape:
    """The JSON of one endpoint's replies (chat.completion or text_completion)."""

    def __init__(self, model: str, prefix: str, whole_object: str, chunk_object: str) -> None:
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.model, self.created = model, int(time.time())
        self.whole_object, self.chunk_object = whole_object, chunk_object

    def envelope(self, obj: str, **fields: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            **fields,
        }

    def first_chunk(self) -> dict[str, Any] | None:
        return None

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        raise NotImplementedError

    def whole(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError


class _ChatShape(_Shape):
    def __init__(self, model: str) -> None:
        super().__init__(model, "chatcmpl", "chat.completion", "chat.completion.chunk")

    def first_chunk(self) -> dict[str, Any]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return self.envelope(self.chunk_object, choices=[choice])

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        delta = {"content": text} if text else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason}
        return self.envelope(self.chunk_object, choices=[choice])

    def whole(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        message = {"role": "assistant", "content": text}
        choice = {"index": 0, "message": message, "finish_reason": finish_reason}
        return self.envelope(self.whole_object, choices=[choice], usage=usage)


class _CompletionShape(_Shape):
    def __init__(self, model: str) -> None:
        super().__init__(model, "cmpl", "text_completion", "text_completion")

    def chunk(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return self.envelope(self.chunk_object, choices=[choice])

    def whole(self, text: str, finish_reason: str, usage: dict[str, Any]) -> dict[str, Any]:
        return {**self.chunk(text, finish_reason), "usage": usage}


def _usage(done: Done) -> dict[str, Any]:
    return {
        "prompt_tokens": done.prompt_tokens,
        "completion_tokens": done.completion_tokens,
        "total_tokens": done.prompt_tokens + done.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": done.cached_tokens},
    }


def _data(obj: dict[str, Any] | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class _JobStream(StreamingResponse):
    """A job's reply as server-sent events. However the response ends (the reply is done,
    the client closed the connection, even before the first event), the job is cancelled:
    the engine stops within a prefill chunk or a token, and a finished job ignores it."""

    def __init__(self, job: Job, content: AsyncIterator[str]) -> None:
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel.set()


async def _stream(
    events: asyncio.Queue[Event], sampling: Sampling, shape: _Shape
) -> AsyncIterator[str]:
    """The events of a job as SSE text."""
    if (first := shape.first_chunk()) is not None:
        yield _data(first)
    while True:
        event = await events.get()
        if isinstance(event, Queued):
            yield f": queued, {event.ahead} ahead\n\n"
        elif isinstance(event, Progress):
            yield f": prompt {event.processed}/{event.total} ({event.cached} cached)\n\n"
            if sampling.return_progress:
                progress = dataclasses.asdict(event)
                yield _data(
                    shape.envelope(shape.chunk_object, choices=[], prompt_progress=progress)
                )
        elif isinstance(event, Text):
            yield _data(shape.chunk(event.text, None))
        elif isinstance(event, Done):
            yield _data(shape.chunk("", event.finish_reason))
            if sampling.include_usage:
                usage = _usage(event)
                yield _data(shape.envelope(shape.chunk_object, choices=[], usage=usage))
            yield _data("[DONE]")
            return
        else:
            assert isinstance(event, Failed)
            yield _data(_failure(event).body())
            return


async def _whole(
    request: Request, job: Job, events: asyncio.Queue[Event], shape: _Shape
) -> Response:
    """The reply in one JSON body; a client that closes the connection first cancels the job."""
    pieces: list[str] = []
    try:
        while True:
            getting = asyncio.ensure_future(events.get())
            while not (await asyncio.wait({getting}, timeout=_DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    getting.cancel()
                    return Response(status_code=499)  # nobody reads it
            event = getting.result()
            if isinstance(event, Text):
                pieces.append(event.text)
            elif isinstance(event, Done):
                body = shape.whole("".join(pieces), event.finish_reason, _usage(event))
                return JSONResponse(body)
            elif isinstance(event, Failed):
                return JSONResponse(_failure(event).body(), status_code=event.status)
    finally:
        job.cancel.set()


def _check_json(request: Request) -> None:
    media_type = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != "application/json":
        raise ApiError(
            415,
            f"the body must be sent as Content-Type: application/json, not {media_type[:100]!r}",
            code="unsupported_media_type",
        )


def _busy(error: QueueFullError) -> ApiError:
    return ApiError(503, str(error), kind="server_error", code="queue_full")


def _failure(event: Failed) -> ApiError:
    kind = "invalid_request_error" if event.status < 500 else "server_error"
    return ApiError(event.status, event.message, kind=kind)


async def _http_error(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (404, 405) in the OpenAI error shape."""
    assert isinstance(exc, HTTPException)
    error = ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}")
    return JSONResponse(error.body(), status_code=exc.status_code)


def _tokens_past(tokenizer: Tokenizer, texts: list[str], budget: int) -> int | None:
    """Some count of tokens over `budget` that `texts` hold, found in batches that stop once
    past it; None when they fit. Texts of fewer bytes than the budget fit (no token spells
    less than a byte) and are not tokenized."""
    if sum(len(text.encode("utf-8", "surrogatepass")) for text in texts) <= budget:
        return None
    used = 0
    for text in texts:
        try:
            used += len(tokenizer.encode_long(text, stop_after=max(0, budget - used)))
        except TooManyTokensError as e:
            return used + e.tokens
    return used if used > budget else None
