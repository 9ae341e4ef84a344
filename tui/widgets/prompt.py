"""The multi-line prompt: Enter sends, Shift+Enter or Ctrl+J inserts a newline, Up on the first
line and Down on the last recall the prompts sent before."""

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
        self.sent: list[str] = []  # prompts sent, oldest first
        self._recalled: int | None = None  # index into `sent` while recalling
        self._draft = ""  # what was typed before recalling began

    def _recall(self, step: int) -> None:
        """Show the prompt `step` places back (-1) or forward (+1) in `sent`; forward past
        the newest shows the draft again."""
        index = len(self.sent) if self._recalled is None else self._recalled
        index = max(0, min(index + step, len(self.sent)))
        if index == len(self.sent):
            text, self._recalled = self._draft, None
        else:
            if self._recalled is None:
                self._draft = self.text
            text, self._recalled = self.sent[index], index
        self.text = text
        self.move_cursor(self.document.end)

    async def _on_key(self, event: events.Key) -> None:
        if event.key == "enter":
            event.stop()
            event.prevent_default()
            text = self.text.strip()
            if text:
                if not self.sent or self.sent[-1] != text:
                    self.sent.append(text)
                self._recalled, self._draft = None, ""
                self.post_message(self.Submitted(self, text))
                self.clear()
            return
        row = self.cursor_location[0]
        up = event.key == "up" and row == 0 and bool(self.sent) and self._recalled != 0
        down = event.key == "down" and row == self.document.line_count - 1
        if up or (down and self._recalled is not None):
            event.stop()
            event.prevent_default()
            self._recall(-1 if up else 1)
            return
        if event.key in NEWLINE_KEYS:
            event.stop()
            event.prevent_default()
            self.insert("\n")
            return
        await super()._on_key(event)
