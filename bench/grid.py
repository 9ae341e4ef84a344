"""What the retrieval benchmarks share: a grid of (length, depth, trial) cells run in fresh
chat sessions, greedy answers, where each selecting layer had the needles' blocks, the plan's
refusals as skipped lengths, a summary table, and the machine in the JSON."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import psutil
import torch

from kvchat.config import AttentionMode, GenerationSettings, Settings
from kvchat.core.engine import Engine, EngineStats, ProgressFn, Session
from kvchat.core.memory import peak_rss, reset_peak_rss
from kvchat.core.plan import PlanRefusedError
from kvchat.core.tokenizer import Tokenizer
from kvchat.kv.backend import CacheStats
from kvchat.native.cpu import cpu_name

Log = Callable[[str], None]
# One cell: (engine, length, depth, trial) -> its JSON row, with at least "ok".
CellFn = Callable[[Engine, int, float, int], dict]
LineFn = Callable[[str, dict], str]

# A document is its target length give or take a sentence, or up to 0.5% over (a prose
# document counted from its paragraphs' own lengths).
LENGTH_SLACK = 256
LENGTH_SLACK_SHARE = 0.005


def depth_grid(depths: int | Sequence[float]) -> list[float]:
    """`n` evenly spaced depths from 0 (the start) to 1 (the end); one depth is the middle.
    A sequence of depths is taken as given."""
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


def greedy(settings: GenerationSettings, max_new_tokens: int) -> GenerationSettings:
    """Repeatable answers: greedy decoding, no repetition penalty."""
    return replace(settings, max_new_tokens=max_new_tokens, temperature=0.0, repetition_penalty=1.0)


def fitting_settings(
    settings: Settings, tokenizer: Tokenizer, longest: int, question: str, max_new_tokens: int
) -> Settings:
    """Raise long_context.max_seq_len (never lower it) so the longest prompt plus the reply
    fit."""
    overhead = prompt_overhead(tokenizer, question)
    needed = int(longest * (1 + LENGTH_SLACK_SHARE)) + LENGTH_SLACK + overhead + max_new_tokens
    lc = settings.long_context
    if lc.max_seq_len >= needed:
        return settings
    return replace(settings, long_context=replace(lc, max_seq_len=needed))


def prompt_overhead(tokenizer: Tokenizer, question: str) -> int:
    """Tokens a question's prompt adds around a document: the chat template and the
    question."""
    from kvchat.core.conversation import Conversation

    return len(Conversation(document_ids=[0]).prompt_ids(tokenizer, question)) - 1


def needle_blocks(engine: Engine, document: str, offsets: Sequence[int]) -> list[int] | None:
    """The cache blocks that hold the characters of `document` at `offsets`, where each value
    the answer must copy begins (None for the dense cache)."""
    if engine.settings.long_context.attention == AttentionMode.DENSE:
        return None
    tokenizer = engine.tokenizer
    block = engine.settings.long_context.block_size
    prefix = engine.session.conversation.document_prefix_length(tokenizer)
    return [(prefix + len(tokenizer.encode_long(document[:offset]))) // block for offset in offsets]


def needle_recall(cache: CacheStats, needles: Sequence[int] | None) -> float | None:
    """Fraction of (selecting layer, needle block) pairs where the layer's last selection
    holds the block.

    None when nothing had to be selected: dense attention, or every needle in the sinks or
    the local window (no layer then has it as a candidate).
    """
    layers = [layer for layer in cache.layers if not layer.dense]
    if needles is None or not layers:
        return None
    candidates = [n for n in needles if 0 < n <= layers[0].candidates]
    if not candidates:
        return None
    hits = sum(n in layer.selected for layer in layers for n in candidates)
    return hits / (len(layers) * len(candidates))


@dataclass(frozen=True)
class Answer:
    text: str
    seconds: float  # from the document's prefill to the answer's last token
    recall_question: float | None  # needle_recall after the question's pass
    recall_first_token: float | None  # ... at the step that decoded the first answer token
    recall_answer: float | None  # ... averaged over the answer's tokens


def answer_greedily(
    session: Session,
    prompt: list[int],
    max_new_tokens: int,
    blocks: Sequence[int] | None,
    on_progress: ProgressFn | None,
) -> Answer:
    """Prefills the session's document, then `prompt` (two passes, as `kvchat ask` and the app
    do), and decodes greedily to the end of the reply, recording where the needles' `blocks`
    were selected."""
    engine = session.engine
    tokenizer = engine.tokenizer
    conversation = session.conversation
    params = greedy(engine.settings.generation, max_new_tokens)
    started = time.perf_counter()
    for ids in (conversation.document_prefix_ids(tokenizer), prompt):
        if on_progress is not None:
            on_progress(0, len(ids) - len(session.tokens))  # a new prefill
        session.sync(ids, on_progress)
    recalls = [needle_recall(session.cache_stats(), blocks)]  # the question's pass
    eos = set(tokenizer.eos_ids)
    reply: list[int] = []
    for token in session.generate(params):
        if reply:  # the selections of the step that decoded the previous token
            recalls.append(needle_recall(session.cache_stats(), blocks))
        if token in eos:
            break
        reply.append(token)
    seconds = time.perf_counter() - started
    answer_recalls = [r for r in recalls[1:] if r is not None]
    return Answer(
        text=tokenizer.decode(reply),
        seconds=seconds,
        recall_question=recalls[0],
        recall_first_token=recalls[1] if len(recalls) > 1 else None,
        recall_answer=sum(answer_recalls) / len(answer_recalls) if answer_recalls else None,
    )


def timings(stats: EngineStats) -> dict:
    """The speed figures of the cell that just ran."""
    return {
        "attention": stats.attention,
        "position_mode": stats.position_mode,
        "prefill_tok_s": stats.prefill_tok_s,
        "prefill_s": stats.prefill_seconds,
        "decode_tok_s": stats.decode_tok_s,
        "time_to_first_token_s": stats.time_to_first_token,
    }


def memory_use(engine: Engine) -> dict:
    """The process's peak RSS since the cell began (its start where the OS cannot reset the
    peak) beside the plan's total for the tokens the cell's cache holds."""
    tokens = engine.session.cache_stats().tokens
    return {
        "peak_rss_bytes": peak_rss(),
        "cache_tokens": tokens,
        "plan_total_bytes": engine.plan(tokens).total_bytes,
    }


def run_grid(
    engine: Engine,
    label: str,
    lengths: Sequence[int],
    depths: Sequence[float],
    trials: int,
    run_cell: CellFn,
    line: LineFn,
    log: Log,
) -> dict:
    """Every cell of the grid, lengths the plan refuses skipped; per-length and overall
    accuracy."""
    cells: list[dict] = []
    skipped: list[dict] = []
    per_length: list[dict] = []
    for length in lengths:
        done: list[dict] = []
        refusal = None
        for depth in depths:
            for trial in range(trials):
                reset_peak_rss()
                try:
                    cell = run_cell(engine, length, depth, trial)
                except PlanRefusedError as e:
                    refusal = str(e)
                    break
                cell |= memory_use(engine)
                done.append(cell)
                log(line(label, cell))
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


def run_beside_dense(
    engine: Engine,
    lengths: Sequence[int],
    compare_dense: Sequence[int],
    depths: Sequence[float],
    trials: int,
    run_cell: CellFn,
    line: LineFn,
    log: Log,
) -> tuple[dict, dict | None]:
    """The grid with the engine's settings, then (at `compare_dense` lengths) with dense
    attention on the same weights."""
    main = run_grid(engine, "main", lengths, depths, trials, run_cell, line, log)
    dense = None
    if compare_dense:
        twin = dense_twin(engine)
        dense = run_grid(twin, "dense", compare_dense, depths, trials, run_cell, line, log)
    return main, dense


def engine_facts(engine: Engine) -> dict:
    """The model, how it computes and where, for a benchmark's JSON."""
    stats = engine.stats()
    return {
        "model": stats.model,
        "dtype": stats.dtype,
        "weight_format": stats.weight_format,
        "device": stats.device,
        "threads": stats.threads,
        "machine": machine(stats),
        "torch": torch.__version__,
        "max_seq_len": engine.settings.long_context.max_seq_len,
        "trained_context": engine.config.trained_context,
    }


def dense_twin(engine: Engine) -> Engine:
    """The same loaded weights with dense attention."""
    lc = engine.settings.long_context
    return engine.with_settings(
        replace(engine.settings, long_context=replace(lc, attention=AttentionMode.DENSE))
    )


def _percent(row: dict | None) -> str:
    if row is None:
        return "-"
    if row["skipped"]:
        return "skipped"
    if row["accuracy"] is None:
        return "-"
    return f"{row['correct']}/{row['total']} {100 * row['accuracy']:3.0f}%"


def log_summary(log: Log, title: str, main: dict, dense: dict | None) -> None:
    """The closing table: `title`, then accuracy per length, the dense run beside the main
    one."""
    log("")
    log(title)
    for line in summary(main, dense):
        log(line)


def summary(main: dict, dense: dict | None) -> list[str]:
    """Accuracy per length, the dense run beside the main one."""
    by_length = {r["length"]: r for r in main["per_length"]}
    dense_by_length = {r["length"]: r for r in dense["per_length"]} if dense else {}
    lengths = sorted(set(by_length) | set(dense_by_length))
    main_name = main["cache"]["attention"]
    lines = [
        f"{'length':>8}  {main_name:>14}" + (f"  {'dense (compare)':>15}" if dense else ""),
    ]
    for length in lengths:
        row = f"{length:>8}  {_percent(by_length.get(length)):>14}"
        if dense:
            row += f"  {_percent(dense_by_length.get(length)):>15}"
        lines.append(row)

    def overall(run: dict) -> str:
        if not run["total"]:
            return "-"
        return f"{run['correct']}/{run['total']} {100 * run['overall_accuracy']:3.0f}%"

    lines.append(
        f"{'overall':>8}  {overall(main):>14}" + (f"  {overall(dense):>15}" if dense else "")
    )
    return lines


def machine(stats: EngineStats) -> dict:
    """The CPU (and GPU) a benchmark ran on, for its JSON."""
    info = {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "ram_bytes": psutil.virtual_memory().total,
        "platform": platform.platform(),
    }
    if stats.device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(stats.device))
    return info
