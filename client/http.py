"""A client of the OpenAI-compatible HTTP API: JSON requests, and chat completions streamed as
server-sent events, with a stop that closes the connection at once.

The standard library's http.client suffices: kvchat sends one request at a time, and closing
the socket from another thread is the one way to end a read that waits on a server still
prefilling a long prompt (a server that streams nothing meanwhile gives no chance to check).
"""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from kvchat.core.addresses import is_loopback
from kvchat.core.cancel import Cancelled
from kvchat.core.errors import UserError
from kvchat.core.terminal_text import terminal_safe

REQUEST_TIMEOUT_S = 30.0
# A streamed reply that sends nothing for this long is given up (a server's prefill that
# reports no progress counts as nothing): the default of --server-timeout.
IDLE_TIMEOUT_S = 1800.0
# What one answer may take, so that a server cannot fill this process's memory: a JSON
# body, one line of a stream (an event), and an error's text as shown.
MAX_BODY_BYTES = 16 << 20
MAX_LINE_BYTES = 1 << 20
MAX_MESSAGE_CHARS = 300
# kvchat serve reports prefill progress as SSE comments: ": prompt 4096/120000 (0 cached)".
_PROGRESS_COMMENT = re.compile(r"prompt (\d+)/(\d+)")

# The credential the app sends to a --server: the server's own key is another variable.
CLIENT_KEY_ENV = "KVCHAT_API_KEY"


class ServerError(UserError):
    """A server that cannot be reached, refuses a request, or answers in a shape kvchat cannot
    read; `status` is the HTTP status when there was one."""

    def __init__(self, message: str, status: int | None = None) -> None:
        # Shown in the terminal and built from what a server sent: nothing in it may act.
        super().__init__(terminal_safe(message))
        self.status = status


@dataclass(frozen=True)
class PromptProgress:
    processed: int
    total: int


@dataclass(frozen=True)
class Delta:
    text: str


@dataclass(frozen=True)
class Finished:
    """The stream's end: why the reply ended, and the usage when the server reported it."""

    finish_reason: str | None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None


StreamEvent = PromptProgress | Delta | Finished


class OpenAIServer:
    """One server, named by its base URL: http://host:port/v1 (a URL without a path means
    /v1, as every OpenAI-compatible server serves it there)."""

    def __init__(
        self, url: str, api_key: str | None = None, idle_timeout_s: float = IDLE_TIMEOUT_S
    ) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ServerError(f"{url}: not a server URL (e.g. http://127.0.0.1:8000/v1)")
        try:
            self.port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError:
            raise ServerError(f"{url}: the port is not a number") from None
        self.scheme, self.host = parts.scheme, parts.hostname
        if api_key and self.scheme == "http" and not is_loopback(self.host):
            raise ServerError(
                f"{url}: the API key would cross the network unencrypted; use https://, or "
                f"a tunnel to a loopback port (ssh -L 8000:127.0.0.1:8000 {self.host})"
            )
        self.base_path = parts.path.rstrip("/") or "/v1"
        self.url = f"{self.scheme}://{parts.netloc}{self.base_path}"
        self.api_key, self.idle_timeout_s = api_key, idle_timeout_s

    def _connection(self, timeout: float | None) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout)

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        return headers

    def _send(
        self, conn: http.client.HTTPConnection, method: str, path: str, body: Any = None
    ) -> http.client.HTTPResponse:
        data = None if body is None else json.dumps(body).encode()
        try:
            conn.request(method, self.base_path + path, body=data, headers=self._headers())
            response = conn.getresponse()
        except (OSError, http.client.HTTPException) as e:
            raise ServerError(f"{self.url}: cannot reach the server ({e})") from None
        if response.status != 200:
            raise ServerError(
                f"{self.url}{path}: {response.status} {_error_message(response)}", response.status
            )
        return response

    def get(self, path: str) -> dict[str, Any]:
        """The JSON body of GET `path` (under the base URL)."""
        conn = self._connection(REQUEST_TIMEOUT_S)
        try:
            response = self._send(conn, "GET", path)
            try:
                raw = response.read(MAX_BODY_BYTES + 1)
                if len(raw) > MAX_BODY_BYTES:
                    raise ValueError(f"larger than {MAX_BODY_BYTES >> 20} MiB")
                body = json.loads(raw)
            except (OSError, http.client.HTTPException, ValueError) as e:
                raise ServerError(f"{self.url}{path}: unreadable answer ({e})") from None
        finally:
            conn.close()
        if not isinstance(body, dict):
            raise ServerError(f"{self.url}{path}: the answer is not a JSON object")
        return body

    def models(self) -> list[str]:
        """The ids of the models the server serves, in its order."""
        data = self.get("/models").get("data")
        ids = [m.get("id") for m in data if isinstance(m, dict)] if isinstance(data, list) else []
        # An id the terminal would not show as it is cannot be shown or chosen: left out.
        return [i for i in ids if isinstance(i, str) and 0 < len(i) <= 256 and _plain(i)]

    def stream_chat(self, body: dict[str, Any], cancel: threading.Event) -> Iterator[StreamEvent]:
        """POST /chat/completions with `body` (streamed) and yield what comes: prompt progress
        where the server reports it, reply text, and the end. Setting `cancel` closes the
        connection, so the server stops too; the read that breaks raises Cancelled. A server
        that sends more pieces of text than body's max_tokens is cut off there (the reply ends
        as "length"), one that sends nothing for idle_timeout_s is given up."""
        conn = self._connection(REQUEST_TIMEOUT_S)
        ended = threading.Event()
        try:
            try:
                conn.connect()
            except OSError as e:
                raise ServerError(f"{self.url}: cannot reach the server ({e})") from None
            # The answer may start after a prefill of many minutes.
            conn.sock.settimeout(self.idle_timeout_s)
            threading.Thread(target=_close_on, args=(conn, cancel, ended), daemon=True).start()
            response = self._send(conn, "POST", "/chat/completions", {**body, "stream": True})
            events = _events(response, cancel, self.url, self.idle_timeout_s)
            yield from _at_most(events, body.get("max_tokens"))
        except ServerError:
            if cancel.is_set():
                raise Cancelled("stopped") from None
            raise
        finally:
            ended.set()
            conn.close()


def _plain(text: str) -> bool:
    return terminal_safe(text) == text


def _close_on(conn: http.client.HTTPConnection, cancel: threading.Event, ended: threading.Event):
    """Shut `conn`'s socket once `cancel` is set, unless the request `ended` first."""
    while not ended.is_set():
        if cancel.wait(0.05):
            if conn.sock is not None and not ended.is_set():
                with suppress(OSError):
                    conn.sock.shutdown(socket.SHUT_RDWR)
            return


def _at_most(events: Iterator[StreamEvent], max_tokens: Any) -> Iterator[StreamEvent]:
    """`events` until the max_tokens-th piece of text: a server sends at least a token a
    piece, so one that sends more has ignored the limit, and the reply ends there."""
    if not isinstance(max_tokens, int):
        yield from events
        return
    pieces = 0
    for event in events:
        if isinstance(event, Delta):
            if pieces == max_tokens:
                yield Finished("length")
                return
            pieces += 1
        yield event


def _events(
    response: http.client.HTTPResponse, cancel: threading.Event, url: str, idle_s: float
) -> Iterator[StreamEvent]:
    finish_reason, usage = None, None
    data: list[str] = []
    size = 0
    while True:
        try:
            raw = response.readline(MAX_LINE_BYTES + 1)
        except TimeoutError:
            raise ServerError(
                f"{url}: the server sent nothing for {idle_s:g} s; gave up (--server-timeout)"
            ) from None
        except (OSError, http.client.HTTPException) as e:
            if cancel.is_set():
                raise Cancelled("stopped") from None
            raise ServerError(f"{url}: the connection broke mid-reply ({e})") from None
        if not raw:
            if cancel.is_set():
                raise Cancelled("stopped")
            break  # a server that ends the stream without [DONE]
        size += len(raw)
        if len(raw) > MAX_LINE_BYTES or size > MAX_LINE_BYTES:
            raise ServerError(f"{url}: an event larger than {MAX_LINE_BYTES >> 20} MiB")
        line = raw.decode("utf-8", "replace").rstrip("\r\n")
        if line.startswith(":"):
            if match := _PROGRESS_COMMENT.search(line):
                yield PromptProgress(int(match[1]), int(match[2]))
            continue
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
            continue
        if line or not data:
            continue  # an event's other fields (event:, id:, retry:), or a blank between
        payload, data, size = "\n".join(data), [], 0
        if payload == "[DONE]":
            break
        try:
            chunk = json.loads(payload)
        except ValueError:
            raise ServerError(f"{url}: an event that is not JSON: {payload[:80]!r}") from None
        if not isinstance(chunk, dict):
            continue
        if "error" in chunk:
            raise ServerError(f"{url}: {_message_of(chunk)[:MAX_MESSAGE_CHARS]}")
        if isinstance(chunk.get("usage"), dict):
            usage = chunk["usage"]
        progress = chunk.get("prompt_progress")
        if isinstance(progress, dict) and isinstance(progress.get("processed"), int):
            yield PromptProgress(progress["processed"], int(progress.get("total") or 0))
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if isinstance(delta.get("content"), str) and delta["content"]:
                yield Delta(delta["content"])
            finish_reason = choice.get("finish_reason") or finish_reason
    yield _finished(finish_reason, usage)


def _finished(finish_reason: str | None, usage: dict[str, Any] | None) -> Finished:
    if usage is None:
        return Finished(finish_reason)
    details = usage.get("prompt_tokens_details") or {}
    return Finished(
        finish_reason,
        usage.get("prompt_tokens"),
        usage.get("completion_tokens"),
        details.get("cached_tokens") if isinstance(details, dict) else None,
    )


def _error_message(response: http.client.HTTPResponse) -> str:
    """The message of an error answer: OpenAI's {"error": {"message": ...}}, else its text."""
    try:
        text = response.read(64 << 10).decode("utf-8", "replace")
    except (OSError, http.client.HTTPException):
        return response.reason
    try:
        return _message_of(json.loads(text))[:MAX_MESSAGE_CHARS]
    except ValueError:
        return " ".join(text.split())[:MAX_MESSAGE_CHARS] or response.reason


def _message_of(body: Any) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and isinstance(error.get("message"), str):
        return error["message"]
    if isinstance(error, str):
        return error  # Ollama and some others: {"error": "..."}
    if isinstance(body, dict) and isinstance(body.get("detail"), str):
        return body["detail"]  # FastAPI's own errors
    return json.dumps(body)[:300]
