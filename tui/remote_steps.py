"""The app's steps for a model on a server (kvchat.client): connect, have the server read a
document, resume a saved conversation. Answering is bridge.ask, as for a local model."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

from textual.message import Message

from kvchat.client.engine import RemoteConversation, RemoteEngine, RemoteSession
from kvchat.client.http import OpenAIServer
from kvchat.config import Settings
from kvchat.core.documents import Document
from kvchat.core.history import SavedConversation

from .bridge import Post, document_info, progress_reporter, resume_with
from .messages import DocumentInfo, DocumentLoaded, ModelLoaded


class RemoteSteps:
    def __init__(self, server: OpenAIServer) -> None:
        self.server = server

    def load_model(self, settings: Settings, model_spec: str | None, post: Post) -> str:
        """Connect to the server's model `model_spec` (None: the first it lists)."""
        engine = RemoteEngine.connect(self.server, settings, model_spec)
        post(ModelLoaded(engine))
        return f"{engine.model} on {self.server.url}"

    def load_document(
        self,
        engine: RemoteEngine,
        paths: Sequence[str | Path],
        post: Post,
        cancel: threading.Event,
        stdin: BinaryIO | None = None,
    ) -> str:
        doc = engine.read_document(*paths, stdin=stdin)
        return _open_document(engine, doc, RemoteConversation(), post, cancel, DocumentLoaded)

    def resume(
        self,
        engine: RemoteEngine,
        saved: SavedConversation,
        post: Post,
        cancel: threading.Event,
    ) -> str:
        history = RemoteConversation(system=saved.system, messages=saved.turns())
        return resume_with(
            engine,
            saved,
            history,
            post,
            lambda doc, announce: _open_document(engine, doc, history, post, cancel, announce),
        )


def _open_document(
    engine: RemoteEngine,
    doc: Document,
    history: RemoteConversation,
    post: Post,
    cancel: threading.Event,
    announce: Callable[[DocumentInfo], Message],
) -> str:
    """Have the server prefill `doc`, then continue `history` over it. A refusal (too long
    for the server) or a stop before the server has read it leaves the session as it was."""
    session = RemoteSession(
        engine, replace(history, document_text=doc.text, document_name=doc.name)
    )
    tokens = session.prefill_document(progress_reporter(post, "prefill"), cancel)
    engine.session = session
    post(announce(document_info(doc, tokens)))
    read = "it" if tokens is None else f"{tokens:,} tokens"
    return f"{doc.name} is ready: the server read {read}"
