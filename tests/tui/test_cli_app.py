"""`kvchat` without a subcommand starts the app; the shared options work on both sides."""

from __future__ import annotations

import subprocess
import sys
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
    assert app.paths == [str(doc)] and app.settings.generation.max_new_tokens == 7


def test_a_bad_prompt_file_is_refused_before_the_app_starts(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(app_module.KvchatApp, "run", lambda self: pytest.fail("app started"))
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert main(["--prompt-file", str(empty)]) == EXIT_USAGE
    assert "the file is empty" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,command,paths",
    [
        (["my-project/"], None, ["my-project/"]),
        (["notes.txt", "other.md", "--model", "M"], None, ["notes.txt", "other.md"]),
        (["-"], None, ["-"]),
        (["./ask"], None, ["./ask"]),  # a path named like a subcommand
        (["ask", "--prompt-file", "a", "--prompt-file", "b/", "q"], "ask", []),
        (["plan"], "plan", []),
        (["config", "show"], "config", []),
        ([], None, []),
    ],
)
def test_paths_or_a_subcommand(argv: list[str], command: str | None, paths: list[str]) -> None:
    args = build_parser().parse_args(argv)
    assert (args.command, args.paths) == (command, paths)
    if command == "ask":
        assert args.prompt_file == ["a", "b/"] and args.question == "q"


def test_paths_start_the_app_on_them(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    started: list[app_module.KvchatApp] = []
    monkeypatch.setattr(app_module.KvchatApp, "run", lambda self: started.append(self))
    (tmp_path / "notes.txt").write_text("Notes.\n")
    assert main([str(tmp_path), str(tmp_path / "notes.txt"), "--model", "M"]) == 0
    [app] = started
    assert app.paths == [str(tmp_path), str(tmp_path / "notes.txt")] and app.model_spec == "M"


def test_paths_and_prompt_file_together_are_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(app_module.KvchatApp, "run", lambda self: pytest.fail("app started"))
    assert main(["--prompt-file", str(tmp_path), str(tmp_path)]) == EXIT_USAGE
    assert capsys.readouterr().err == (
        "kvchat: error: give the document as paths or as --prompt-file, not both\n"
    )


def test_standard_input_for_the_app_needs_a_terminal() -> None:
    # A new session has no controlling terminal: the app would have no keys to read.
    result = subprocess.run(
        [sys.executable, "-m", "kvchat.tui.cli", "-"],
        input="Some text.\n",
        capture_output=True,
        text=True,
        timeout=120,
        start_new_session=True,
    )
    assert result.returncode == EXIT_USAGE
    assert result.stderr == (
        "kvchat: error: -: the app needs a terminal for its keys; "
        "`kvchat ask --prompt-file -` needs none\n"
    )
