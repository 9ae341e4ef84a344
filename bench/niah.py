"""`kvchat bench niah`: needles in natural prose (RULER's tasks) over lengths and depths.

Each cell builds a document of prose (bench/prose.py) with the task's needles, prefills it and
then the question as two passes (as `kvchat ask` and the app do), and answers greedily. Beside
the answer it records where the asked needles' blocks were selected: by the question's pass,
by the first answer token, and over the whole answer. `compare_dense` runs the same cells with
dense attention on the same loaded weights.
"""

from __future__ import annotations

import platform
import random
import time
from collections.abc import Sequence
from dataclasses import asdict

from kvchat.config import Settings
from kvchat.core.engine import Engine, ProgressFn
from kvchat.core.model_files import resolve_model_path
from kvchat.core.tokenizer import load_tokenizer

from .grid import (
    Log,
    answer_greedily,
    depth_grid,
    engine_facts,
    fitting_settings,
    log_summary,
    needle_blocks,
    run_beside_dense,
    timings,
)
from .needles import TaskSpec, found, make_problem
from .prose import Haystack, Prose, news

DEFAULT_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
_SNIPPET_CHARS = 40


class _Cells:
    """Runs the cells of one task; the same (seed, length, depth, trial) is the same document,
    needles and question in every run and in the dense comparison."""

    def __init__(
        self, spec: TaskSpec, haystack: Haystack, seed: int, on_progress: ProgressFn | None
    ) -> None:
        self.spec, self.haystack, self.seed, self.on_progress = spec, haystack, seed, on_progress

    def __call__(self, engine: Engine, length: int, depth: float, trial: int) -> dict:
        spec = self.spec
        rng = random.Random(
            f"niah:{spec.task.value}:{spec.kind.value}:{self.seed}:{length}:{depth:.6f}:{trial}"
        )
        problem = make_problem(spec, depth, rng)
        document = self.haystack.document(length, problem.needles, rng)
        tokenizer = engine.tokenizer
        session = engine.new_session()
        conversation = session.conversation
        conversation.document_ids = tokenizer.encode_long(document)
        conversation.document_name = f"niah-{length}-{depth:g}"
        prompt = conversation.prompt_ids(tokenizer, problem.question)
        engine.check_fits(len(prompt), spec.max_new_tokens)  # refuse before any work
        blocks = needle_blocks(engine, document, problem.value_offsets(document))
        answer = answer_greedily(session, prompt, spec.max_new_tokens, blocks, self.on_progress)
        hits = [found(answer.text, value) for value in problem.expected]
        return {
            "length": length,
            "depth": depth,
            "trial": trial,
            "question": problem.question,
            "expected": problem.expected,
            "document_tokens": len(conversation.document_ids),
            "prompt_tokens": len(prompt),
            "answer": answer.text,
            "ok": all(hits),
            "score": sum(hits) / len(hits),
            **timings(engine.stats()),
            "seconds": answer.seconds,
            "needle_blocks": blocks,
            "needle_recall_question": answer.recall_question,
            "needle_recall_first_token": answer.recall_first_token,
            "needle_recall_answer": answer.recall_answer,
        }


def _snippet(answer: str) -> str:
    text = " ".join(answer.split())
    return text if len(text) <= _SNIPPET_CHARS else "…" + text[-(_SNIPPET_CHARS - 1) :]


def _recall(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _cell_line(label: str, cell: dict) -> str:
    return (
        f"{label:<6} {cell['length']:>8} {cell['depth']:>6.2f}  "
        f"{_snippet(cell['answer'])!r:<44} {'ok' if cell['ok'] else 'MISS':<4} "
        f"{_recall(cell['needle_recall_question']):>5} "
        f"{_recall(cell['needle_recall_first_token']):>5} "
        f"{_recall(cell['needle_recall_answer']):>5} {cell['seconds']:>7.1f}"
    )


_HEADER = (
    f"{'run':<6} {'length':>8} {'depth':>6}  {'answer (end)':<44} {'ok':<4} "
    f"{'r.q':>5} {'r.1st':>5} {'r.ans':>5} {'seconds':>7}"
)


def run_niah_bench(
    settings: Settings,
    spec: TaskSpec,
    lengths: Sequence[int],
    depths: int | Sequence[float] = DEFAULT_DEPTHS,
    trials: int = 2,
    model_spec: str | None = None,
    compare_dense: Sequence[int] = (),
    prose: Prose | None = None,
    log: Log = print,
    on_progress: ProgressFn | None = None,
    seed: int = 0,
) -> dict:
    """Accuracy of one RULER task at every (length, depth, trial) with the given settings, and
    with dense attention at `compare_dense` lengths; returns a JSON-ready dict."""
    if not lengths:
        raise ValueError("no lengths to test")
    if trials < 1:
        raise ValueError(f"trials must be at least 1, not {trials}")
    grid = depth_grid(depths)
    prose = prose or news()
    tokenizer = load_tokenizer(resolve_model_path(model_spec or settings.model.path))
    longest_question = make_problem(spec, 0.5, random.Random(0)).question
    settings = fitting_settings(
        settings,
        tokenizer,
        max([*lengths, *compare_dense]),
        longest_question,
        spec.max_new_tokens,
    )
    started = time.perf_counter()
    engine = Engine.load(settings, model_spec)
    haystack = Haystack(prose, engine.tokenizer)
    cells = _Cells(spec, haystack, seed, on_progress)
    log(
        f"niah {spec.task.value} ({spec.kind.value}s) in {prose.name}: {len(lengths)} lengths "
        f"x {len(grid)} depths x {trials} trials; r.q / r.1st / r.ans: share of the asked "
        "needles' blocks selected by the question, the first answer token, the answer"
    )
    log(_HEADER)
    main, dense = run_beside_dense(
        engine, lengths, compare_dense, grid, trials, cells, _cell_line, log
    )
    seconds = time.perf_counter() - started
    log_summary(
        log,
        f"niah {spec.task.value} accuracy (attention={main['cache']['attention']}, "
        f"anchor_type={main['cache']['anchor_type']}, "
        f"second_select_num={main['cache']['second_select_num']}, "
        f"kv_type={main['cache']['kv_type']}, position_mode={main['cache']['position_mode']})",
        main,
        dense,
    )
    return {
        "benchmark": "niah",
        "task": {**asdict(spec), "task": spec.task.value, "kind": spec.kind.value},
        "haystack": {
            "name": prose.name,
            "paragraphs": len(prose.paragraphs),
            "sha256": prose.sha256,
            "python": platform.python_version(),
        },
        **engine_facts(engine),
        "max_new_tokens": spec.max_new_tokens,
        "decoding": "greedy",
        "seed": seed,
        "trials": trials,
        "lengths": list(lengths),
        "depths": grid,
        **main,
        "compare_dense": dense,
        "seconds": seconds,
    }
