"""The multi-line prompt: Enter sends, Shift+Enter or Ctrl+J inserts a newline."""

from __future__ import annotations

from textual import events
from textual.message import Message
from textual.widgets import TextArea

# Terminals that report Shift+Enter send it as its own key; many send Ctrl+J for it too.
NEWLINE_KEYS = ("shift+enter", "ctrl+j")


class PromptInput(TextArea):
    class Submitted(Message):
        def __init__(self, prompt: PromptInput, text: str) -> None:
            super().__init__()
            self.prompt, self.text = prompt, text

    def __init__(self, **kwargs: object) -> None:
        super().__init__(soft_wrap=True, show_line_numbers=False, **kwargs)  # type: ignore[arg-type]

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text.strip()
            if text:
                self.post_message(self.Submitted(self, text))
                self.clear()
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
