"""The bench's HTTP to `kvchat serve` on loopback: one request a connection, standard library."""

from __future__ import annotations

import http.client
import json
from typing import Any
from urllib.parse import urlsplit


class ServeBenchError(RuntimeError):
    """kvchat serve did not start, or answered the bench with an error."""


def request(url: str, path: str, body: dict[str, Any] | None = None) -> http.client.HTTPResponse:
    """POST `body` (GET without one) to url + path; the response, unread."""
    parts = urlsplit(url)
    connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=600)
    data = None if body is None else json.dumps(body).encode()
    headers = {"Content-Type": "application/json"} if body is not None else {}
    connection.request("GET" if body is None else "POST", parts.path + path, data, headers)
    return connection.getresponse()


def response_json(response: http.client.HTTPResponse) -> dict[str, Any]:
    """The body of a 200 response; ServeBenchError for any other."""
    body = json.loads(response.read())
    if response.status != 200:
        raise ServeBenchError(f"kvchat serve answered {response.status}: {body}")
    return body
