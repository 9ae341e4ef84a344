"""The app keeps handling keys while a 200K-token file is tokenized and
prefilled in its worker, and Esc stops the prefill with the session still usable.

The document is real text: Python's own standard library sources (~800K characters, ~210K
tokens), which tokenize slower per token than repeated filler, so the tokenize phase lasts
long enough to type into (about 0.4 s on two cores). The prefill is stopped after its first
chunks, so the test needs no more than a few of them.
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
from kvchat.tui.app import KvchatApp
from kvchat.tui.widgets.chat import NO_ANSWER_MARK, ChatMessage, ChatPane
from kvchat.tui.widgets.prompt import PromptInput

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


async def wait_for(condition: Callable[[], bool], timeout: float = 120.0) -> None:
    """Poll `condition` every 10 ms while the app runs. Not pilot.press or pilot.pause: they
    wait for the whole process to go idle, which the busy worker thread never lets happen,
    so each would take a second or two and the tokenize phase would be over."""
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
    settings: Settings, engine: Engine, long_file: Path
) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)):
        prompt = app.query_one("#prompt", PromptInput)
        prompt.focus()
        before = engine.session  # the worker replaces it once the file is tokenized and fits
        await send(app, prompt, f"/load {long_file}")

        # Tokenizing: the app says so (a Progress message of the tokenize phase), and keys
        # typed now are handled before the worker is done with it.
        await wait_for(lambda: app.state == "tokenize")
        typed = typed_while_tokenizing = 0
        while engine.session is before:
            await type_key(app, prompt, "t")
            typed += 1
            typed_while_tokenizing += engine.session is before
        assert typed_while_tokenizing >= 1
        conversation = engine.session.conversation
        assert len(conversation.document_ids) > 200_000
        total = len(conversation.document_prefix_ids(engine.tokenizer))

        # Prefilling: the prompt takes keys while the chunks go through the model.
        await wait_for(lambda: app.state == "prefill")
        for key in "prefill":
            await type_key(app, prompt, key)
        assert app.busy and app.state == "prefill" and len(engine.session.tokens) < total
        await wait_for(lambda: len(engine.session.tokens) > 0)
        press(app, "escape")
        await wait_idle(app)
        done = len(engine.session.tokens)
        assert 0 < done < total
        assert any("prefill cancelled after" in n.message for n in app._notifications)
        assert prompt.text == "t" * typed + "prefill"  # nothing typed was lost
        assert engine.session.conversation is conversation and app.state == "ready"

        # Still usable: a question goes on from the chunks cached so far, not from scratch.
        await send(app, prompt, "What does this code do?")
        await wait_for(lambda: len(engine.session.tokens) > done)
        press(app, "escape")
        await wait_idle(app)
        assert engine.stats().prefill_tokens == len(engine.session.tokens) - done
        # Stopped before its reply began: the question stays, marked, and gets no reply.
        shown = [(m.role, m.source) for m in app.query_one(ChatPane).query(ChatMessage)]
        assert shown[1:] == [("user", "What does this code do?" + NO_ANSWER_MARK)]
