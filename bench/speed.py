"""`kvchat bench speed`: prefill and decode tok/s of our engine and of baselines, one run.

The baselines (transformers, llama.cpp: bench/baselines.py) run in this process on the same
weights, the same prompt and the same threads, so the ratio between them is meaningful on a
shared, noisy machine even when the absolute numbers wander.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace

import torch

from kvchat.config import AttentionMode, Settings
from kvchat.core.engine import Engine, Session
from kvchat.core.memory import peak_rss, process_rss, reset_peak_rss
from kvchat.native.cpu import cpu_name

from .baselines import BaselineName, load_baseline
from .haystack import make_passkey_document

Log = Callable[[str], None]
# Decode steps run before the clock starts: the first step after a prefill builds the kernels'
# primitives for one-row shapes, and the next ones meet caches that the prefill filled, which
# is not the steady decode speed (after a 128K prefill on a Xeon the first three groups of 8
# steps take 14.6, 12.6 and 12.3 ms a step, the steady ones 10.7-11.8); their rate is reported
# too.
WARMUP_TOKENS = 24
# Rounds of decode_tokens / 4 tokens each side when a context's decode is compared with the
# first context's, interleaved.
INTERLEAVED_ROUNDS = 8


def _prompt_ids(engine: Engine, n_tokens: int) -> list[int]:
    text = make_passkey_document(engine.tokenizer, n_tokens + 64, depth=0.5, passkey=12345)
    return engine.tokenizer.encode(text)[:n_tokens]


def memory_copy_rate(n_bytes: int = 512 * 1024**2, repeats: int = 5) -> float:
    """Bytes per second moved (read + written) by a large tensor copy: the bandwidth a
    memory-bound decode step can hope for on this machine, measured in the same run."""
    src = torch.ones(n_bytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch of the pages
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - started)
    return 2 * n_bytes / best


@dataclass
class _Live:
    """A prefilled session and the token it decodes next."""

    session: Session
    token: int


def _decode(engine: Engine, live: _Live, n_tokens: int) -> tuple[float, int]:
    """Decode `n_tokens` greedily in `live`; returns the seconds and the bytes the steps read."""
    read_bytes = 0
    cache = live.session.cache
    with torch.inference_mode():
        started = time.perf_counter()
        for _ in range(n_tokens):
            read_bytes += cache.decode_read_bytes() + engine.model.decode_read_bytes
            live.token = int(engine.model.forward(torch.tensor([live.token]), cache)[-1].argmax())
    return time.perf_counter() - started, read_bytes


def _prefill(engine: Engine, ids: list[int]) -> tuple[_Live, float]:
    session = Session(engine)
    started = time.perf_counter()
    logits = session.extend(ids)
    return _Live(session, int(logits.argmax())), time.perf_counter() - started


def _bench_ours(engine: Engine, ids: list[int], decode_tokens: int) -> tuple[dict, _Live]:
    """Prefill and decode one context; the session stays alive for the caller to drop."""
    per_context = reset_peak_rss()
    live, prefill_s = _prefill(engine, ids)
    warmup_s, _ = _decode(engine, live, WARMUP_TOKENS)
    decode_s, read_bytes = _decode(engine, live, decode_tokens)
    plan = engine.plan(len(ids) + WARMUP_TOKENS + decode_tokens)
    return {
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": decode_tokens / decode_s,
        # The untimed steps right after the prefill, before the steady rate above.
        "warmup_tok_s": WARMUP_TOKENS / warmup_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        # Bytes a step must read (weights + the KV and anchors it touches) per second of
        # decode: against the machine's copy rate, the fraction of the roofline.
        "decode_bytes_per_token": read_bytes / decode_tokens,
        "decode_read_bytes_per_s": read_bytes / decode_s,
        "attention": live.session.cache.name,
        "position_mode": live.session.cache.position_mode,
        # Whole-process RSS (interpreter and libraries included) against the plan's total.
        # The peak is this context's (from its prefill to its last token) where the OS can
        # reset the peak, else the process's so far (the model loading's, at small contexts).
        "rss_bytes": process_rss(),
        "peak_rss_bytes": peak_rss(),
        "peak_rss_scope": "context" if per_context else "process",
        "plan_total_bytes": plan.total_bytes,
    }, live


def _measure_once(engine: Engine, ids: list[int], decode_tokens: int) -> dict:
    result, live = _bench_ours(engine, ids, decode_tokens)
    live.session.drop_cache()  # the next context's memory is measured without this one
    return result


def _per_round(decode_tokens: int) -> int:
    return max(1, decode_tokens // 4)


def _interleaved_decode(
    engine: Engine, live: _Live, first_ids: list[int], decode_tokens: int
) -> dict[str, float]:
    """Decode rate of `live` against the first context's, in alternating rounds with both
    caches alive: one context decoding after the other minutes apart meets a different
    machine (this shared one's copy rate moves 2x within a run), rounds a second apart the
    same one."""
    first, _ = _prefill(engine, first_ids)
    _decode(engine, first, WARMUP_TOKENS)
    per_round = _per_round(decode_tokens)
    seconds = {"context": 0.0, "first": 0.0}
    for _ in range(INTERLEAVED_ROUNDS):
        seconds["context"] += _decode(engine, live, per_round)[0]
        seconds["first"] += _decode(engine, first, per_round)[0]
    first.session.drop_cache()
    tokens = per_round * INTERLEAVED_ROUNDS
    rates = {k: tokens / s for k, s in seconds.items()}
    return {
        "first_context": len(first_ids),
        "tokens": tokens,
        "decode_tok_s": rates["context"],
        "first_decode_tok_s": rates["first"],
        "ratio": rates["context"] / rates["first"],
    }


def _gib(n: int) -> str:
    return f"{n / 1024**3:.3f}"


def _compare(row: dict, name: str, ours: dict, theirs: dict) -> str:
    """Add a baseline's numbers and our speed-up over it to `row`; return the log text."""
    row[name] = theirs
    ratios = {k: ours[f"{k}_tok_s"] / theirs[f"{k}_tok_s"] for k in ("prefill", "decode")}
    row[f"{name}_ratio"] = ratios
    return (
        f"  | {name} prefill {theirs['prefill_tok_s']:7.1f}  decode {theirs['decode_tok_s']:6.1f}"
        f"  | x{ratios['prefill']:.2f} prefill, x{ratios['decode']:.2f} decode"
    )


def run_speed_bench(
    settings: Settings,
    contexts: list[int],
    model_spec: str | None = None,
    decode_tokens: int = 32,
    baselines: Sequence[BaselineName] = (BaselineName.TRANSFORMERS,),
    compare_dense: Sequence[int] = (),
    log: Log = print,
) -> dict:
    """Measure kvchat (and the `baselines`, and kvchat with dense attention at the sizes in
    `compare_dense`) at every context size; returns a JSON-ready dict with ratios."""
    # A context decodes its own tokens, then as many again and more in the interleaved rounds.
    extra = WARMUP_TOKENS + decode_tokens + INTERLEAVED_ROUNDS * _per_round(decode_tokens)
    longest = max(contexts) + extra + 64
    lc = settings.long_context
    if lc.max_seq_len < longest:
        settings = replace(settings, long_context=replace(lc, max_seq_len=longest))
    engine = Engine.load(settings, model_spec)
    dense = engine.with_settings(
        replace(
            settings, long_context=replace(settings.long_context, attention=AttentionMode.DENSE)
        )
    )
    spec = model_spec or settings.model.path
    others = [load_baseline(name, spec, longest, engine.threads) for name in baselines]
    # The copy rate of a shared machine can read anywhere from 33 to 78 GB/s from one run to
    # the next: it is measured before and after every context, and the roofline is the
    # best of them (what the machine showed it can do in this run).
    copy_rates = [memory_copy_rate()]
    log(f"memory copy rate {copy_rates[0] / 1e9:.1f} GB/s (read + write)")
    first_ids = _prompt_ids(engine, contexts[0])
    rows = []
    for n in contexts:
        ids = _prompt_ids(engine, n)
        ours, live = _bench_ours(engine, ids, decode_tokens)
        row: dict = {"context": n, "kvchat": ours}
        line = (
            f"{n:>7} tokens  kvchat prefill {ours['prefill_tok_s']:7.1f} tok/s  "
            f"decode {ours['decode_tok_s']:6.1f} tok/s "
            f"(the {WARMUP_TOKENS} before {ours['warmup_tok_s']:.1f}; "
            f"{ours['decode_bytes_per_token'] / 1e6:.0f} MB/token, "
            f"{ours['decode_read_bytes_per_s'] / 1e9:.1f} GB/s), peak RSS "
            f"{_gib(ours['peak_rss_bytes'])} / plan {_gib(ours['plan_total_bytes'])} GiB"
        )
        if n != contexts[0]:
            vs = row["decode_vs_first"] = _interleaved_decode(
                engine, live, first_ids, decode_tokens
            )
            line += (
                f"  | decode x{vs['ratio']:.2f} of {contexts[0]}'s, interleaved "
                f"({vs['decode_tok_s']:.1f} / {vs['first_decode_tok_s']:.1f} tok/s)"
            )
        live.session.drop_cache()
        for other in others:
            theirs = other.measure(ids, decode_tokens, WARMUP_TOKENS)
            line += _compare(row, other.name, ours, theirs)
        if n in compare_dense and engine.settings.long_context.attention != AttentionMode.DENSE:
            theirs = _measure_once(dense, ids, decode_tokens)
            line += _compare(row, "dense", ours, theirs)
        log(line)
        rows.append(row)
        copy_rates.append(memory_copy_rate())
    roofline = max(copy_rates)
    for row in rows:
        for name in ("kvchat", "dense"):
            if name in row:
                run = row[name]
                run["decode_roofline_fraction"] = run["decode_read_bytes_per_s"] / roofline
    log(
        f"roofline: the best of {len(copy_rates)} copy rates, {roofline / 1e9:.1f} GB/s "
        f"(lowest {min(copy_rates) / 1e9:.1f}); decode reads at "
        + ", ".join(
            f"{row['context']}: {row['kvchat']['decode_roofline_fraction']:.0%}" for row in rows
        )
        + " of it"
    )
    stats = engine.stats()
    return {
        "benchmark": "speed",
        "model": stats.model,
        "dtype": stats.dtype,
        "weight_format": stats.weight_format,
        "compute": engine.compute_summary(),
        "baselines": [other.name for other in others],
        "attention": stats.attention,
        "long_context": asdict(engine.settings.long_context),
        "threads": stats.threads,
        "machine": {"cpu": cpu_name(), "cores": os.cpu_count()},
        "torch": torch.__version__,
        "memory_copy_bytes_per_s": roofline,
        "memory_copy_samples": copy_rates,
        "weights_read_bytes_per_token": engine.model.decode_read_bytes,
        "decode_tokens": decode_tokens,
        "results": rows,
    }
