"""The app keeps handling keys while a 200K-token file is tokenized and
prefilled in its worker, and Esc stops the prefill with the session still usable.

The document is real text: Python's own standard library sources (~800K characters, ~210K
tokens). The engine's thread is held after its first tokenized batch and after its first
prefilled chunk while the test types, so each phase lasts as long as the test needs on any
machine, and the prefill is stopped after one chunk.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from textual import events

from kvchat.config import Settings, load_settings
from kvchat.core.engine import Engine
from kvchat.core.steps import EngineStep
from kvchat.tui.app import KvchatApp
from kvchat.tui.widgets.chat import NO_ANSWER_MARK, ChatMessage, ChatPane
from kvchat.tui.widgets.prompt import PromptInput

from .conftest import StepGate

OVERRIDES = [
    "generation.max_new_tokens=8",
    "long_context.chunk_size=256",
    "long_context.max_seq_len=262144",
    "long_context.attention=sparse",
]
DOCUMENT_CHARS = 800_000
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def settings() -> Settings:
    """Overrides the shared fixture (tests/tui/conftest.py): room for a 200K-token file."""
    return load_settings(overrides=OVERRIDES).settings


@pytest.fixture
def long_file(tmp_path: Path) -> Path:
    parts, size = [], 0
    for source in sorted(Path(os.__file__).parent.glob("*.py")):
        parts.append(source.read_text(encoding="utf-8", errors="replace"))
        size += len(parts[-1])
        if size >= DOCUMENT_CHARS:
            break
    assert size >= DOCUMENT_CHARS, "the standard library sources are missing"
    path = tmp_path / "stdlib.txt"
    path.write_text("".join(parts), encoding="utf-8")
    return path


async def wait_for(condition: Callable[[], bool], timeout: float = 600.0) -> None:
    """Poll `condition` every 10 ms while the app runs. Not pilot.press or pilot.pause: they
    wait for the whole process to go idle, which a busy worker thread never lets happen, so
    each would take a second or two."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await asyncio.sleep(0.01)


def press(app: KvchatApp, key: str) -> None:
    """Deliver a key as the terminal driver does: as a Key event posted to the app."""
    app.post_message(events.Key(key, key if len(key) == 1 else None))


async def type_key(app: KvchatApp, prompt: PromptInput, key: str) -> None:
    before = prompt.text
    press(app, key)
    await wait_for(lambda: prompt.text == before + key)


async def wait_idle(app: KvchatApp) -> None:
    await wait_for(lambda: not app.busy)
    await app.workers.wait_for_complete()


async def send(app: KvchatApp, prompt: PromptInput, text: str) -> None:
    prompt.text = text
    prompt.move_cursor(prompt.document.end)
    press(app, "enter")
    await wait_for(lambda: app.busy)


async def test_keys_work_while_a_200k_token_file_loads_and_esc_stops_the_prefill(
    settings: Settings, engine: Engine, gate: StepGate, long_file: Path
) -> None:
    chunk = settings.long_context.chunk_size
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)), gate:
        prompt = app.query_one("#prompt", PromptInput)
        prompt.focus()
        before = engine.session  # the worker replaces it once the file is tokenized and fits
        gate.arm(EngineStep.TOKENIZED)
        await send(app, prompt, f"/load {long_file}")

        # Tokenizing: the app says so (a Progress message of the tokenize phase), and keys
        # typed now are handled while the worker is in the middle of it.
        await wait_for(gate.held.is_set)
        await wait_for(lambda: app.state == "tokenize")
        for key in "tok":
            await type_key(app, prompt, key)
        assert engine.session is before and app.state == "tokenize"
        gate.arm(EngineStep.PREFILLED)
        gate.release()

        # Prefilling: the prompt takes keys while the chunks go through the model.
        await wait_for(gate.held.is_set)
        conversation = engine.session.conversation
        assert len(conversation.document_ids) > 200_000
        total = len(conversation.document_prefix_ids(engine.tokenizer))
        await wait_for(lambda: app.state == "prefill")
        for key in "prefill":
            await type_key(app, prompt, key)
        assert app.busy and app.state == "prefill" and len(engine.session.tokens) == chunk
        press(app, "escape")
        gate.release()
        await wait_idle(app)
        assert len(engine.session.tokens) == chunk < total  # the chunk done stays cached
        assert any(f"prefill cancelled after {chunk} of" in n.message for n in app._notifications)
        assert prompt.text == "tokprefill"  # nothing typed was lost
        assert engine.session.conversation is conversation and app.state == "ready"

        # Still usable: a question goes on from the chunk cached so far, not from scratch.
        gate.arm(EngineStep.PREFILLED)
        await send(app, prompt, "What does this code do?")
        await wait_for(gate.held.is_set)
        press(app, "escape")
        gate.release()
        await wait_idle(app)
        assert len(engine.session.tokens) == 2 * chunk
        assert engine.stats().prefill_tokens == chunk
        # Stopped before its reply began: the question stays, marked, and gets no reply.
        shown = [(m.role, m.source) for m in app.query_one(ChatPane).query(ChatMessage)]
        assert shown[1:] == [("user", "What does this code do?" + NO_ANSWER_MARK)]
