"""The installed app, started headless by Textual's pilot: it loads a bundled model, reads the
sample document that ships inside the package, and answers a question in the chat.

Run by tests/package/check.sh with the Python of a venv that holds only the installed wheel,
from outside the checkout: it prints where kvchat was imported from and the reply.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from importlib import resources

from textual.pilot import Pilot

import kvchat
from kvchat.config import load_settings
from kvchat.tui.app import KvchatApp
from kvchat.tui.widgets.chat import ChatMessage

QUESTION = "When was the lighthouse built?"


async def until(pilot: Pilot, condition: Callable[[], bool], timeout: float = 900.0) -> None:
    """Let the app run until `condition` holds; the timeout only stops a hung run."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit("app smoke test: the app did not get there")
        await pilot.pause(0.1)


async def smoke(model: str) -> str:
    sample = resources.files("kvchat.core").joinpath("data/sample.txt")
    settings = load_settings(overrides=["generation.max_new_tokens=16"]).settings
    app = KvchatApp(settings, model_spec=model, paths=[str(sample)])
    async with app.run_test(size=(140, 45)) as pilot:
        await until(pilot, lambda: app.document is not None and not app.busy)
        app.query_one("#prompt").text = QUESTION  # type: ignore[attr-defined]
        app.query_one("#prompt").focus()
        await pilot.press("enter")

        def replies() -> list[str]:
            return [m.source for m in app.query(ChatMessage) if m.role == "assistant"]

        await until(pilot, lambda: bool(replies()) and not app.busy and app.reply is None)
        shown = replies()
    if len(shown) != 1 or not shown[0].strip():
        raise SystemExit(f"app smoke test: no reply in the chat ({shown!r})")
    return shown[0]


if __name__ == "__main__":
    print(f"kvchat imported from {kvchat.__file__}")
    print(f"app reply: {asyncio.run(smoke(sys.argv[1]))!r}")
