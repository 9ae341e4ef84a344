"""Copying out of the app: a clipboard tool's answer is reported as it is, and without one
the notice says the text only went to the terminal (OSC 52), which may ignore it."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from textual.app import App

from kvchat.tui.clipboard import copy_text


@pytest.fixture
def bare_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """No display and a PATH of one empty folder: no clipboard tool is reachable."""
    for name in ("DISPLAY", "WAYLAND_DISPLAY"):
        monkeypatch.delenv(name, raising=False)
    tools = tmp_path / "bin"
    tools.mkdir()
    monkeypatch.setenv("PATH", str(tools))
    return tools


def tool(folder: Path, name: str, script: str) -> None:
    path = folder / name
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_without_a_clipboard_tool_the_copy_is_not_called_done(bare_env: Path) -> None:
    app = App()
    result = copy_text(app, "Ada Fenwick keeps the light.", "the reply")
    assert not result.confirmed
    assert "sent the reply (28 characters) to the terminal's clipboard (OSC 52)" in result.notice
    assert "ignore it" in result.notice and "Copied" not in result.notice
    assert app.clipboard == "Ada Fenwick keeps the light."  # OSC 52 still goes out


def test_a_tool_that_takes_the_text_confirms_the_copy(
    bare_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WAYLAND_DISPLAY", "wayland-0")
    received = tmp_path / "clipboard.txt"
    tool(bare_env, "wl-copy", f'/bin/cat > "{received}"')
    result = copy_text(App(), "Ada Fenwick keeps the light.", "the reply")
    assert result.confirmed and result.notice == "Copied the reply (28 characters)."
    assert received.read_text() == "Ada Fenwick keeps the light."


def test_a_failing_tool_is_named_with_its_reason(
    bare_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DISPLAY", ":9")
    tool(bare_env, "xclip", 'echo "Error: Can\'t open display: :9" >&2; exit 1')
    result = copy_text(App(), "text", "the question")
    assert not result.confirmed
    assert result.notice.startswith("xclip failed (Error: Can't open display: :9); sent the")
