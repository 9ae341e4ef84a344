"""`kvchat bench passkey`: passkey retrieval accuracy over a grid of lengths and depths.

Every cell hides a five-digit key at one depth of a filler document of one length, asks for it
in a fresh chat session (greedy decoding) and checks the answer. The key is read back in
decode, so the cell measures the decode path of the cache: with dense attention it shows where
the model stops working past its trained context; with the block-sparse cache, whether the
right block is retrieved. `compare_dense` runs the same cells (same keys) with dense attention
on the same loaded weights, side by side.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from functools import partial

from kvchat.config import Settings
from kvchat.core.engine import Engine, ProgressFn
from kvchat.core.model_files import resolve_model_path
from kvchat.core.tokenizer import load_tokenizer

from .grid import (
    Log,
    depth_grid,
    engine_facts,
    fitting_settings,
    greedy,
    log_summary,
    needle_blocks,
    needle_recall,
    run_beside_dense,
    timings,
)
from .haystack import PASSKEY_QUESTION, answer_is_correct, make_passkey_document, random_passkey

MAX_NEW_TOKENS = 16
_SNIPPET_CHARS = 24


def cell_passkey(seed: int, length: int, depth: float, trial: int) -> int:
    """The key of one cell: reproducible, and independent of the rest of the grid, so the
    same cell holds the same key in every run and in the dense comparison."""
    return random_passkey(random.Random(f"passkey:{seed}:{length}:{depth:.6f}:{trial}"))


def _snippet(answer: str) -> str:
    text = " ".join(answer.split())
    return text if len(text) <= _SNIPPET_CHARS else text[: _SNIPPET_CHARS - 1] + "…"


def _run_cell(
    seed: int,
    on_progress: ProgressFn | None,
    engine: Engine,
    length: int,
    depth: float,
    trial: int,
) -> dict:
    passkey = cell_passkey(seed, length, depth, trial)
    tokenizer = engine.tokenizer
    document = make_passkey_document(tokenizer, length, depth, passkey)
    session = engine.new_session()
    conversation = session.conversation
    conversation.document_ids = tokenizer.encode_long(document)
    conversation.document_name = f"passkey-{length}-{depth:g}"
    params = greedy(engine.settings.generation, MAX_NEW_TOKENS)
    prompt_tokens = len(conversation.prompt_ids(tokenizer, PASSKEY_QUESTION))
    engine.check_fits(prompt_tokens, params.max_new_tokens)  # refuse before any work
    if on_progress is not None:
        on_progress(0, prompt_tokens)  # announces a new prefill
    started = time.perf_counter()
    answer = "".join(session.ask(PASSKEY_QUESTION, params, on_progress=on_progress))
    seconds = time.perf_counter() - started
    stats = engine.stats()
    blocks = needle_blocks(engine, document, [document.index(str(passkey))])
    return {
        "length": length,
        "depth": depth,
        "trial": trial,
        "passkey": passkey,
        "document_tokens": len(conversation.document_ids),
        "prompt_tokens": prompt_tokens,
        "answer": answer,
        "ok": answer_is_correct(answer, passkey),
        **timings(stats),
        "seconds": seconds,
        "needle_block": blocks[0] if blocks else None,
        "needle_recall": needle_recall(stats.cache, blocks),
    }


def _cell_line(label: str, cell: dict) -> str:
    return (
        f"{label:<6} {cell['length']:>8} {cell['depth']:>6.2f} {cell['passkey']:>6}  "
        f"{_snippet(cell['answer'])!r:<28} {'ok' if cell['ok'] else 'MISS':<4} "
        f"{cell['prefill_tok_s']:>9.0f} {cell['seconds']:>8.1f} "
        f"{cell['peak_rss_bytes'] / 2**30:>6.2f}/{cell['plan_total_bytes'] / 2**30:.2f}"
    )


_HEADER = (
    f"{'run':<6} {'length':>8} {'depth':>6} {'key':>6}  {'answer':<28} {'ok':<4} "
    f"{'prefill/s':>9} {'seconds':>8} {'peak/plan GiB':>13}"
)


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
    settings = fitting_settings(
        settings, tokenizer, max([*lengths, *compare_dense]), PASSKEY_QUESTION, MAX_NEW_TOKENS
    )
    started = time.perf_counter()
    engine = Engine.load(settings, model_spec)
    log(f"passkey: {len(lengths)} lengths x {len(grid)} depths x {trials} trials")
    log(_HEADER)
    cell = partial(_run_cell, seed, on_progress)
    main, dense = run_beside_dense(
        engine, lengths, compare_dense, grid, trials, cell, _cell_line, log
    )
    seconds = time.perf_counter() - started
    log_summary(
        log,
        f"passkey accuracy (attention={main['cache']['attention']}, "
        f"kv_type={main['cache']['kv_type']}, position_mode={main['cache']['position_mode']})",
        main,
        dense,
    )
    return {
        "benchmark": "passkey",
        **engine_facts(engine),
        "question": PASSKEY_QUESTION,
        "max_new_tokens": MAX_NEW_TOKENS,
        "decoding": "greedy",
        "seed": seed,
        "trials": trials,
        "lengths": list(lengths),
        "depths": grid,
        **main,
        "compare_dense": dense,
        "seconds": seconds,
    }
