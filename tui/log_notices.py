"""The engine's warnings (kernels that fell back to torch, a snapshot that cannot be read, a
tokenizer that cannot be cached) as notifications in the app, instead of a logger nobody
reads or lines written over the screen."""

from __future__ import annotations

import logging
from collections.abc import Callable

from .messages import Notice

# Every module of the engine logs under this name (logging.getLogger(__name__)).
ENGINE_LOGGER = "kvchat"


class NoticeHandler(logging.Handler):
    """Posts each warning or error of the engine's loggers as a Notice; `post` is
    thread-safe, so records from the engine's worker thread arrive too."""

    def __init__(self, post: Callable[[Notice], None]) -> None:
        super().__init__(level=logging.WARNING)
        self.post = post

    def emit(self, record: logging.LogRecord) -> None:
        severity = "error" if record.levelno >= logging.ERROR else "warning"
        try:
            text = record.getMessage()
        except (TypeError, ValueError):  # a malformed log call still says something
            text = str(record.msg)
        self.post(Notice(text, title=record.levelname.lower(), severity=severity))


def forward_engine_warnings(post: Callable[[Notice], None]) -> Callable[[], None]:
    """Send the engine's warnings to `post` from now on; returns what stops it."""
    logger = logging.getLogger(ENGINE_LOGGER)
    handler = NoticeHandler(post)
    logger.addHandler(handler)
    return lambda: logger.removeHandler(handler)
