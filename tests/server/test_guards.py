"""What a web page can do to a server on loopback: nothing. A request whose Host header does not
name the server (a page whose name was rebound to 127.0.0.1) is refused with 421, a POST whose
body is not declared JSON (a page's "simple" cross-origin request) with 415, both before the
engine sees it; the client's own requests, and /health, pass."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx2 as httpx
import pytest

from kvchat.config import load_settings
from kvchat.core.engine import Engine
from kvchat.server.serve import local_hosts

from .serving import post_a_body_that_stops, serving

BODY = {"model": "m", "prompt": "1, 2, 3,", "max_tokens": 2}
BODY_TIMEOUT_S = HEADERS_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    engine = Engine.load(load_settings(overrides=["long_context.max_seq_len=4096"]).settings)
    with serving(
        engine, body_timeout_s=BODY_TIMEOUT_S, headers_timeout_s=HEADERS_TIMEOUT_S
    ) as base:
        yield base


def _served(url: str) -> int:
    return httpx.get(f"{url}/kvchat/stats").raise_for_status().json()["queue"]["served"]


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8000", "127.0.0.1.nip.io"])
def test_a_host_that_does_not_name_the_server_is_refused(url, host):
    served = _served(url)
    for method, path, body in [("POST", "completions", BODY), ("GET", "kvchat/stats", None)]:
        reply = httpx.request(method, f"{url}/{path}", json=body, headers={"Host": host})
        assert reply.status_code == 421, reply.text
        error = reply.json()["error"]
        assert (
            error["code"] == "misdirected_request"
            and "does not name this server" in error["message"]
        )
    assert _served(url) == served  # nothing reached the engine


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded", None])
def test_a_post_not_declared_json_is_refused(url, content_type):
    served = _served(url)
    headers = {"Content-Type": content_type} if content_type else {}
    reply = httpx.post(
        f"{url}/completions", content=b'{"model": "m", "prompt": "1,"}', headers=headers
    )
    assert reply.status_code == 415, reply.text
    assert reply.json()["error"]["code"] == "unsupported_media_type"
    assert _served(url) == served


def test_the_servers_own_names_are_answered(url):
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    for host in ["localhost", f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}"]:
        reply = httpx.post(
            f"{url}/completions",
            json=BODY,
            headers={"Host": host, "Content-Type": "application/json; charset=utf-8"},
            timeout=600,
        )
        assert reply.status_code == 200, reply.text
    assert httpx.get(f"{url.removesuffix('/v1')}/health", headers={"Host": "x"}).status_code == 200


def test_a_server_beyond_loopback_answers_any_host_behind_its_key():
    assert local_hosts("0.0.0.0", 8000) is None and local_hosts("192.168.1.5", 8000) is None
    assert local_hosts("::1", 8000) == frozenset(
        {"localhost", "127.0.0.1", "[::1]", "localhost:8000", "127.0.0.1:8000", "[::1]:8000"}
    )


def test_a_body_that_stops_arriving_is_refused_with_408(url):
    reply = post_a_body_that_stops(url)
    assert reply.startswith("HTTP/1.1 408"), reply
    assert f"the body stopped arriving for {BODY_TIMEOUT_S:g} s" in reply


def _closed_by_the_server(raw: socket.socket) -> bool:
    try:
        return raw.recv(4096) == b""
    except ConnectionResetError:
        return True


def test_a_connection_that_does_not_finish_its_headers_in_time_is_closed(url):
    host, port = url.split("//")[1].split("/")[0].split(":")
    # Silent from the start.
    with socket.create_connection((host, int(port)), timeout=600) as idle:  # 600 s: a hang
        assert _closed_by_the_server(idle)
    # Headers sent a line at a time, never ending: the deadline counts from the connection.
    with socket.create_connection((host, int(port)), timeout=600) as slow:
        slow.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode())
        slow.setblocking(False)
        ends = time.monotonic() + 600  # only a hang ends here
        closed = False
        while not closed and time.monotonic() < ends:
            try:
                slow.sendall(b"X-Pad: a\r\n")
                closed = slow.recv(4096) == b""
            except BlockingIOError:
                time.sleep(0.05)
            except (BrokenPipeError, ConnectionResetError):
                closed = True
        assert closed
    assert _served(url) >= 0  # and the next client is answered


def test_a_prompt_whose_size_alone_cannot_fit_is_refused_untokenized(url):
    # Tokenizing 8 MB takes tens of seconds of both cores from the requests being served.
    question = "a " * (4 << 20)
    body = {"model": "m", "messages": [{"role": "user", "content": question}]}
    reply = httpx.post(f"{url}/chat/completions", json=body, timeout=600)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["code"] == "context_length_exceeded"
    assert error["message"].startswith("its text alone holds "), error["message"]
