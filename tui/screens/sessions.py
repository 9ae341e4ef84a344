"""The sessions list: the saved conversations, the most recent first, to pick one to resume."""

from __future__ import annotations

import time

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Label, OptionList
from textual.widgets.option_list import Option

from kvchat.core.history import ConversationSummary


class SessionsScreen(ModalScreen[int | None]):
    """Dismisses with the chosen conversation's id, or None when Esc closes it."""

    DEFAULT_CSS = """
    SessionsScreen { align: center middle; }
    #sessions-dialog {
        width: 80%; height: 80%; border: thick $accent; background: $surface; padding: 1;
    }
    #sessions-list { height: 1fr; }
    """
    BINDINGS = [Binding("escape", "cancel", "Close")]

    def __init__(self, summaries: list[ConversationSummary]) -> None:
        super().__init__()
        self.summaries = summaries

    def compose(self) -> ComposeResult:
        with Vertical(id="sessions-dialog"):
            yield Label(
                "Saved conversations: pick one to resume, Esc closes"
                if self.summaries
                else "No saved conversations yet: they are saved as you ask. Esc closes."
            )
            yield OptionList(
                *(Option(describe(s), id=str(s.id)) for s in self.summaries), id="sessions-list"
            )

    def on_mount(self) -> None:
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        assert event.option.id is not None
        self.dismiss(int(event.option.id))

    def action_cancel(self) -> None:
        self.dismiss(None)


def describe(summary: ConversationSummary) -> Text:
    """Two lines: the title, then date · document · message count · model. Built as Text,
    not markup, so a title with [brackets] shows as typed."""
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(summary.updated))
    document = summary.document_name or "no document"
    count = f"{summary.message_count} message" + ("" if summary.message_count == 1 else "s")
    return Text.assemble(
        (summary.title or "untitled", "bold"),
        "\n",
        (f"{when} · {document} · {count} · {summary.model}", "dim"),
    )
