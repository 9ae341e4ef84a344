from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def no_model_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The settings as a user's shell gives them: the suite's $KVCHAT_MODEL unset."""
    monkeypatch.delenv("KVCHAT_MODEL", raising=False)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh $KVCHAT_HOME that does not exist yet (as on a first run)."""
    path = tmp_path / "kvchat-home"
    monkeypatch.setenv("KVCHAT_HOME", str(path))
    return path


@pytest.fixture
def write_config(home: Path) -> Callable[[str], Path]:
    """Write a (dedented) user config file into $KVCHAT_HOME and return its path."""

    def write(text: str) -> Path:
        path = home / "config.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    return write
