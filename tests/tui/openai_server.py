"""A small OpenAI-compatible server for the app's client tests: real HTTP on a loopback port
(Starlette under uvicorn, in a thread), answering as a plain server does (no kvchat
extension), with a canned reply that quotes the question. It records each request and whether
its client went away before the reply ended."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODELS = ("echo-1", "echo-2")


def reply_to(question: str) -> str:
    return f"You asked: {question.splitlines()[-1]}"


@dataclass
class Seen:
    body: dict[str, Any]
    cancelled: bool = False
    finished: bool = False


@dataclass
class EchoServer:
    api_key: str | None = None
    # Replies wait before their first word until `released` is set (a "prefill" the test
    # ends, or that outlasts the test).
    hold_replies: bool = False
    released: threading.Event = field(default_factory=threading.Event)
    usage: bool = True  # whether it sends the usage a client asks for (some servers do not)
    requests: list[Seen] = field(default_factory=list)
    url: str = ""

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
            ]
        )

    def _refused(self, request: Request) -> Response | None:
        if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
            error = {"message": "Incorrect API key provided", "type": "invalid_request_error"}
            return JSONResponse({"error": error}, status_code=401)
        return None

    async def models(self, request: Request) -> Response:
        refused = self._refused(request)
        data = [{"id": name, "object": "model", "owned_by": "test"} for name in MODELS]
        return refused or JSONResponse({"object": "list", "data": data})

    async def chat(self, request: Request) -> Response:
        if (refused := self._refused(request)) is not None:
            return refused
        body = await request.json()
        prompt = sum(len(m["content"].split()) for m in body["messages"])
        if prompt > 5000:
            error = {"message": f"This model's maximum context length is 5000 tokens ({prompt})"}
            return JSONResponse({"error": error}, status_code=400)
        seen = Seen(body)
        self.requests.append(seen)
        words = reply_to(body["messages"][-1]["content"]).split(" ")
        cut = len(words) > body.get("max_tokens", len(words))
        words = words[: body.get("max_tokens", len(words))]
        reason = "length" if cut else "stop"
        events = self._events(seen, words, prompt, reason)
        return StreamingResponse(events, media_type="text/event-stream")

    async def _events(
        self, seen: Seen, words: list[str], prompt: int, reason: str
    ) -> AsyncIterator[str]:
        try:
            first = {"choices": [{"index": 0, "delta": {"role": "assistant"}}]}
            yield f"data: {json.dumps(first)}\n\n"
            while self.hold_replies and not self.released.is_set():
                await asyncio.sleep(0.01)
            for i, word in enumerate(words):
                delta = {"content": word if i == 0 else f" {word}"}
                yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': delta}]})}\n\n"
            end = {"choices": [{"index": 0, "delta": {}, "finish_reason": reason}]}
            yield f"data: {json.dumps(end)}\n\n"
            if self.usage and seen.body.get("stream_options", {}).get("include_usage"):
                usage = {"prompt_tokens": prompt, "completion_tokens": len(words)}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
            seen.finished = True
        finally:
            seen.cancelled = not seen.finished


@contextmanager
def serving(server: EchoServer) -> Iterator[EchoServer]:
    """`server` listening on a free loopback port while the block runs."""
    config = uvicorn.Config(server.app(), host="127.0.0.1", port=0, log_level="warning")
    running = uvicorn.Server(config)
    thread = threading.Thread(target=running.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not running.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    port = running.servers[0].sockets[0].getsockname()[1]
    server.url = f"http://127.0.0.1:{port}/v1"
    try:
        yield server
    finally:
        server.released.set()
        running.should_exit = True
        thread.join(timeout=10)
