"""A server that attacks its client gets nothing: a real HTTP server on a loopback port that
answers each path with the raw bytes the test gives it. Oversized lines and bodies end the
reply with one error, text beyond the max_tokens asked for is cut off, a silent server is
given up, and nothing a server sends reaches the terminal with its escape sequences."""

from __future__ import annotations

import dataclasses
import json
import socket
import threading
from collections.abc import Iterator

import pytest

from kvchat.client import http as client_http
from kvchat.client.http import Delta, Finished, OpenAIServer, ServerError
from kvchat.client.stats import engine_stats_from_json
from kvchat.config import load_settings
from kvchat.core.engine import Engine

ESCAPES = "\x1b]52;c;ZXZpbA==\x07\x1b[2J\x9b31m"


class RawServer:
    """Answers a request for PATH with answers[PATH] (the whole HTTP response), then holds
    the connection open until the test ends (a server that goes silent)."""

    def __init__(self) -> None:
        self.answers: dict[str, bytes] = {}
        self.done = threading.Event()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self.done.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            request = b""
            while b"\r\n\r\n" not in request:
                request += conn.recv(65536)
            path = request.split(b" ")[1].decode()
            try:
                conn.sendall(self.answers[path])
            except OSError:
                return
            self.done.wait()


def response(body: bytes, status: str = "200 OK", kind: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\n"
    if kind != "text/event-stream":
        head += f"Content-Length: {len(body)}\r\n"
    return head.encode() + b"\r\n" + body


def events(*chunks: dict | str) -> bytes:
    text = "".join(f"data: {c if isinstance(c, str) else json.dumps(c)}\n\n" for c in chunks)
    return response(text.encode(), kind="text/event-stream")


def delta(text: str) -> dict:
    return {"choices": [{"index": 0, "delta": {"content": text}}]}


@pytest.fixture
def server() -> Iterator[RawServer]:
    raw = RawServer()
    yield raw
    raw.done.set()
    raw.sock.close()


def _chat(server: RawServer, max_tokens: int = 8, **options) -> list:
    client = OpenAIServer(server.url, **options)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens}
    return list(client.stream_chat(body, threading.Event()))


def test_text_past_the_max_tokens_asked_for_is_cut_off(server):
    server.answers["/v1/chat/completions"] = events(*(delta(f" w{i}") for i in range(50)))
    got = _chat(server, max_tokens=5)
    assert [e.text for e in got if isinstance(e, Delta)] == [f" w{i}" for i in range(5)]
    assert got[-1] == Finished("length")


def test_a_line_past_the_bound_ends_the_reply_with_one_error(server, monkeypatch):
    monkeypatch.setattr(client_http, "MAX_LINE_BYTES", 4096)
    server.answers["/v1/chat/completions"] = events(delta("x" * 10_000))
    with pytest.raises(ServerError, match="an event larger than"):
        _chat(server)


def test_a_json_body_past_the_bound_is_refused_unread(server, monkeypatch):
    monkeypatch.setattr(client_http, "MAX_BODY_BYTES", 4096)
    ids = [{"id": f"model-{i}"} for i in range(1000)]
    server.answers["/v1/models"] = response(json.dumps({"data": ids}).encode())
    with pytest.raises(ServerError, match="unreadable answer .larger than"):
        OpenAIServer(server.url).models()


def test_a_server_that_goes_silent_is_given_up(server):
    silent = events(delta("a")).removesuffix(b"data: [DONE]\n\n")  # then nothing more
    server.answers["/v1/chat/completions"] = silent
    with pytest.raises(ServerError, match=r"sent nothing for 0.5 s; gave up \(--server-timeout\)"):
        _chat(server, idle_timeout_s=0.5)


def test_escape_sequences_from_the_server_never_reach_the_terminal(server):
    error = {"error": {"message": ESCAPES + "bad request" + "!" * 10_000}}
    server.answers["/v1/chat/completions"] = response(
        json.dumps(error).encode(), status="400 Bad Request"
    )
    server.answers["/v1/models"] = response(
        json.dumps({"data": [{"id": "good-model"}, {"id": f"evil{ESCAPES}"}]}).encode()
    )
    with pytest.raises(ServerError) as refused:
        _chat(server)
    message = str(refused.value)
    assert "bad request" in message and len(message) < 500
    assert not any(c in message for c in "\x1b\x07\x9b")
    assert OpenAIServer(server.url).models() == ["good-model"]
    # An error event mid-stream too.
    server.answers["/v1/chat/completions"] = events(delta("a"), error)
    with pytest.raises(ServerError) as mid:
        _chat(server)
    assert "bad request" in str(mid.value) and "\x1b" not in str(mid.value)


def test_statistics_of_the_wrong_type_are_refused_and_text_is_made_safe():
    engine = Engine.load(load_settings(overrides=["long_context.max_seq_len=4096"]).settings)
    body = json.loads(json.dumps(dataclasses.asdict(engine.stats()), default=str))
    shown = engine_stats_from_json({**body, "model": f"m{ESCAPES}"})
    assert shown.model == "m]52;c;ZXZpbA==[2J31m"  # the introducers gone, the rest plain text
    for field, value in [("prefill_seconds", "fast"), ("threads", 2.5), ("rss_bytes", True)]:
        with pytest.raises(ValueError, match=field):
            engine_stats_from_json({**body, field: value})
    bad_layer = {
        **body["cache"],
        "layers": [{"layer": 0, "dense": 1, "candidates": 3, "selected": [0]}],
    }
    with pytest.raises(ValueError, match="dense"):
        engine_stats_from_json({**body, "cache": bad_layer})
