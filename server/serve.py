"""Run the API: bind the socket, then serve with uvicorn until interrupted."""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvchat.core.addresses import is_loopback

if TYPE_CHECKING:  # the CLI imports this module at start-up: torch and uvicorn load on serve()
    import uvicorn

    from kvchat.core.conversation import Conversation
    from kvchat.core.engine import Engine

    from .app import KvchatApi

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_WAITING = 16
# The most time one request holds the engine from the start of its turn: every other client
# waits meanwhile.
DEFAULT_REQUEST_TIME_S = 600.0
# The server's own key: apart from the client's ($KVCHAT_API_KEY), which a user may have set
# for another server.
SERVER_KEY_ENV = "KVCHAT_SERVER_KEY"
SHUTDOWN_GRACE_S = 2
# Open connections past the queue's size that uvicorn accepts before it answers 503: clients
# reading the stats, and those whose request is refused.
SPARE_CONNECTIONS = 32
# How long a client may take over a request's headers (and a new connection stay silent).
HEADERS_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class ServeLimits:
    """What one client can take of the engine: places in the queue, seconds of its turn."""

    max_waiting: int
    request_time_s: float


class ServeError(ValueError):
    """A server that cannot start as asked (an address, a key): says what to change."""


def local_hosts(host: str, port: int) -> frozenset[str] | None:
    """The Host headers a server listening on loopback answers: its own address and
    localhost, with and without the port. None (any) for a server that listens beyond
    loopback: that one requires an API key, which a page that rebinds a name does not have."""
    if not is_loopback(host):
        return None
    names = {"localhost", "127.0.0.1", "[::1]", f"[{host}]" if ":" in host else host}
    return frozenset({*names, *(f"{name}:{port}" for name in names)})


def check_address(host: str, api_key: str | None) -> None:
    """Refuse, before the model loads, to open the engine to other machines without a key."""
    if not is_loopback(host) and not api_key:
        raise ServeError(
            f"--host {host} lets other machines reach the server: set an API key with "
            f"--api-key-file, ${SERVER_KEY_ENV} or --api-key (clients then send Authorization: "
            "Bearer KEY)"
        )


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ServeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.listen(128)
    return sock


def uvicorn_config(
    api: KvchatApi, max_waiting: int, headers_timeout_s: float = HEADERS_TIMEOUT_S
) -> uvicorn.Config:
    """How uvicorn runs `api`: connections capped past the queue's size, each held to a
    deadline for its headers."""
    import uvicorn

    from .connections import headers_deadline

    return uvicorn.Config(
        api.app(),
        http=headers_deadline(headers_timeout_s),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
        limit_concurrency=max_waiting + 1 + SPARE_CONNECTIONS,
    )


def serve(
    engine: Engine,
    document: Conversation,
    model_name: str,
    sock: socket.socket,
    api_key: str | None,
    limits: ServeLimits,
    on_ready: Callable[[str], None],
) -> None:
    """Serve on the bound `sock` until SIGINT/SIGTERM; `on_ready(url)` once it accepts."""
    import uvicorn

    from .app import KvchatApi
    from .worker import EngineWorker

    worker = EngineWorker(engine, limits.max_waiting, limits.request_time_s)
    host, port = sock.getsockname()[:2]
    api = KvchatApi(worker, model_name, document, api_key, local_hosts(host, port))

    # On SIGINT/SIGTERM uvicorn waits for open replies; a reply still streaming after that is
    # cancelled, which stops its request in the engine within a chunk or a token.
    class Server(uvicorn.Server):
        interrupted = False  # by Ctrl-C

        def handle_exit(self, sig: int, frame: object) -> None:
            # Open replies end at once (with an error event) instead of when cancelled after
            # the grace period.
            worker.cancel_all()
            self.interrupted |= sig == signal.SIGINT
            super().handle_exit(sig, frame)

    server = Server(uvicorn_config(api, limits.max_waiting))
    shown = f"[{host}]" if ":" in host else host
    on_ready(f"http://{shown}:{port}/v1")
    try:
        server.run(sockets=[sock])
    finally:
        worker.close()
    if server.interrupted:
        # uvicorn raises the signal again once it has stopped, but asyncio's SIGINT handler
        # lets it pass when the serving task is already ending: Ctrl-C ends as it always does.
        raise KeyboardInterrupt
