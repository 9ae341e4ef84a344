"""The settings screen and the key bindings from the config, with the real SmolLM2 engine.

Each test gets an engine of its own over one engine model (saving settings changes the
engine) and a settings file of its own, created from the packaged default like a first run.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.theme import BUILTIN_THEMES
from textual.widgets import Input, Select, Switch

from kvchat.config import Settings, Theme, load_settings, replace_key
from kvchat.config.yamltext import parse
from kvchat.core.engine import Engine
from kvchat.tui.app import KvchatApp
from kvchat.tui.screens.confirm import ConfirmScreen
from kvchat.tui.screens.load_file import LoadFileScreen
from kvchat.tui.screens.settings import SettingsScreen
from kvchat.tui.widgets.chat import ChatMessage, ChatPane

from .conftest import NOTE, OVERRIDES, notifications, wait_for, wait_idle

# This run's overrides: the settings screen must not write them into the file.
pytestmark = pytest.mark.anyio


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "home" / "config.yaml"
    load_settings(path)  # creates it from the packaged default
    return path


def make_app(engine: Engine, config: Path, **keys: str) -> KvchatApp:
    settings = load_settings(config, OVERRIDES).settings
    for action, key in keys.items():
        settings = replace_key(settings, f"keys.{action}", key)
    return KvchatApp(settings, engine=engine.with_settings(settings), config_path=config)


async def open_settings(pilot: Pilot, app: KvchatApp) -> SettingsScreen:
    await pilot.press("f3")
    await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
    assert isinstance(app.screen, SettingsScreen)
    return app.screen


async def set_value(pilot: Pilot, screen: SettingsScreen, key: str, value: object) -> None:
    widget = screen.query_one("#" + key.replace(".", "--"))
    assert isinstance(widget, Input | Select | Switch)
    widget.value = value  # type: ignore[assignment]
    await pilot.pause()


def marked(screen: SettingsScreen) -> set[str]:
    return {row.id.removeprefix("row-") for row in screen.query(".setting.invalid") if row.id}


def message(screen: SettingsScreen) -> str:
    return str(screen.query_one("#settings-message").render())


def notes(app: KvchatApp) -> list[str]:
    return [m.source for m in app.query_one(ChatPane).query(ChatMessage) if m.role == "note"]


async def test_invalid_values_are_marked_and_refused_valid_ones_saved_and_applied(
    engine: Engine, config: Path
) -> None:
    app = make_app(engine, config)
    before = config.read_text()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_settings(pilot, app)
        # A value valid alone that breaks a rule with another key marks that rule's key.
        await set_value(pilot, screen, "long_context.block_size", "96")
        assert marked(screen) == {"long_context--local_windows_len"}
        assert "local_windows_len = 2048: expected a multiple of" in message(screen)
        await set_value(pilot, screen, "long_context.block_size", "128")
        await set_value(pilot, screen, "long_context.second_select_num", "many")
        assert 'second_select_num = "many": expected an integer' in message(screen)
        await set_value(pilot, screen, "long_context.second_select_num", "-3")
        field = screen.query_one("#long_context--second_select_num", Input)
        assert field.has_class("-invalid")
        assert marked(screen) == {"long_context--second_select_num"}
        await pilot.press("ctrl+s")
        assert app.screen is screen
        assert "Not saved" in message(screen)
        assert "second_select_num = -3: expected an integer from 0 to" in message(screen)
        assert config.read_text() == before

        await set_value(pilot, screen, "long_context.second_select_num", "8")
        await set_value(pilot, screen, "generation.max_new_tokens", "5")
        await set_value(pilot, screen, "model.dtype", "float32")
        await set_value(pilot, screen, "ui.theme", "light")
        assert not marked(screen) and not message(screen)
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))

        saved = parse(config.read_text())
        assert saved["long_context"]["second_select_num"] == 8
        assert saved["generation"]["max_new_tokens"] == 5
        assert saved["model"]["dtype"] == "float32"
        assert "chunk_size" not in saved["long_context"]  # the --set override stays out
        assert config.read_text().startswith("# kvchat settings.")  # comments kept
        engine = app.engine
        assert engine is not None
        assert engine.settings.long_context.second_select_num == 8
        assert engine.settings.generation.max_new_tokens == 5
        assert engine.settings.long_context.chunk_size == 256
        assert app.settings.model.dtype == "float32" and app.theme == "textual-light"
        [note] = [n for n in notifications(app) if "Saved to" in n]
        assert "Needs the model loaded again (restart kvchat or use /model): model.dtype" in note


async def test_a_cache_shaping_change_offers_a_rebuild_that_works(
    engine: Engine, config: Path, tmp_path: Path
) -> None:
    doc = tmp_path / "note.txt"
    doc.write_text(NOTE * 3)
    app = make_app(engine, config)
    async with app.run_test(size=(120, 40)) as pilot:
        app.load_document(doc)
        await wait_idle(pilot, app)
        engine = app.engine
        assert engine is not None
        tokens = list(engine.session.tokens)
        assert engine.stats().cache.kv_dtype == "FP16"

        screen = await open_settings(pilot, app)
        await set_value(pilot, screen, "long_context.kv_type", "INT8")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert any("Needs a new cache: long_context.kv_type" in n for n in notifications(app))
        assert engine.session.stale and engine.session.tokens == tokens
        await pilot.press("enter")  # "Rebuild now" has the focus
        await wait_idle(pilot, app)

        assert not engine.session.stale and engine.session.tokens == tokens
        assert engine.stats().cache.kv_dtype == "INT8"
        assert f"cache rebuilt: {len(tokens)} tokens prefilled" in notifications(app)
        assert parse(config.read_text())["long_context"]["kv_type"] == "INT8"


async def test_remapped_keys_work_and_the_old_keys_do_not(engine: Engine, config: Path) -> None:
    app = make_app(engine, config, load_file="f5", settings="f8,f9")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.press("ctrl+o")
        await pilot.pause()
        assert not isinstance(app.screen, LoadFileScreen)
        await pilot.press("f5")
        await wait_for(pilot, lambda: isinstance(app.screen, LoadFileScreen))
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, LoadFileScreen))

        shown = {b.binding.action: key for key, b in app.screen.active_bindings.items()}
        assert (shown["load_file"], shown["settings"]) == ("f5", "f9")
        await pilot.press("f1")
        await pilot.pause()
        [help_note] = notes(app)
        assert "| `f5` | Open the file dialog" in help_note
        assert "| `f8,f9` | Open the settings screen." in help_note

        await pilot.press("f3")
        await pilot.pause()
        assert not isinstance(app.screen, SettingsScreen)
        await pilot.press("f9")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        assert isinstance(app.screen, SettingsScreen)
        # Remapped on the screen, saved, and in effect at once.
        await set_value(pilot, app.screen, "keys.toggle_panels", "f10")
        await pilot.press("ctrl+s")
        await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert parse(config.read_text())["keys"]["toggle_panels"] == "f10"
        side = app.query_one("#side")
        await pilot.press("f2")
        assert side.display
        await pilot.press("f10")
        assert not side.display


async def test_a_key_clash_is_refused(engine: Engine, config: Path) -> None:
    app = make_app(engine, config)
    before = config.read_text()
    async with app.run_test(size=(120, 40)) as pilot:
        screen = await open_settings(pilot, app)
        await set_value(pilot, screen, "keys.clear_chat", "f2")
        assert marked(screen) == {"keys--clear_chat"}
        assert "(f2 is keys.toggle_panels)" in message(screen)
        await pilot.press("ctrl+s")
        assert app.screen is screen and config.read_text() == before
        # A key the focused prompt uses itself would never reach the app.
        await set_value(pilot, screen, "keys.clear_chat", "f6")
        assert marked(screen) == {"keys--clear_chat"}
        assert "a key the prompt does not use (f6: Select line)" in message(screen)


async def test_a_config_key_the_prompt_uses_is_reported_at_start(
    engine: Engine, config: Path
) -> None:
    app = make_app(engine, config, clear_chat="ctrl+a")
    async with app.run_test(size=(120, 40)) as pilot:
        await pilot.pause()
        assert (
            f'{config}: keys.clear_chat = "ctrl+a": expected a key the prompt does not use '
            "(ctrl+a: Cursor line start)" in notifications(app)
        )


async def test_slash_settings_opens_the_screen_and_esc_writes_nothing(
    engine: Engine, config: Path
) -> None:
    app = make_app(engine, config)
    before = config.read_text()
    async with app.run_test(size=(120, 40)) as pilot:
        app.query_one("#prompt").focus()
        await pilot.press(*"/settings", "enter")
        await wait_for(pilot, lambda: isinstance(app.screen, SettingsScreen))
        assert isinstance(app.screen, SettingsScreen)
        await set_value(pilot, app.screen, "generation.temperature", "0.5")
        await pilot.press("escape")
        await wait_for(pilot, lambda: not isinstance(app.screen, SettingsScreen))
        assert config.read_text() == before
        assert app.settings.generation.temperature == 0.0


def test_every_key_setting_has_a_binding() -> None:
    ids = {binding.id for binding in KvchatApp.BINDINGS}  # type: ignore[union-attr]
    assert ids == set(vars(Settings().keys))


def test_the_theme_setting_lists_every_theme_textual_ships() -> None:
    assert {theme.textual_name for theme in Theme} == set(BUILTIN_THEMES)


async def test_a_theme_chosen_in_the_palette_is_saved(
    settings: Settings, engine: Engine, config: Path
) -> None:
    app = make_app(engine, config)
    async with app.run_test(size=(120, 40)) as pilot:
        app.theme = "nord"  # what the command palette's "Change theme" does
        await pilot.pause()
        assert app.settings.ui.theme == Theme.NORD
        assert parse(config.read_text())["ui"]["theme"] == "nord"
        app.theme = "textual-light"
        await pilot.pause()
        assert parse(config.read_text())["ui"]["theme"] == "light"
