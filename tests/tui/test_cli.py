"""`kvchat ask` end to end with the real model, and every bad-input path of the CLI."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvchat.tui.cli import EXIT_USAGE, main


def run_cli(
    *argv: str, stdin: str | None = None, timeout: int = 600, **env: str
) -> subprocess.CompletedProcess:
    """The real entry point in a fresh process, as a user runs it (with `env` added to the
    environment)."""
    return subprocess.run(
        [sys.executable, "-m", "kvchat.tui.cli", *argv],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=os.environ | env,
    )


@pytest.mark.slow
def test_passkey_in_a_1500_token_haystack(tmp_path, smollm_path):
    from kvchat.bench.haystack import (
        PASSKEY_QUESTION,
        answer_is_correct,
        make_passkey_document,
        random_passkey,
    )
    from kvchat.core.tokenizer import load_tokenizer

    rng = random.Random(20261130)
    passkey = random_passkey(rng)
    doc = make_passkey_document(load_tokenizer(smollm_path), 1500, rng.uniform(0.1, 0.9), passkey)
    path = tmp_path / "haystack.txt"
    path.write_text(doc)
    result = run_cli(
        "ask", "--prompt-file", str(path), "--set", "generation.max_new_tokens=24", PASSKEY_QUESTION
    )
    assert result.returncode == 0, result.stderr
    assert answer_is_correct(result.stdout, passkey), (passkey, result.stdout)


def test_question_from_stdin(tmp_path):
    path = tmp_path / "note.txt"
    path.write_text(
        "The meeting is on Tuesday at the blue house. The blue house is on Elm Street.\n"
    )
    result = run_cli(
        "ask",
        "--prompt-file",
        str(path),
        "--set",
        "generation.max_new_tokens=16",
        stdin="Where is the meeting?",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


@pytest.mark.parametrize(
    "make,expected",
    [
        (lambda d: d / "missing.txt", "no such file"),
        (lambda d: d, "no file to read in it"),
        (lambda d: _write(d / "empty.txt", b""), "the file is empty"),
        (lambda d: _write(d / "blank.txt", b" \n\n \t\n"), "the file is empty"),
        (lambda d: _write(d / "blob.bin", bytes(range(256)) * 4), "binary file"),
        (lambda d: _write(d / "latin1.txt", "caf\xe9 cr\xe8me".encode("latin-1")), "not UTF-8"),
        (lambda d: Path("/dev/zero"), "not a regular file"),
        (lambda d: _fifo(d / "pipe.txt"), "not a regular file"),
    ],
)
def test_bad_prompt_files_exit_2_with_a_clear_message(tmp_path, capsys, make, expected):
    path = make(tmp_path)
    code = main(["ask", "--prompt-file", str(path), "What is it?"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert expected in err and str(path) in err
    assert "Traceback" not in err


def _fifo(path: Path) -> Path:
    os.mkfifo(path)  # no writer: reading it would wait forever
    return path


def test_missing_question_is_refused(tmp_path):
    path = _write(tmp_path / "doc.txt", b"Some text.\n")
    result = run_cli("ask", "--prompt-file", str(path), stdin="")
    assert result.returncode == EXIT_USAGE
    assert "no question given" in result.stderr


def test_a_document_past_the_settings_gets_the_flags_that_fit_and_loads_with_fit(tmp_path, capsys):
    path = _write(tmp_path / "long.txt", ("The grass is green. The sky is blue. " * 60).encode())
    argv = [
        "ask",
        "--prompt-file",
        str(path),
        "--set",
        "long_context.max_seq_len=512",
        "--set",
        "long_context.chunk_size=256",
        "--set",
        "generation.max_new_tokens=16",
        "What colour is the sky?",
    ]
    code = main(argv)
    captured = capsys.readouterr()
    assert code == EXIT_USAGE
    [line] = captured.err.strip().splitlines()
    assert "do not fit the settings" in line
    assert line.endswith("run again with --fit or add: --set long_context.max_seq_len=4096")
    assert "prefill:" not in captured.err  # refused before any prefill progress
    assert captured.out == ""

    assert main([*argv[:-1], "--fit", "--verbose", argv[-1]]) == 0
    captured = capsys.readouterr()
    assert "kvchat: fitted the settings: max_seq_len 4,096" in captured.err
    # -v says how it computes under the settings it runs with: those of the fit.
    fitted = captured.err.index("kvchat: fitted the settings")
    assert captured.err.index("kvchat: compute: ") > fitted
    assert "; FP16 blocks\n" in captured.err
    assert "blue" in captured.out.lower()


def test_bad_override_names_the_key(tmp_path, capsys):
    path = _write(tmp_path / "doc.txt", b"Some text.\n")
    code = main(["ask", "--prompt-file", str(path), "--set", "long_context.kv_type=FP8", "q?"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert "long_context.kv_type" in err and "FP8" in err


def test_bench_refuses_zero_decode_tokens(capsys):
    # A rate over no tokens was a ZeroDivisionError after the whole prefill.
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "speed", "--decode-tokens", "0"])
    assert exit_info.value.code == EXIT_USAGE
    assert "--decode-tokens" in capsys.readouterr().err


def test_an_unknown_baseline_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "speed", "--baseline", "llama.cpp,vllm"])
    assert exit_info.value.code == EXIT_USAGE
    assert "unknown baseline" in capsys.readouterr().err


def test_the_llama_cpp_baseline_says_how_to_install_it():
    # llama-cpp-python made unimportable, as where the optional extra is not installed.
    code = (
        "import sys; sys.modules['llama_cpp'] = None; from kvchat.tui.cli import main; "
        "sys.exit(main(['bench', 'speed', '--contexts', '256', '--baseline', 'llama.cpp']))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == EXIT_USAGE, result.stderr
    assert "pip install 'kvchat[baseline]'" in result.stderr
    assert "Traceback" not in result.stderr


def test_unknown_model_file_is_a_clear_error(tmp_path, capsys):
    doc = _write(tmp_path / "doc.txt", b"Some text.\n")
    bogus = _write(tmp_path / "model.gguf", b"not a gguf at all" * 100)
    code = main(["ask", "--prompt-file", str(doc), "--model", str(bogus), "q?"])
    err = capsys.readouterr().err
    assert code == EXIT_USAGE
    assert str(bogus) in err and "Traceback" not in err


def test_config_subcommands(tmp_path, capsys):
    cfg = tmp_path / "config.yaml"
    assert main(["config", "path", "--config", str(cfg)]) == 0
    assert capsys.readouterr().out.strip() == str(cfg)
    assert cfg.exists()
    assert main(["config", "show", "--config", str(cfg), "--set", "generation.seed=5"]) == 0
    assert "seed: 5" in capsys.readouterr().out
    cfg.write_text(cfg.read_text().replace("  # chunk_size: 2048", "  chunk_size: -3"))
    assert main(["config", "validate", "--config", str(cfg)]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "long_context.chunk_size" in err and "-3" in err and str(cfg) in err


def test_config_set_and_reset_save_values_and_keep_comments(tmp_path, capsys):
    cfg = tmp_path / "config.yaml"
    argv = ["--config", str(cfg)]
    assert main(["config", "set", "long_context.kv_type=INT8", "generation.seed=7", *argv]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [
        "generation.seed: 0 -> 7",
        "long_context.kv_type: FP16 -> INT8",
        f"{cfg}: saved",
    ]
    text = cfg.read_text()
    assert "  kv_type: INT8" in text and "  seed: 7" in text
    assert "# Storage format of the blocks in DRAM" in text  # the file's comments stay

    assert main(["config", "reset", "long_context.kv_type", *argv]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "long_context.kv_type: INT8 -> FP16"
    # Back at its default, the key is commented out again: it follows kvchat's default.
    assert "  # kv_type: FP16" in cfg.read_text() and "  seed: 7" in cfg.read_text()
    assert main(["config", "reset", *argv]) == 0
    assert capsys.readouterr().out.splitlines() == ["generation.seed: 7 -> 0", f"{cfg}: saved"]
    assert main(["config", "reset", *argv]) == 0
    assert capsys.readouterr().out.strip() == f"{cfg}: nothing changed"

    for bad, message in [
        (["set", "long_context.kv_type=INT3"], "long_context.kv_type"),
        (["set", "kv_type=INT8"], "did you mean long_context.kv_type?"),
        (["reset", "long_context.kvtype"], "did you mean long_context.kv_type?"),
        (["set"], "nothing to set"),
        (["show", "generation.seed"], "takes no values"),
    ]:
        before = cfg.read_text()
        assert main(["config", *bad, *argv]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
        assert cfg.read_text() == before  # a refused edit writes nothing


def test_config_docs_prints_or_writes_the_settings_reference(tmp_path, capsys):
    from kvchat.config import settings_markdown

    # An invalid settings file does not matter: the reference comes from the schema.
    cfg = tmp_path / "config.yaml"
    cfg.write_text("long_context:\n  kv_type: INT3\n")
    assert main(["config", "docs", "--config", str(cfg)]) == 0
    assert capsys.readouterr().out == settings_markdown()
    out = tmp_path / "configuration.md"
    assert main(["config", "docs", "--output", str(out)]) == 0
    assert out.read_text(encoding="utf-8") == settings_markdown()
    assert capsys.readouterr().out == ""
    assert main(["config", "show", "--output", str(out), "--config", str(cfg)]) == EXIT_USAGE
    assert "--output is for `kvchat config docs`" in capsys.readouterr().err


def test_plan_says_how_it_computes(capsys):
    from kvchat.native.cpu import cpu_level

    assert main(["plan"]) == 0
    first, second = capsys.readouterr().out.splitlines()[:2]
    assert first.startswith("compute: ")
    # SmolLM2's Q4_1 layers as int4, its Q8_0 table as int8 (the head) and bf16 (embedding).
    assert second.startswith("weights as loaded: ")
    held = [part.split()[0] for part in second.removeprefix("weights as loaded: ").split(", ")]
    assert sorted(held) == ["bfloat16", "int4", "int8"]
    assert f"{cpu_level().value} kernels" in first
    assert "bfloat16 activations and KV" in first and "weights int4" in first


def test_a_cpu_level_the_cpu_cannot_run_is_one_clear_error():
    result = run_cli("plan", KVCHAT_CPU_LEVEL="avx3")
    assert result.returncode == EXIT_USAGE
    assert "KVCHAT_CPU_LEVEL='avx3' names no CPU level" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_a_kernel_build_is_shown_on_stderr(twice_source, monkeypatch):
    from kvchat import native
    from kvchat.tui.cli import BuildLine

    # Reports every 20 ms: a compile and a link through ninja take several times that.
    monkeypatch.setattr(native, "REPORT_INTERVAL_S", 0.02)
    stream = io.StringIO()
    with native.build_reports(BuildLine(stream)):
        assert native.build_extension("kvchat_test", [twice_source], "doubling", "none") is not None
    lines = stream.getvalue().splitlines()
    # Not a terminal: the first report and the end, each on its own line.
    assert len(lines) == 2
    assert lines[0].startswith("kvchat: building the C++ kernels for doubling (")
    assert lines[1].startswith("kvchat: built the C++ kernels for doubling (")
    assert "1/1 sources" in lines[1]


def test_core_kv_the_server_and_the_client_do_not_import_textual():
    code = (
        "import sys, kvchat.core.engine, kvchat.bench.speed, kvchat.kv.dense, kvchat.server.app,"
        " kvchat.client.engine;"
        "bad = [m for m in sys.modules if m == 'textual' or m.startswith('textual.')];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_command_line_answers_version_help_and_usage_errors_without_torch():
    # Importing torch takes seconds; the commands that compute import it when they run.
    code = textwrap.dedent(
        """
        import sys
        from kvchat.tui.cli import main
        codes = []
        for argv in (["--version"], ["--help"], ["ask"], ["ask", "--help"]):
            try:
                codes.append(main(argv))
            except SystemExit as e:  # argparse's own exits
                codes.append(e.code)
        print(codes, "torch" in sys.modules, file=sys.stderr)
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stderr.splitlines()[-1] == "[0, 0, 2, 0] False", result.stderr


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"kvchat {importlib.metadata.version('kvchat')}"


SAMPLE_REPO = Path(__file__).parents[1] / "fixtures" / "sample-repo"


def test_ask_about_a_folder(tmp_path):
    result = run_cli(
        "ask",
        "--prompt-file",
        str(SAMPLE_REPO),
        "--set",
        "generation.max_new_tokens=16",
        "--verbose",
        "Who is the head keeper?",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "sample-repo/: 4 files read; skipped 1 (.gitignore 1)" in result.stderr
    assert "skipped debug.log (.gitignore)" in result.stderr
    assert "load model: 272/272 (100%)" in result.stderr  # SmolLM2's tensors, as they load


def test_the_document_from_standard_input():
    result = run_cli(
        "ask",
        "--prompt-file",
        "-",
        "--set",
        "generation.max_new_tokens=8",
        "--verbose",
        "Where is the meeting?",
        stdin="The meeting is on Tuesday at the blue house.\n",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "stdin: 45 bytes" in result.stderr


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["ask", "--prompt-file", "-"],
            "the document is standard input (-): give the question as an argument",
        ),
        (
            ["ask", "--prompt-file", "-", "--prompt-file", "-", "q?"],
            "-: standard input can be read only once",
        ),
        (
            ["ask", "--prompt-file", "report.pdf", "q?"],
            "report.pdf: PDF needs the documents extra: pip install 'kvchat[documents]'",
        ),
    ],
)
def test_document_refusals_before_the_model_loads(tmp_path, monkeypatch, capsys, argv, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.pdf").write_bytes(b"%PDF-1.4\n")
    monkeypatch.setitem(sys.modules, "pypdf", None)  # the documents extra is not installed
    monkeypatch.setattr("kvchat.core.engine.Engine.load", lambda *a: pytest.fail("model loaded"))
    assert main(argv) == EXIT_USAGE
    assert capsys.readouterr().err == f"kvchat: error: {message}\n"


def test_shell_completion_completes_commands_options_and_choices(tmp_path, capsys):
    out = tmp_path / "candidates"

    def complete(line: str) -> list[str]:
        env = {
            **os.environ,
            "_ARGCOMPLETE": "1",
            "_ARGCOMPLETE_IFS": "\n",
            "_ARGCOMPLETE_STDOUT_FILENAME": str(out),
            "COMP_LINE": line,
            "COMP_POINT": str(len(line)),
        }
        code = "from kvchat.tui.cli import main; main()"
        subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
        return out.read_text().split()

    assert "history" in complete("kvchat hist")
    assert "--fit" in complete("kvchat ask --f")
    assert {"list", "export", "rm", "--search"} <= set(complete("kvchat history "))
    for shell in ("bash", "zsh", "fish"):
        assert main(["completion", shell]) == 0
        assert "kvchat" in capsys.readouterr().out


def test_an_earlier_kvchat_home_is_moved_with_a_notice(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("KVCHAT_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / ".config"))
    (tmp_path / ".kvchat").mkdir()
    (tmp_path / ".kvchat" / "config.yaml").write_text("generation:\n  seed: 3\n")
    assert main(["config", "path"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith(f"kvchat: moved {tmp_path / '.kvchat'} to the platform's")
    assert captured.out.strip() == str(tmp_path / ".config" / "kvchat" / "config.yaml")
    assert main(["config", "path"]) == 0
    assert capsys.readouterr().err == ""  # once


def test_plan_for_a_document_shows_its_memory_the_fit_and_a_prefill_time(
    tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))  # no rate measured yet
    path = _write(tmp_path / "long.txt", ("The grass is green. The sky is blue. " * 60).encode())
    argv = ["plan", str(path), "--set", "long_context.chunk_size=256"]
    assert main([*argv, "--set", "long_context.max_seq_len=512"]) == 0
    out = capsys.readouterr().out
    assert "long.txt: 2,220 bytes, " in out and "a context of" in out
    for kv_type in ("FP16", "INT8", "INT4"):
        assert f"\n{kv_type:<8} " in out
    assert "do not hold it; these do: --set long_context.max_seq_len=4096" in out
    assert "prefill: at least " in out and "(measured now, " in out
    assert main(argv) == 0  # the default max_seq_len holds it; the rate is kept
    out = capsys.readouterr().out
    assert "the settings (kv_type FP16, max_seq_len 131,072) hold it" in out
    assert "(recorded, " in out


def test_sizes_take_k_and_m_suffixes():
    from kvchat.tui.cli import _parse_contexts

    assert _parse_contexts("4k, 128K,1m,300") == [4096, 131072, 1 << 20, 300]
    for bad in ("4kk", "1.5m", "m", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="bad context size"):
            _parse_contexts(bad)
