"""The sessions list: the saved conversations, the most recent first, to resume, search,
rename or delete."""

from __future__ import annotations

import time
from collections.abc import Callable

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Label, OptionList
from textual.widgets.option_list import Option

from kvchat.core.history import ConversationSummary, History, HistoryError

from .confirm import ConfirmScreen

HELP = "Enter resumes · / searches · F2 renames · Delete deletes · Esc closes"


class SessionsScreen(ModalScreen[int | None]):
    """Dismisses with the chosen conversation's id, or None when Esc closes it. `deleted`
    holds the ids deleted meanwhile."""

    DEFAULT_CSS = """
    SessionsScreen { align: center middle; }
    #sessions-dialog {
        width: 80%; height: 80%; border: thick $accent; background: $surface; padding: 1;
    }
    #sessions-search { margin: 1 0; }
    #sessions-list { height: 1fr; }
    """
    BINDINGS = [
        Binding("escape", "cancel", "Close"),
        Binding("slash", "search", "Search"),
        Binding("f2", "rename", "Rename"),
        Binding("delete", "delete", "Delete"),
    ]

    def __init__(self, history: History) -> None:
        super().__init__()
        self.history = history
        self.summaries: list[ConversationSummary] = []
        self.deleted: set[int] = set()

    def compose(self) -> ComposeResult:
        with Vertical(id="sessions-dialog"):
            yield Label(HELP, id="sessions-help")
            yield Input(placeholder="search titles and messages", id="sessions-search")
            yield OptionList(id="sessions-list")

    def on_mount(self) -> None:
        self.refill()
        self.query_one(OptionList).focus()

    def refill(self) -> None:
        """List the conversations the search matches (all when it is empty)."""
        search = self.query_one("#sessions-search", Input).value
        try:
            self.summaries = self.history.summaries(search)
        except HistoryError as e:
            self.notify(str(e), title="sessions", severity="error")
            self.summaries = []
        options = self.query_one(OptionList)
        options.clear_options()
        options.add_options(Option(describe(s), id=str(s.id)) for s in self.summaries)
        if self.summaries:
            options.highlighted = 0
        elif not search:
            self.query_one("#sessions-help", Label).update(
                "No saved conversations yet: they are saved as you ask. Esc closes."
            )

    def on_input_changed(self, event: Input.Changed) -> None:
        event.stop()
        self.refill()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.query_one(OptionList).focus()

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        assert event.option.id is not None
        self.dismiss(int(event.option.id))

    def highlighted(self) -> ConversationSummary | None:
        index = self.query_one(OptionList).highlighted
        return None if index is None or index >= len(self.summaries) else self.summaries[index]

    def action_search(self) -> None:
        self.query_one("#sessions-search", Input).focus()

    def action_rename(self) -> None:
        if (summary := self.highlighted()) is None:
            return

        def renamed(title: str | None) -> None:
            if title is not None:
                self._change(lambda: self.history.rename(summary.id, title))

        self.app.push_screen(RenameScreen(summary.title), renamed)

    def action_delete(self) -> None:
        if (summary := self.highlighted()) is None:
            return

        def answered(delete: bool | None) -> None:
            if delete:
                self._change(lambda: self.history.delete(summary.id))
                self.deleted.add(summary.id)

        count = f"{summary.message_count} message" + ("" if summary.message_count == 1 else "s")
        self.app.push_screen(
            ConfirmScreen(
                f"Delete “{summary.title or 'untitled'}” and its {count}? This cannot be undone.",
                "Delete",
                "Keep",
            ),
            answered,
        )

    def _change(self, change: Callable[[], object]) -> None:
        try:
            change()
        except HistoryError as e:
            self.notify(str(e), title="sessions", severity="error")
        self.refill()

    def action_cancel(self) -> None:
        self.dismiss(None)


class RenameScreen(ModalScreen[str | None]):
    """The new title for a conversation; None when Esc cancels."""

    DEFAULT_CSS = """
    RenameScreen { align: center middle; }
    #rename-dialog {
        width: 72; height: auto; border: thick $accent; background: $surface; padding: 1 2;
    }
    """
    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, title: str) -> None:
        super().__init__()
        self.title_now = title

    def compose(self) -> ComposeResult:
        with Vertical(id="rename-dialog"):
            yield Label("New title (Enter keeps it, Esc cancels):")
            yield Input(self.title_now, id="rename-title")

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        self.dismiss(event.value)

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
