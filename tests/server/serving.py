"""The real routes and engine worker under uvicorn on a loopback port, in the test's process."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from kvchat.core.conversation import Conversation
from kvchat.core.engine import Engine
from kvchat.server.app import KvchatApi
from kvchat.server.serve import bind, local_hosts, uvicorn_config
from kvchat.server.worker import EngineWorker


@contextmanager
def serving(
    engine: Engine,
    max_waiting: int = 1,
    headers_timeout_s: float = 600,
    document: Conversation | None = None,
    **options: Any,
) -> Iterator[str]:
    """The API's base URL while the block runs; the server and its worker stop after it.
    `document`: the conversation every chat request continues (none by default); `options`:
    KvchatApi's own (api_key, body_timeout_s)."""
    worker = EngineWorker(engine, max_waiting)
    sock = bind("127.0.0.1", 0)  # listening already: requests wait in the backlog until served
    port = sock.getsockname()[1]
    options.setdefault("api_key", None)
    api = KvchatApi(
        worker, "m", document or Conversation(), hosts=local_hosts("127.0.0.1", port), **options
    )
    server = uvicorn.Server(uvicorn_config(api, max_waiting, headers_timeout_s))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=120)
        worker.close()
        sock.close()


def post_a_body_that_stops(url: str) -> str:
    """The start of the reply to a POST whose headers announce a 1000-byte body of which only
    the first byte is sent."""
    host, port = url.split("//")[1].split("/")[0].split(":")
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"
    )
    with socket.create_connection((host, int(port)), timeout=600) as raw:  # only a hang times out
        raw.sendall(head.encode())
        reply = b""
        while b"\r\n\r\n" not in reply:
            reply += raw.recv(4096)
        head_part, _, body = reply.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head_part.lower().split(b"\r\n")
            if line.startswith(b"content-length:")
        )
        while len(body) < length:
            body += raw.recv(4096)
        return (head_part + b"\r\n\r\n" + body).decode()
