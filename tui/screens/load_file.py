"""The file dialog: pick the long text from a directory tree or type its path."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Label


class LoadFileScreen(ModalScreen[Path | None]):
    """Dismisses with the chosen path, or None when Esc closes it."""

    BINDINGS = [Binding("escape", "cancel", "Close")]

    def __init__(self, root: Path | None = None) -> None:
        super().__init__()
        self.root = root or Path.cwd()

    def compose(self) -> ComposeResult:
        with Vertical(id="load-dialog"):
            yield Label("Load a document: pick a file or type its path, then Enter")
            tree = DirectoryTree(self.root, id="load-tree")
            tree.root.set_label(home_relative(self.root))
            yield tree
            yield Input(placeholder="path/to/file.txt", id="load-path")

    def on_mount(self) -> None:
        self.query_one("#load-path", Input).focus()

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        event.stop()
        self.dismiss(event.path)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.dismiss(Path(event.value.strip()).expanduser())

    def action_cancel(self) -> None:
        self.dismiss(None)


def home_relative(path: Path) -> str:
    """`path` with the home folder shown as ~, as a shell prompt shows it."""
    path, home = path.resolve(), Path.home().resolve()
    if path.is_relative_to(home):
        return str("~" / path.relative_to(home))
    return str(path)
