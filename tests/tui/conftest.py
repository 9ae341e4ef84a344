"""What the pilot tests of the app share: small settings, one engine per module, waiting,
and a gate that holds the engine's thread between two steps.

The engine is loaded once per test module and shared by the app instances in it (each app
starts a new session on it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from textual.pilot import Pilot

from kvchat.config import Settings, load_settings
from kvchat.core.engine import Engine
from kvchat.tui.app import KvchatApp
from kvchat.tui.widgets.chat import ChatMessage, ChatPane

from ..step_gate import StepGate

# Small enough to be quick, and a max_seq_len a test file can exceed cheaply.
OVERRIDES = [
    "generation.max_new_tokens=8",
    "long_context.chunk_size=256",
    "long_context.max_seq_len=8192",
]
NOTE = "The meeting is on Tuesday at the blue house. The blue house is on Elm Street.\n"


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $KVCHAT_HOME, so the app's config, history and snapshots stay in the test."""
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(autouse=True)
def lasting_notifications(monkeypatch: pytest.MonkeyPatch) -> None:
    """Notifications stay until the test ends: Textual drops one 5 s after it is shown, which
    a slow or busy machine can spend on the step after it, before the test reads it."""
    monkeypatch.setattr(KvchatApp, "NOTIFICATION_TIMEOUT", 24 * 3600)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    """Async tests run on anyio's pytest plugin (installed with Textual), on asyncio only."""
    return "asyncio"


@pytest.fixture(scope="module")
def settings() -> Settings:
    return load_settings(overrides=OVERRIDES).settings


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Engine:
    return Engine.load(settings)


@pytest.fixture
def gate(engine: Engine) -> Iterator[StepGate]:
    """A StepGate on the module's engine, taken off (and the engine let go) after the test."""
    gate = StepGate()
    engine.on_step = gate
    try:
        yield gate
    finally:
        engine.on_step = None
        gate.close()


async def wait_for(pilot: Pilot, condition: Callable[[], bool], timeout: float = 600.0) -> None:
    """Let the app run until `condition` holds (the engine works in a thread meanwhile). The
    timeout only ends a test that would hang; no test waits for a state that can pass by."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the app")
        await pilot.pause(0.05)


async def wait_idle(pilot: Pilot, app: KvchatApp) -> None:
    await pilot.pause()
    await wait_for(pilot, lambda: not app.busy)
    await app.workers.wait_for_complete()
    await pilot.pause()


async def send(pilot: Pilot, app: KvchatApp, text: str) -> None:
    """Type `text` into the prompt and press Enter, then wait for what it started."""
    prompt = app.query_one("#prompt")
    prompt.focus()
    prompt.text = text  # type: ignore[attr-defined]
    await pilot.press("enter")
    await wait_idle(pilot, app)


def messages(app: KvchatApp, role: str) -> list[ChatMessage]:
    return [m for m in app.query_one(ChatPane).query(ChatMessage) if m.role == role]


def notifications(app: KvchatApp) -> list[str]:
    return [n.message for n in app._notifications]
