"""The load dialog: pick the long text (a file, or a folder read as a code base) from a
directory tree or type its path."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import DirectoryTree, Input, Label


class LoadFileScreen(ModalScreen[Path | None]):
    """Dismisses with the chosen path, or None when Esc closes it."""

    # Enter on a folder opens it in the tree, so picking one takes a key of its own.
    BINDINGS = [
        Binding("escape", "cancel", "Close"),
        Binding("ctrl+f", "load_folder", "Load this folder"),
    ]

    def __init__(self, root: Path | None = None) -> None:
        super().__init__()
        self.root = root or Path.cwd()

    def compose(self) -> ComposeResult:
        with Vertical(id="load-dialog"):
            yield Label(
                "Load a document: pick a file (Enter) or a folder (Ctrl+F), or type a path, "
                "then Enter"
            )
            tree = DirectoryTree(self.root, id="load-tree")
            tree.root.set_label(home_relative(self.root))
            yield tree
            yield Input(placeholder="path/to/file.txt or path/to/folder/", id="load-path")

    def on_mount(self) -> None:
        self.query_one("#load-path", Input).focus()

    def on_directory_tree_file_selected(self, event: DirectoryTree.FileSelected) -> None:
        event.stop()
        self.dismiss(event.path)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        event.stop()
        if event.value.strip():
            self.dismiss(Path(event.value.strip()).expanduser())

    def action_load_folder(self) -> None:
        """Load the folder under the tree's cursor (the cursor's folder, on a file)."""
        node = self.query_one("#load-tree", DirectoryTree).cursor_node
        if node is not None and node.data is not None:
            path = node.data.path
            self.dismiss(path if path.is_dir() else path.parent)

    def action_cancel(self) -> None:
        self.dismiss(None)


def home_relative(path: Path) -> str:
    """`path` with the home folder shown as ~, as a shell prompt shows it."""
    path, home = path.resolve(), Path.home().resolve()
    if path.is_relative_to(home):
        return str("~" / path.relative_to(home))
    return str(path)
