"""Text from files (paths, file and model names, errors, saved titles) is shown as itself,
never read as Textual markup: a [/] in a name neither breaks the app nor restyles the text.

The app runs on the real SmolLM2 engine under Textual's pilot.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.geometry import Region
from textual.widgets import Input
from textual.widgets._toast import Toast
from textual.widgets.markdown import MarkdownBlock

from kvchat.config import Settings
from kvchat.core.engine import Engine
from kvchat.tui.app import KvchatApp
from kvchat.tui.screens.load_file import LoadFileScreen
from kvchat.tui.widgets.status import StatusLine

from .conftest import NOTE, messages, wait_for, wait_idle


def shown(widget: object) -> str:
    """The text a widget puts on the screen."""
    return str(widget.render())  # type: ignore[attr-defined]


@pytest.mark.anyio
async def test_file_names_with_markup_brackets_show_as_typed(
    settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    missing = tmp_path / "a[/]b.txt"  # "/" parts a folder "a[" from "]b.txt": neither exists
    present = tmp_path / "c[b]d[i].txt"
    # A first line that would write the clipboard (OSC 52) and recolour the screen (8-bit
    # CSI) if the card passed it to the terminal.
    present.write_text("Memo \x1b]52;c;aGk=\x07 \x9b31m red\n" + NOTE)
    app = KvchatApp(settings, engine=engine)
    # notifications=True: the pilot shows toasts only when asked to.
    async with app.run_test(size=(140, 45), notifications=True) as pilot:
        for path in (missing, present):
            await pilot.press("ctrl+o")
            await wait_for(pilot, lambda: isinstance(app.screen, LoadFileScreen))
            app.screen.query_one("#load-path", Input).value = str(path)
            await pilot.press("enter")
            await wait_idle(pilot, app)
            if path is missing:
                toasts = [shown(toast) for toast in app.screen.query(Toast)]
                assert any(f"{missing}: no such file" in toast for toast in toasts), toasts

        assert app.is_running
        [card] = messages(app, "document")
        assert "c[b]d[i].txt — " in "".join(shown(b) for b in card.query(MarkdownBlock))
        # What the card's widgets send to the terminal: the memo's text, not its controls.
        strips = [s for w in card.query("*") for s in w.render_lines(Region(0, 0, *w.size))]
        drawn = "".join(segment.text for strip in strips for segment in strip)
        assert "Memo ]52;c;aGk= 31m red" in drawn
        assert not any(c in drawn for c in "\x1b\x07\x9b")
        assert engine.session.conversation.document_name == "c[b]d[i].txt"
        # A state that names a saved conversation titled with markup closing tags.
        app.state = "resuming [/b] of a[/]b"
        app.refresh_stats()
        assert shown(app.query_one(StatusLine)).startswith("resuming [/b] of a[/]b │ ")
