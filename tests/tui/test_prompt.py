"""The prompt widget in a Textual app of its own: sending, new lines and recall."""

from __future__ import annotations

import pytest
from textual.app import App, ComposeResult

from kvchat.tui.widgets.prompt import PromptInput

pytestmark = pytest.mark.anyio


class PromptApp(App):
    def __init__(self) -> None:
        super().__init__()
        self.received: list[str] = []

    def compose(self) -> ComposeResult:
        yield PromptInput(id="prompt")

    def on_mount(self) -> None:
        self.query_one(PromptInput).focus()

    def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        self.received.append(message.text)


async def test_up_and_down_recall_the_prompts_sent_before() -> None:
    app = PromptApp()
    async with app.run_test() as pilot:
        prompt = app.query_one(PromptInput)
        for text in ("first", "two\nlines", "two\nlines", "third"):
            prompt.text = text
            await pilot.press("enter")
        assert app.received == ["first", "two\nlines", "two\nlines", "third"]
        await pilot.press("d", "r")  # a draft
        await pilot.press("up")
        assert prompt.text == "third"
        await pilot.press("up")
        assert prompt.text == "two\nlines"  # sent twice in a row: recalled once
        await pilot.press("up")  # the cursor is on the last line: up moves to the first
        assert prompt.text == "two\nlines"
        await pilot.press("up", "up")
        assert prompt.text == "first"
        await pilot.press("up")  # nothing older
        assert prompt.text == "first"
        await pilot.press("down")
        assert prompt.text == "two\nlines"  # with the cursor on its last line
        await pilot.press("down")
        assert prompt.text == "third"
        await pilot.press("down")
        assert prompt.text == "dr"  # the draft comes back
        await pilot.press("enter")
        assert app.received[-1] == "dr"
        await pilot.press("up")
        assert prompt.text == "dr"


async def test_up_without_history_moves_the_cursor_only() -> None:
    app = PromptApp()
    async with app.run_test() as pilot:
        prompt = app.query_one(PromptInput)
        await pilot.press("a", "ctrl+j", "b", "up")
        assert prompt.text == "a\nb" and prompt.cursor_location[0] == 0
