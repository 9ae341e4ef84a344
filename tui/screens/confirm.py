"""A yes/no question over the app: rebuild the cache now, load a document with the settings
that fit it. Enter answers with the focused button (the yes), Esc says no."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Label


class ConfirmScreen(ModalScreen[bool]):
    """Shows `question` with a `yes` and a `no` button; dismisses with the answer."""

    BINDINGS = [Binding("escape", "no", "No")]

    def __init__(self, question: str, yes: str, no: str) -> None:
        super().__init__()
        self.question, self.yes, self.no = question, yes, no

    def compose(self) -> ComposeResult:
        with Vertical(id="confirm-dialog"):
            yield Label(self.question)
            with Horizontal(id="confirm-buttons"):
                yield Button(self.yes, variant="primary", id="confirm-yes")
                yield Button(self.no, id="confirm-no")

    def on_mount(self) -> None:
        self.query_one("#confirm-yes", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        event.stop()
        self.dismiss(event.button.id == "confirm-yes")

    def action_no(self) -> None:
        self.dismiss(False)


def rebuild_question(keys: tuple[str, ...], n_tokens: int) -> ConfirmScreen:
    """Whether to prefill the cached context again now, after `keys` changed its shape."""
    return ConfirmScreen(
        f"{', '.join(keys)} changed: the KV cache must be built again, by prefilling the "
        f"{n_tokens:,} cached tokens again.\nRebuild it now? Otherwise your next question does.",
        "Rebuild now",
        "Later",
    )
