"""HTTP/1.1 connections that must send a request's headers in time.

uvicorn bounds neither how long a client may take over a request's headers nor how long a new
connection may stay silent: a client that opens connections and sends a byte now and then
holds each one, and past uvicorn's cap on connections every other client gets 503. Here a
connection that has not finished a request's headers `timeout_s` after it opened, or after its
previous reply, is closed. uvicorn's own h11 protocol is used whatever else is installed, so
the deadline applies always.
"""

from __future__ import annotations

import asyncio

from uvicorn.protocols.http.h11_impl import H11Protocol


def headers_deadline(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a deadline of `timeout_s` for each request's headers."""

    class HeadersInTime(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None
        _waiting_after: object = None  # the cycle before the request being waited for

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._wait_for_headers()

        def on_response_complete(self) -> None:
            # Armed before uvicorn goes on to a pipelined request, which disarms it at once.
            self._wait_for_headers()
            super().on_response_complete()

        def handle_events(self) -> None:
            super().handle_events()
            if self.cycle is not self._waiting_after:  # a request's headers are in
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _wait_for_headers(self) -> None:
            self._disarm()
            self._waiting_after = self.cycle
            self._deadline = self.loop.call_later(timeout_s, self._too_late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_late(self) -> None:
            self._deadline = None
            if self.cycle is self._waiting_after and not self.transport.is_closing():
                self.transport.close()

    return HeadersInTime
