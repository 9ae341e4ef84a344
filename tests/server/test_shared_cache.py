"""Every client of a server shares its one cache, so no request may take from the next the
document it serves: a request's own system message follows the document instead of preceding
it, a raw completion is refused by a server with a document, and a cache that extrapolates
positions stays so when a shorter request comes (each switch prefills everything again)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import pytest

from kvchat.config import load_settings
from kvchat.core.conversation import Conversation
from kvchat.core.engine import Engine

from .serving import serving

SAMPLE = Path(__file__).parents[2] / "core" / "data" / "sample.txt"
QUESTION = "When was the lighthouse built?"
# A short window: extrapolated prefill passes keep local distances within 512 positions.
OVERRIDES = [
    "long_context.max_seq_len=4096",
    "long_context.local_windows_len=256",
    "generation.max_new_tokens=8",
]


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(load_settings(overrides=OVERRIDES).settings)


def _chat(url: str, messages: list[dict[str, str]]) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": 4}
    return httpx.post(f"{url}/chat/completions", json=body, timeout=600).raise_for_status().json()


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture(scope="module")
def served(engine) -> Iterator[tuple[str, int]]:
    """A server of the sample document, and the tokens of the document's prefix."""
    doc = engine.read_document(SAMPLE)
    document = Conversation(document_ids=engine.encode_document(doc), document_name=doc.name)
    prefix = len(document.document_prefix_ids(engine.tokenizer))
    with serving(engine, document=document) as url:
        _chat(url, [{"role": "user", "content": QUESTION}])  # the document is cached from here
        yield url, prefix


def test_a_requests_system_message_follows_the_document_and_leaves_it_cached(served):
    url, prefix = served
    plain = _chat(url, [{"role": "user", "content": QUESTION}])
    system = "Answer in one short sentence."
    told = _chat(
        url, [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]
    )
    assert _cached(told) >= prefix
    assert told["usage"]["prompt_tokens"] > plain["usage"]["prompt_tokens"]  # it is in the prompt
    after = _chat(url, [{"role": "user", "content": QUESTION}])
    assert _cached(after) >= prefix


def test_a_raw_completion_is_refused_by_a_server_with_a_document(served):
    url, prefix = served
    reply = httpx.post(
        f"{url}/completions",
        json={"model": "m", "prompt": "1, 2, 3,", "max_tokens": 2},
        timeout=600,
    )
    assert reply.status_code == 400, reply.text
    assert "/v1/chat/completions" in reply.json()["error"]["message"]
    assert _cached(_chat(url, [{"role": "user", "content": QUESTION}])) >= prefix


def test_an_extrapolating_cache_stays_so_for_a_shorter_request(engine, monkeypatch):
    # The same model, declared as trained on 512 positions: a 600-token prompt extrapolates.
    cfg = dataclasses.replace(engine.config, max_position_embeddings=512)
    monkeypatch.setattr(engine.model, "cfg", cfg)
    with serving(engine) as url:
        words = " ".join(f"w{i}" for i in range(400))
        body = {"model": "m", "prompt": words, "max_tokens": 2}
        long = httpx.post(f"{url}/completions", json=body, timeout=600).raise_for_status()
        assert long.json()["usage"]["prompt_tokens"] > 512
        assert _position_mode(url) == "extrapolate"
        short = {**body, "prompt": " ".join(words.split()[:100])}
        reply = httpx.post(f"{url}/completions", json=short, timeout=600).raise_for_status()
        assert _position_mode(url) == "extrapolate"
        assert _cached(reply.json()) > 100  # the shared start stayed cached


def _position_mode(url: str) -> str:
    return httpx.get(f"{url}/kvchat/stats").raise_for_status().json()["engine"]["position_mode"]
