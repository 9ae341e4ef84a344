"""The app on any document: a folder given at start or picked in the load dialog, standard
input, and saved conversations over them, with the real SmolLM2 engine."""

from __future__ import annotations

import io
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from textual.widgets import DirectoryTree

from kvchat.config import Settings
from kvchat.core.engine import Engine
from kvchat.core.history import History, SavedDocument, SavedMessage
from kvchat.core.sources import read_sources
from kvchat.tui.app import KvchatApp
from kvchat.tui.screens.confirm import ConfirmScreen
from kvchat.tui.screens.load_file import LoadFileScreen
from kvchat.tui.widgets.chat import human_bytes

from .conftest import NOTE, messages, notifications, wait_for, wait_idle

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("home")]

SAMPLE_REPO = Path(__file__).parents[1] / "fixtures" / "sample-repo"


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """The sample repository with a build output and a binary file besides its ignored log."""
    root = shutil.copytree(SAMPLE_REPO, tmp_path / "projects" / "sample-repo")
    (root / "build").mkdir()
    (root / "build" / "app.js").write_text("generated();\n")
    (root / "logo.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    return root


def saved_conversation(document: SavedDocument) -> int:
    """A conversation over `document`, saved as the app saves one: a question and its reply."""
    history = History()
    conversation_id = history.create("SmolLM2-135M-Instruct", None, document)
    history.add_message(conversation_id, SavedMessage("user", "Who keeps the light?"))
    history.add_message(conversation_id, SavedMessage("assistant", "Ada Fenwick."))
    return conversation_id


async def test_the_app_starts_on_a_folder_and_its_card_says_what_it_read_and_skipped(
    settings: Settings, engine: Engine, repo: Path
) -> None:
    app = KvchatApp(settings, engine=engine, paths=[str(repo)])
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_idle(pilot, app)
        [card] = messages(app, "document")
        tokens = len(engine.session.conversation.document_ids)
        size = human_bytes(read_sources([repo]).size_bytes)
        assert card.source.startswith(
            f"**sample-repo/** — 4 files · {tokens:,} tokens · {size} · "
            "skipped 3 (.gitignore 2, binary 1)\n\n"
            "Skipped: build/ (.gitignore), debug.log (.gitignore), logo.png (binary)\n\n"
        )
        assert "==> .gitignore <==" in card.source  # the preview: the first file's header
        assert app.document is not None and app.document.path == str(repo.resolve())


async def test_a_folder_is_picked_in_the_load_dialog(
    settings: Settings, engine: Engine, repo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(repo.parent)  # the dialog's tree shows the current folder
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await pilot.press("ctrl+o")
        await wait_for(pilot, lambda: isinstance(app.screen, LoadFileScreen))
        tree = app.screen.query_one(DirectoryTree)
        tree.focus()
        await wait_for(pilot, lambda: len(tree.root.children) == 1)
        await pilot.press("down")  # from the tree's root to its one folder, sample-repo
        await pilot.press("ctrl+f")
        await wait_idle(pilot, app)
        [card] = messages(app, "document")
        assert card.source.startswith("**sample-repo/** — 4 files")
        assert engine.session.conversation.document_name == "sample-repo/"


async def test_standard_input_is_loaded_once_and_a_conversation_over_it_resumes_without_it(
    settings: Settings, engine: Engine
) -> None:
    app = KvchatApp(settings, engine=engine, paths=["-"], stdin=io.BytesIO(NOTE.encode()))
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_idle(pilot, app)
        [card] = messages(app, "document")
        assert card.source.startswith("**stdin** — ") and "The meeting is on Tuesday" in card.source
        assert app.document is not None and app.document.path == "-"

        app.load_document("-")  # standard input is read once: the first load took it
        await wait_idle(pilot, app)
        assert any("no standard input to read here" in n for n in notifications(app))

        app.resume(saved_conversation(SavedDocument("-", "stdin", len(NOTE), 20, "0" * 64)))
        await wait_idle(pilot, app)
        [problem] = messages(app, "note")
        assert problem.source == (
            "The document **stdin** is not loaded: it came from standard input, which cannot "
            "be read again. The chat goes on without it."
        )
        assert not engine.session.conversation.document_ids


async def test_a_conversation_over_a_folder_resumes_with_the_folder(
    settings: Settings, engine: Engine, repo: Path
) -> None:
    doc = read_sources([repo])
    saved = SavedDocument(str(repo.resolve()), doc.name, doc.size_bytes, 300, doc.sha256)
    conversation_id = saved_conversation(saved)
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        app.resume(conversation_id)
        await wait_idle(pilot, app)
        [card] = messages(app, "document")
        assert card.source.startswith("**sample-repo/** — 4 files")
        assert engine.session.conversation.document_name == "sample-repo/"
        assert engine.session.conversation.messages[-1]["content"] == "Ada Fenwick."


async def test_a_document_past_the_settings_is_offered_the_fit_and_loads_with_it(
    settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    note, long = tmp_path / "note.txt", tmp_path / "long.txt"
    note.write_text(NOTE)
    long.write_bytes(b"The grass is green. The sky is blue. " * 120)  # ~1.3K tokens
    small = replace(settings, long_context=replace(settings.long_context, max_seq_len=1024))
    engine = engine.with_settings(small)  # this test's own: the fit changes its settings
    config = tmp_path / "config.yaml"
    app = KvchatApp(small, engine=engine, config_path=config, paths=[str(note)])
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_idle(pilot, app)
        session, tokens = engine.session, list(engine.session.tokens)
        for answer in ("escape", "enter"):
            app.query_one("#prompt").focus()
            await pilot.press(*f"/load {long}", "enter")
            await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
            question = app.screen.question  # type: ignore[attr-defined]
            await pilot.press(answer)
            await wait_idle(pilot, app)
            if answer == "escape":  # declined: nothing changes
                assert engine.session is session and session.tokens == tokens
                assert len(messages(app, "document")) == 1
                assert engine.settings.long_context.max_seq_len == 1024
        assert engine.settings.long_context.max_seq_len == 4096
        assert "max_seq_len 4,096" in question and "long.txt: " in question
        [card] = messages(app, "document")
        assert len(engine.session.tokens) > 1024
        assert app.settings.long_context.max_seq_len == 4096
        assert not config.exists()  # for this run: the settings file is not written
