"""Run the API: bind the socket, then serve with uvicorn until interrupted."""

from __future__ import annotations

import ipaddress
import signal
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the CLI imports this module at start-up: torch and uvicorn load on serve()
    from kvchat.core.conversation import Conversation
    from kvchat.core.engine import Engine

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_WAITING = 16
API_KEY_ENV = "KVCHAT_API_KEY"
SHUTDOWN_GRACE_S = 2


class ServeError(ValueError):
    """A server that cannot start as asked (an address, a key): says what to change."""


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(host: str, api_key: str | None) -> None:
    """Refuse, before the model loads, to open the engine to other machines without a key."""
    if not is_loopback(host) and not api_key:
        raise ServeError(
            f"--host {host} lets other machines reach the server: set an API key with "
            f"--api-key or ${API_KEY_ENV} (clients then send Authorization: Bearer KEY)"
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


def serve(
    engine: Engine,
    document: Conversation,
    model_name: str,
    sock: socket.socket,
    api_key: str | None,
    max_waiting: int,
    on_ready: Callable[[str], None],
) -> None:
    """Serve on the bound `sock` until SIGINT/SIGTERM; `on_ready(url)` once it accepts."""
    import uvicorn

    from .app import KvchatApi
    from .worker import EngineWorker

    worker = EngineWorker(engine, max_waiting)
    api = KvchatApi(worker, model_name, document, api_key)

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

    config = uvicorn.Config(
        api.app(),
        log_level="warning",
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
    )
    server = Server(config)
    host, port = sock.getsockname()[:2]
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
