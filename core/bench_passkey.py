"""`kvchat bench passkey`: passkey retrieval accuracy over a grid of lengths and depths.

Every cell hides a five-digit key at one depth of a filler document of one length, asks for it
in a fresh chat session (greedy decoding) and checks the answer. The key is read back in
decode, so the cell measures the decode path of the cache: with dense attention it shows where
the model stops working past its trained context; with the block-sparse cache, whether the
right block is retrieved. `compare_dense` runs the same cells (same keys) with dense attention
on the same loaded weights, side by side.
"""

from __future__ import annotations

import os
import platform
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace

import psutil
import torch

from kvchat.config import Settings
from kvchat.kv.backend import CacheStats
from kvchat.native.cpu import cpu_name

from .engine import Engine, ProgressFn
from .haystack import PASSKEY_QUESTION, answer_is_correct, make_passkey_document, random_passkey
from .plan import PlanRefusedError
from .tokenizer import Tokenizer, load_tokenizer
from .weights import resolve_model_path

Log = Callable[[str], None]

MAX_NEW_TOKENS = 16
# A passkey document is its target length give or take one filler sentence.
_LENGTH_SLACK = 64
_SNIPPET_CHARS = 24


def depth_grid(depths: int | Sequence[float]) -> list[float]:
    """`n` evenly spaced depths from 0 (right after the intro) to 1 (at the end); one depth
    is the middle. A sequence of depths is taken as given."""
    if isinstance(depths, int):
        if depths < 1:
            raise ValueError(f"need at least one depth, not {depths}")
        if depths == 1:
            return [0.5]
        return [i / (depths - 1) for i in range(depths)]
    grid = [float(d) for d in depths]
    if not grid or not all(0.0 <= d <= 1.0 for d in grid):
        raise ValueError(f"depths must be between 0 and 1, not {grid}")
    return grid


def cell_passkey(seed: int, length: int, depth: float, trial: int) -> int:
    """The key of one cell: reproducible, and independent of the rest of the grid, so the
    same cell holds the same key in every run and in the dense comparison."""
    return random_passkey(random.Random(f"passkey:{seed}:{length}:{depth:.6f}:{trial}"))


def _template_overhead(tokenizer: Tokenizer) -> int:
    """Prompt tokens around the document: chat template plus the question."""
    from .conversation import Conversation

    probe = Conversation(document_ids=[0])
    return len(probe.prompt_ids(tokenizer, PASSKEY_QUESTION)) - 1


def _fitting_settings(settings: Settings, tokenizer: Tokenizer, longest: int) -> Settings:
    """Raise long_context.max_seq_len (never lower it) so the longest prompt plus the reply fit."""
    needed = longest + _LENGTH_SLACK + _template_overhead(tokenizer) + MAX_NEW_TOKENS
    lc = settings.long_context
    if lc.max_seq_len >= needed:
        return settings
    return replace(settings, long_context=replace(lc, max_seq_len=needed))


def _snippet(answer: str) -> str:
    text = " ".join(answer.split())
    return text if len(text) <= _SNIPPET_CHARS else text[: _SNIPPET_CHARS - 1] + "…"


def _run_cell(
    engine: Engine,
    length: int,
    depth: float,
    trial: int,
    seed: int,
    on_progress: ProgressFn | None,
) -> dict:
    passkey = cell_passkey(seed, length, depth, trial)
    tokenizer = engine.tokenizer
    document = make_passkey_document(tokenizer, length, depth, passkey)
    session = engine.new_session()
    conversation = session.conversation
    conversation.document_ids = tokenizer.encode_long(document)
    conversation.document_name = f"passkey-{length}-{depth:g}"
    params = replace(
        engine.settings.generation,
        max_new_tokens=MAX_NEW_TOKENS,
        temperature=0.0,
        repetition_penalty=1.0,
    )
    prompt_tokens = len(conversation.prompt_ids(tokenizer, PASSKEY_QUESTION))
    engine.check_fits(prompt_tokens, params.max_new_tokens)  # refuse before any work
    if on_progress is not None:
        on_progress(0, prompt_tokens)  # announces a new prefill
    started = time.perf_counter()
    answer = "".join(session.ask(PASSKEY_QUESTION, params, on_progress=on_progress))
    seconds = time.perf_counter() - started
    stats = engine.stats()
    needle = _needle_block(engine, document, passkey)
    return {
        "length": length,
        "depth": depth,
        "trial": trial,
        "passkey": passkey,
        "document_tokens": len(conversation.document_ids),
        "prompt_tokens": prompt_tokens,
        "answer": answer,
        "ok": answer_is_correct(answer, passkey),
        "attention": stats.attention,
        "position_mode": stats.position_mode,
        "prefill_tok_s": stats.prefill_tok_s,
        "prefill_s": stats.prefill_seconds,
        "decode_tok_s": stats.decode_tok_s,
        "time_to_first_token_s": stats.time_to_first_token,
        "seconds": seconds,
        "needle_block": needle,
        "needle_recall": _needle_recall(stats.cache, needle),
    }


def _needle_block(engine: Engine, document: str, passkey: int) -> int | None:
    """The cache block that holds the passkey's first digits (None for the dense cache)."""
    block = engine.settings.long_context.block_size
    if engine.session.cache_stats().block_size == 0:
        return None
    tokenizer = engine.tokenizer
    prefix = engine.session.conversation.document_prefix_length(tokenizer)
    offset = document.index(str(passkey))
    return (prefix + len(tokenizer.encode(document[:offset]))) // block


def _needle_recall(cache: CacheStats, needle: int | None) -> float | None:
    """Fraction of the selecting layers whose last selection holds the needle's block.

    None when nothing had to be selected: dense attention, or the needle in the sinks or the
    local window (no layer then has it as a candidate).
    """
    layers = [layer for layer in cache.layers if not layer.dense]
    if needle is None or not layers or needle == 0 or needle > layers[0].candidates:
        return None
    return sum(needle in layer.selected for layer in layers) / len(layers)


def _cell_line(label: str, cell: dict) -> str:
    return (
        f"{label:<6} {cell['length']:>8} {cell['depth']:>6.2f} {cell['passkey']:>6}  "
        f"{_snippet(cell['answer'])!r:<28} {'ok' if cell['ok'] else 'MISS':<4} "
        f"{cell['prefill_tok_s']:>9.0f} {cell['seconds']:>8.1f}"
    )


_HEADER = (
    f"{'run':<6} {'length':>8} {'depth':>6} {'key':>6}  {'answer':<28} {'ok':<4} "
    f"{'prefill/s':>9} {'seconds':>8}"
)


def _run_grid(
    engine: Engine,
    label: str,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    seed: int,
    log: Log,
    on_progress: ProgressFn | None,
) -> dict:
    cells: list[dict] = []
    skipped: list[dict] = []
    per_length: list[dict] = []
    for length in lengths:
        done: list[dict] = []
        refusal = None
        for depth in depths:
            for trial in range(trials):
                try:
                    cell = _run_cell(engine, length, depth, trial, seed, on_progress)
                except PlanRefusedError as e:
                    refusal = str(e)
                    break
                done.append(cell)
                log(_cell_line(label, cell))
            if refusal is not None:
                break
        if refusal is not None:
            log(f"{label:<6} {length:>8} skipped: {refusal}")
            skipped.append({"length": length, "reason": refusal})
        cells += done
        correct = sum(c["ok"] for c in done)
        per_length.append(
            {
                "length": length,
                "correct": correct,
                "total": len(done),
                "accuracy": correct / len(done) if done and refusal is None else None,
                "skipped": refusal is not None,
                "position_mode": done[-1]["position_mode"] if done else None,
            }
        )
    engine.new_session()  # let go of the last cell's cache
    correct = sum(c["ok"] for c in cells)
    stats = engine.stats()
    lc = engine.settings.long_context
    return {
        "cache": {
            "attention": stats.attention,
            "position_mode": cells[-1]["position_mode"] if cells else stats.position_mode,
            "kv_type": lc.kv_type,
            "anchor_type": lc.anchor_type,
            "block_size": lc.block_size,
            "local_windows_len": lc.local_windows_len,
            "second_select_num": lc.second_select_num,
        },
        "long_context": asdict(lc),
        "cells": cells,
        "per_length": per_length,
        "skipped": skipped,
        "correct": correct,
        "total": len(cells),
        "overall_accuracy": correct / len(cells) if cells else None,
    }


def _percent(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["skipped"]:
        return "skipped"
    if row["accuracy"] is None:
        return "-"
    return f"{row['correct']}/{row['total']} {100 * row['accuracy']:3.0f}%"


def _summary(main: dict, dense: dict | None) -> list[str]:
    by_length = {r["length"]: r for r in main["per_length"]}
    dense_by_length = {r["length"]: r for r in dense["per_length"]} if dense else {}
    lengths = sorted(set(by_length) | set(dense_by_length))
    main_name = main["cache"]["attention"]
    lines = [
        f"{'length':>8}  {main_name:>14}" + (f"  {'dense (compare)':>15}" if dense else ""),
    ]
    for length in lengths:
        line = f"{length:>8}  {_percent(by_length.get(length)):>14}"
        if dense:
            line += f"  {_percent(dense_by_length.get(length)):>15}"
        lines.append(line)

    def overall(run: dict) -> str:
        if not run["total"]:
            return "-"
        return f"{run['correct']}/{run['total']} {100 * run['overall_accuracy']:3.0f}%"

    lines.append(
        f"{'overall':>8}  {overall(main):>14}" + (f"  {overall(dense):>15}" if dense else "")
    )
    return lines


def run_passkey_bench(
    settings: Settings,
    lengths: Sequence[int],
    depths: int | Sequence[float],
    trials: int = 1,
    model_spec: str | None = None,
    compare_dense: Sequence[int] = (),
    log: Log = print,
    on_progress: ProgressFn | None = None,
    seed: int = 0,
) -> dict:
    """Passkey accuracy at every (length, depth) with the given settings, and optionally with
    dense attention at `compare_dense` lengths; returns a JSON-ready dict.

    `depths` is a count of evenly spaced depths or the depths themselves. Cells whose prompt
    the memory plan refuses are reported as skipped. `on_progress(done, total)` follows each
    prefill; a call with done == 0 announces the next one.
    """
    if not lengths:
        raise ValueError("no lengths to test")
    if trials < 1:
        raise ValueError(f"trials must be at least 1, not {trials}")
    grid = depth_grid(depths)
    spec = model_spec or settings.model.path
    tokenizer = load_tokenizer(resolve_model_path(spec))
    settings = _fitting_settings(settings, tokenizer, max([*lengths, *compare_dense]))
    started = time.perf_counter()
    engine = Engine.load(settings, model_spec)
    log(f"passkey: {len(lengths)} lengths x {len(grid)} depths x {trials} trials")
    log(_HEADER)
    main = _run_grid(engine, "main", lengths, grid, trials, seed, log, on_progress)
    dense = None
    if compare_dense:
        lc = engine.settings.long_context
        dense_engine = engine.with_settings(
            replace(engine.settings, long_context=replace(lc, attention="dense"))
        )
        dense = _run_grid(
            dense_engine, "dense", compare_dense, grid, trials, seed, log, on_progress
        )
    seconds = time.perf_counter() - started
    log("")
    log(
        f"passkey accuracy (attention={main['cache']['attention']}, "
        f"kv_type={main['cache']['kv_type']}, position_mode={main['cache']['position_mode']})"
    )
    for line in _summary(main, dense):
        log(line)
    stats = engine.stats()
    machine = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
    }
    if stats.device.startswith("cuda"):
        machine["gpu"] = torch.cuda.get_device_name(torch.device(stats.device))
    return {
        "benchmark": "passkey",
        "model": stats.model,
        "dtype": stats.dtype,
        "weight_format": stats.weight_format,
        "device": stats.device,
        "threads": stats.threads,
        "machine": machine,
        "torch": torch.__version__,
        "question": PASSKEY_QUESTION,
        "max_new_tokens": MAX_NEW_TOKENS,
        "decoding": "greedy",
        "seed": seed,
        "trials": trials,
        "lengths": list(lengths),
        "depths": grid,
        "max_seq_len": engine.settings.long_context.max_seq_len,
        "trained_context": engine.config.trained_context,
        **main,
        "compare_dense": dense,
        "seconds": seconds,
    }
