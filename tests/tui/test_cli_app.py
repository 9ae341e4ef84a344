"""`kvchat` without a subcommand starts the app; the shared options work on both sides."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.tui import app as app_module
from kvchat.tui.cli import EXIT_USAGE, build_parser, main


def test_options_before_the_subcommand_are_kept() -> None:
    parser = build_parser()
    args = parser.parse_args(["--model", "X", "--set", "a.b=1", "ask", "--prompt-file", "f", "q"])
    assert (args.model, args.set, args.command) == ("X", ["a.b=1"], "ask")
    args = parser.parse_args(["ask", "--model", "Y", "--prompt-file", "f", "q"])
    assert args.model == "Y" and args.config is None
    args = parser.parse_args(["--model", "M", "--prompt-file", "doc.txt"])
    assert (args.command, args.model, args.prompt_file) == (None, "M", "doc.txt")


def test_no_subcommand_runs_the_app(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started: list[app_module.KvchatApp] = []
    monkeypatch.setattr(app_module.KvchatApp, "run", lambda self: started.append(self))
    doc = tmp_path / "doc.txt"
    doc.write_text("Some text.\n")
    assert main(["--prompt-file", str(doc), "--set", "generation.max_new_tokens=7"]) == 0
    [app] = started
    assert app.prompt_file == str(doc) and app.settings.generation.max_new_tokens == 7


def test_a_bad_prompt_file_is_refused_before_the_app_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(app_module.KvchatApp, "run", lambda self: pytest.fail("app started"))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert main(["--prompt-file", str(empty)]) == EXIT_USAGE
    assert "the file is empty" in capsys.readouterr().err
