"""The actions table (tui/commands.py): every slash command is in the command palette and
runs its action from both, the bound actions are the `keys` settings, and /help lists them
all."""

from __future__ import annotations

import pytest
from textual.command import Command, CommandList

from kvchat.config import KeySettings, Settings, schema_fields
from kvchat.core.engine import Engine
from kvchat.tui.app import KvchatApp
from kvchat.tui.commands import ACTIONS, COMMANDS, help_text
from kvchat.tui.widgets.prompt import PromptInput

from .conftest import wait_for

pytestmark = pytest.mark.anyio


def test_the_bound_actions_are_the_keys_settings() -> None:
    bound = [action.name for action in ACTIONS if action.bound]
    assert bound == [spec.name for spec in schema_fields(KeySettings)]
    assert [(b.id, b.description) for b in KvchatApp.BINDINGS] == [
        (action.name, action.label) for action in ACTIONS if action.bound
    ]


def test_help_lists_every_command_and_key() -> None:
    keys = KeySettings()
    text = help_text(keys)
    for action in COMMANDS.values():
        assert f"| `{action.usage}` | {action.help}" in text
    for spec in schema_fields(KeySettings):
        assert f"| `{getattr(keys, spec.name)}` | {spec.help} |" in text


async def test_every_slash_command_is_in_the_palette_and_dispatches(
    settings: Settings, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        ran: list[tuple[str, tuple[str, ...]]] = []
        for action in ACTIONS:

            def record(*args: str, name: str = action.name) -> None:
                ran.append((name, args))

            monkeypatch.setattr(app, f"action_{action.name}", record)
        palette = {command.title: command for command in app.get_system_commands(app.screen)}
        prompt = app.query_one("#prompt", PromptInput)
        assert set(COMMANDS) == {
            *("load", "clear", "settings", "help", "sessions", "regenerate", "copy"),
            *("export", "system", "model"),
        }
        for action in COMMANDS.values():
            ran.clear()
            prompt.text = ""
            palette[action.label].callback()
            await pilot.pause()
            if action.palette_types:
                # The palette puts the command into the prompt, for its argument to be typed.
                assert ran == [] and prompt.text == f"/{action.command} " and prompt.has_focus
            else:
                assert ran == [(action.name, ())]

            for arg in ("", "a b"):
                ran.clear()
                prompt.focus()
                prompt.text = f"/{action.command} {arg}"
                await pilot.press("enter")
                await pilot.pause()
                # An action that takes no argument is run without the one typed.
                assert ran == [(action.name, (arg,) if action.arg else ())], prompt.text


async def test_the_palette_types_the_system_command(settings: Settings, engine: Engine) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await pilot.press("ctrl+p")
        await pilot.pause()
        await pilot.press(*"system")
        # The palette searches in a worker: Enter goes in once the command is highlighted.
        await wait_for(pilot, lambda: highlighted_hit(app) == "System prompt")
        await pilot.press("enter")
        await pilot.pause()
        prompt = app.query_one("#prompt", PromptInput)
        assert prompt.text == "/system " and prompt.has_focus


def highlighted_hit(app: KvchatApp) -> str | None:
    """The title of the command palette's highlighted hit (None: no hit yet)."""
    hits = app.screen.query_one(CommandList)
    if hits.highlighted is None:
        return None
    hit = hits.get_option_at_index(hits.highlighted)
    assert isinstance(hit, Command)
    return hit.hit.text
