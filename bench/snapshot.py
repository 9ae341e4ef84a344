"""`kvchat bench snapshot`: time to the first answer about a long document, cold (tokenize and
prefill it) versus warm (tokenize it and load the snapshot the cold run saved).

Both runs start from a fresh session and end at the first piece of answer text for the same
question, so the difference is what a snapshot saves a user who comes back to a document. The
snapshot is written to a temporary folder (never the user's cache) and read back while the
operating system still holds it in its page cache, as it would right after a first session.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch

from kvchat.config import Settings
from kvchat.core.engine import Engine
from kvchat.core.snapshot import PrefillReport
from kvchat.native.cpu import cpu_name

from .haystack import PASSKEY_QUESTION, answer_is_correct, make_passkey_document

Log = Callable[[str], None]

ANSWER_TOKENS = 16
PASSKEY = 48_213
_HEADROOM = 512  # template, question and answer tokens on top of the document


def _first_answer(engine: Engine, text: str, save: bool) -> tuple[dict, PrefillReport]:
    """One fresh session: tokenize, prefill (or load) the document, ask; timings in seconds
    from the start. With `save`, a snapshot of the document is written before the question,
    and the time that takes is left out of the others (it is reported on its own)."""
    engine.new_session()  # let the previous cache go before the next is built
    session = engine.new_session()
    params = replace(engine.settings.generation, temperature=0.0, max_new_tokens=ANSWER_TOKENS)
    started = time.perf_counter()
    ids = engine.tokenizer.encode_long(text)
    tokenized = time.perf_counter()
    session.conversation.document_ids = ids
    prefix = session.conversation.document_prefix_ids(engine.tokenizer)
    report = session.prefill_document(prefix, planned_tokens=len(prefix) + _HEADROOM)
    document = time.perf_counter()
    save_s = 0.0
    if save:
        report = replace(report, saved=session.save_snapshot())
        save_s = time.perf_counter() - document
    answer = session.ask(PASSKEY_QUESTION, params)
    first = next(answer, "")
    first_at = time.perf_counter()
    text_out = first + "".join(answer)
    return {
        "document_tokens": len(prefix),
        "tokenize_s": tokenized - started,
        "document_s": document - tokenized,
        "first_answer_s": first_at - started - save_s,
        "answer_s": time.perf_counter() - started - save_s,
        "prefilled_tokens": report.prefilled,
        "answer": text_out,
        "passkey_found": answer_is_correct(text_out, PASSKEY),
        "save_s": save_s,
    }, report


def run_snapshot_bench(
    settings: Settings, n_tokens: int, model_spec: str | None = None, log: Log = print
) -> dict:
    """Cold then warm time to the first answer for an `n_tokens` document; JSON-ready."""
    lc = settings.long_context
    if lc.max_seq_len < n_tokens + _HEADROOM:
        lc = replace(lc, max_seq_len=n_tokens + _HEADROOM)
    # Cold: no lookup and no automatic save (the save is timed on its own); warm: a lookup.
    cold_cache = replace(settings.cache, snapshots=True, snapshot_min_tokens=4_194_304)
    warm_cache = replace(cold_cache, snapshot_min_tokens=min(n_tokens // 2, 16_384))
    engine = Engine.load(replace(settings, long_context=lc, cache=cold_cache), model_spec)
    text = make_passkey_document(engine.tokenizer, n_tokens, depth=0.5, passkey=PASSKEY)
    with tempfile.TemporaryDirectory(prefix="kvchat-bench-snapshot-") as folder:
        engine.snapshot_dir = Path(folder)
        cold, saving = _first_answer(engine, text, save=True)
        saved = saving.saved
        assert saved is not None
        save_s = cold.pop("save_s")
        log(
            f"cold: {cold['document_tokens']} tokens prefilled in {cold['document_s']:.1f} s, "
            f"first answer after {cold['first_answer_s']:.2f} s"
        )
        log(f"saved snapshot {saved.id}: {saved.size_bytes / 2**30:.2f} GiB in {save_s:.1f} s")
        engine.new_session()  # the cold cache goes before the warm one is built
        warm_engine = engine.with_settings(replace(engine.settings, cache=warm_cache))
        warm, report = _first_answer(warm_engine, text, save=False)
        warm.pop("save_s")
        if report.restored is None:
            raise RuntimeError(f"the warm run did not load the snapshot: {report.warnings}")
        speedup = cold["first_answer_s"] / warm["first_answer_s"]
        log(
            f"warm: snapshot loaded in {report.restore_seconds:.2f} s, first answer after "
            f"{warm['first_answer_s']:.2f} s: {speedup:.1f}x faster"
        )
    stats = warm_engine.stats()
    return {
        "benchmark": "snapshot",
        "model": stats.model,
        "dtype": stats.dtype,
        "weight_format": stats.weight_format,
        "attention": stats.attention,
        "position_mode": stats.position_mode,
        "long_context": asdict(engine.settings.long_context),
        "threads": stats.threads,
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "torch": torch.__version__,
        "question": PASSKEY_QUESTION,
        "answer_tokens": ANSWER_TOKENS,
        "snapshot": {"bytes": saved.size_bytes, "save_s": save_s, "page_cache": "warm"},
        "cold": cold,
        "warm": warm | {"load_s": report.restore_seconds},
        "same_answer": cold["answer"] == warm["answer"],
        "first_answer_speedup": speedup,
    }
