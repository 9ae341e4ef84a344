"""Clients that try to take `kvchat serve` from the others, for `kvchat bench serve --hostile`.

Each runs beside the normal clients and reports what the server did with it against what it
should do: a 1 MB stop string refused (400), headers sent a line a second closed at the
headers' deadline, a body that stops arriving refused (408), a 60 MB body refused from its
size alone (400, not tokenized), and a client that disconnects in the middle of its prompt's
prefill (the engine stops it within a layer).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from urllib.parse import urlsplit

from .loopback_http import request

# Longer than any deadline of the server's: only a server that never answers ends here.
GIVE_UP_S = 600


class Hostile(StrEnum):
    STOP_1MB = "stop_1mb"
    SLOW_HEADERS = "slow_headers"
    SLOW_BODY = "slow_body"
    BODY_60MB = "body_60mb"
    DISCONNECT_MID_PREFILL = "disconnect_mid_prefill"


@dataclass
class HostileRun:
    kind: Hostile
    expected: str  # what the server should do with it
    outcome: str = ""  # what it did
    seconds: float = 0.0
    as_expected: bool = False


def run_hostile(kind: Hostile, url: str, start: threading.Event) -> HostileRun:
    """Wait for `start`, then be the `kind` of client; what the server did."""
    expected, act = _KINDS[kind]
    run = HostileRun(kind, expected)
    start.wait()
    began = time.perf_counter()
    try:
        run.outcome, run.as_expected = act(url)
    except OSError as e:
        run.outcome = f"error: {e}"
    run.seconds = round(time.perf_counter() - began, 3)
    return run


def _chat(content: str, **fields: object) -> dict[str, object]:
    return {"model": "bench", "messages": [{"role": "user", "content": content}], **fields}


def _refused(
    url: str, body: dict[str, object], code: str | None, opening: str = ""
) -> tuple[str, bool]:
    """What the server said to `body`; as expected when it is 400 with `code`, its message
    opening with `opening`."""
    response = request(url, "/chat/completions", body)
    error = json.loads(response.read()).get("error", {})
    said = f"{response.status} {error.get('code') or ''}".strip()
    message = str(error.get("message", ""))
    return said, response.status == 400 and error.get("code") == code and message.startswith(
        opening
    )


def _stop_1mb(url: str) -> tuple[str, bool]:
    return _refused(url, _chat("Count to ten.", stop=["x" * (1 << 20)], max_tokens=8), None)


def _body_60mb(url: str) -> tuple[str, bool]:
    # Refused from its text, counted only past what fits (server/app.py), not tokenized whole.
    body = _chat("a " * (30 << 20), max_tokens=8)
    return _refused(url, body, "context_length_exceeded", "its text alone holds ")


def _connect(url: str) -> tuple[socket.socket, str]:
    parts = urlsplit(url)
    raw = socket.create_connection((parts.hostname, parts.port), timeout=GIVE_UP_S)
    return raw, f"{parts.hostname}:{parts.port}"


def _slow_headers(url: str) -> tuple[str, bool]:
    raw, host = _connect(url)
    with raw:
        raw.sendall(
            f"POST {urlsplit(url).path}/chat/completions HTTP/1.1\r\nHost: {host}\r\n".encode()
        )
        raw.settimeout(1.0)
        ends = time.monotonic() + GIVE_UP_S
        while time.monotonic() < ends:
            try:
                if raw.recv(4096) == b"":
                    return "closed by the server", True
            except TimeoutError:
                try:
                    raw.sendall(b"X-Pad: a\r\n")
                except OSError:
                    return "closed by the server", True
            except ConnectionResetError:
                return "closed by the server", True
    return "still open", False


def _slow_body(url: str) -> tuple[str, bool]:
    raw, host = _connect(url)
    with raw:
        raw.sendall(
            f"POST {urlsplit(url).path}/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
        )
        reply = raw.recv(4096).decode(errors="replace")
    status = reply.split("\r\n", 1)[0]
    return status or "closed without a reply", status.startswith("HTTP/1.1 408")


def _disconnect_mid_prefill(url: str) -> tuple[str, bool]:
    # Several prefill chunks at the default chunk size; the client leaves at the first report.
    prompt = " ".join(f"item{i}" for i in range(1200)) + "\nWhich item comes last?"
    body = json.dumps(_chat(prompt, stream=True, max_tokens=8)).encode()
    raw, host = _connect(url)
    with raw:
        raw.sendall(
            f"POST {urlsplit(url).path}/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        for line in raw.makefile("rb"):
            said = line.decode(errors="replace").strip()
            if said.startswith(": prompt "):
                done, total = map(int, said.split()[2].split("/"))
                if done < total:
                    # Closing mid-prefill: the server must stop its engine on this request.
                    raw.shutdown(socket.SHUT_RDWR)
                    return f"left after {done} of {total} prompt tokens", True
    return "its prompt was prefilled before it could leave", False


_KINDS: dict[Hostile, tuple[str, Callable[[str], tuple[str, bool]]]] = {
    Hostile.STOP_1MB: ("400", _stop_1mb),
    Hostile.SLOW_HEADERS: ("closed at the headers' deadline", _slow_headers),
    Hostile.SLOW_BODY: ("408", _slow_body),
    Hostile.BODY_60MB: ("400 context_length_exceeded, untokenized", _body_60mb),
    Hostile.DISCONNECT_MID_PREFILL: ("cancelled within a layer", _disconnect_mid_prefill),
}
