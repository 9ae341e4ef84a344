"""`kvchat bench speed`: prefill and decode tok/s of our engine and of transformers, one run.

Both run in this process on the same weights and the same prompt, so the ratio between them
is meaningful on a shared, noisy machine even when the absolute numbers wander.
"""

from __future__ import annotations

import os
import platform
import resource
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace

import psutil
import torch

from kvchat.config import Settings

from .engine import Engine
from .haystack import make_passkey_document
from .weights import resolve_model_path

Log = Callable[[str], None]
# Decode steps run before the clock starts: the first step after a prefill builds the kernels'
# primitives for one-row shapes and meets cold caches, which is not the steady decode speed.
WARMUP_TOKENS = 2


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


def _bench_ours(
    engine: Engine, ids: list[int], decode_tokens: int, copy_rate: float
) -> dict[str, float]:
    session = engine.new_session()
    started = time.perf_counter()
    logits = session.extend(ids)
    prefill_s = time.perf_counter() - started
    token = int(logits.argmax())
    read_bytes = 0
    with torch.inference_mode():
        for step in range(WARMUP_TOKENS + decode_tokens):
            if step == WARMUP_TOKENS:
                started = time.perf_counter()
            if step >= WARMUP_TOKENS:
                read_bytes += session.cache.decode_read_bytes() + engine.model.decode_read_bytes
            token = int(engine.model.forward(torch.tensor([token]), session.cache)[-1].argmax())
    decode_s = time.perf_counter() - started
    plan = engine.plan(len(ids) + WARMUP_TOKENS + decode_tokens)
    result = {
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": decode_tokens / decode_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
        # The decode roofline: bytes a step must read (weights + the KV and anchors it
        # touches) at the measured copy rate, against the time it took.
        "decode_bytes_per_token": read_bytes / decode_tokens,
        "decode_roofline_fraction": read_bytes / decode_s / copy_rate,
        "attention": session.cache.name,
        "position_mode": session.cache.position_mode,
        # Whole-process RSS (interpreter and libraries included) against the plan's total;
        # the peak is the process's so far, which is this context's when contexts ascend.
        "rss_bytes": psutil.Process().memory_info().rss,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "plan_total_bytes": plan.total_bytes,
    }
    session.drop_cache()  # the next context's memory is measured without this one
    return result


def _load_transformers(spec: str):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(spec)
    if path.is_dir():
        return AutoModelForCausalLM.from_pretrained(path).eval()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name).eval()


def _bench_transformers(model, ids: list[int], decode_tokens: int) -> dict[str, float]:
    with torch.inference_mode():
        started = time.perf_counter()
        out = model(torch.tensor([ids]), use_cache=True)
        prefill_s = time.perf_counter() - started
        past = out.past_key_values
        token = out.logits[0, -1].argmax().view(1, 1)
        for step in range(WARMUP_TOKENS + decode_tokens):
            if step == WARMUP_TOKENS:
                started = time.perf_counter()
            out = model(token, past_key_values=past, use_cache=True)
            past = out.past_key_values
            token = out.logits[0, -1].argmax().view(1, 1)
        decode_s = time.perf_counter() - started
    return {
        "prefill_tok_s": len(ids) / prefill_s,
        "decode_tok_s": decode_tokens / decode_s,
        "prefill_s": prefill_s,
        "decode_s": decode_s,
    }


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
    with_transformers: bool = True,
    compare_dense: Sequence[int] = (),
    log: Log = print,
) -> dict:
    """Measure kvchat (and transformers, and kvchat with dense attention at the sizes in
    `compare_dense`) at every context size; returns a JSON-ready dict with ratios."""
    longest = max(contexts) + WARMUP_TOKENS + decode_tokens + 64
    lc = settings.long_context
    if lc.max_seq_len < longest:
        settings = replace(settings, long_context=replace(lc, max_seq_len=longest))
    engine = Engine.load(settings, model_spec)
    dense = engine.with_settings(
        replace(settings, long_context=replace(settings.long_context, attention="dense"))
    )
    hf = _load_transformers(model_spec or settings.model.path) if with_transformers else None
    copy_rate = memory_copy_rate()
    log(f"memory copy rate {copy_rate / 1e9:.1f} GB/s (read + write), the decode roofline")
    rows = []
    for n in contexts:
        ids = _prompt_ids(engine, n)
        ours = _bench_ours(engine, ids, decode_tokens, copy_rate)
        row: dict = {"context": n, "kvchat": ours}
        line = (
            f"{n:>7} tokens  kvchat prefill {ours['prefill_tok_s']:7.1f} tok/s  "
            f"decode {ours['decode_tok_s']:6.1f} tok/s "
            f"({ours['decode_bytes_per_token'] / 1e6:.0f} MB/token, "
            f"{ours['decode_roofline_fraction']:.0%} of roofline)"
        )
        if hf is not None:
            line += _compare(row, "transformers", ours, _bench_transformers(hf, ids, decode_tokens))
        if n in compare_dense and engine.settings.long_context.attention != "dense":
            theirs = _bench_ours(dense, ids, decode_tokens, copy_rate)
            line += _compare(row, "dense", ours, theirs)
        log(line)
        rows.append(row)
    stats = engine.stats()
    return {
        "benchmark": "speed",
        "model": stats.model,
        "dtype": stats.dtype,
        "weight_format": stats.weight_format,
        "attention": stats.attention,
        "long_context": asdict(engine.settings.long_context),
        "threads": stats.threads,
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "torch": torch.__version__,
        "memory_copy_bytes_per_s": copy_rate,
        "weights_read_bytes_per_token": engine.model.decode_read_bytes,
        "decode_tokens": decode_tokens,
        "results": rows,
    }
