"""`kvchat bench prefill`: what a prefill chunk costs, part by part, against this machine's peak.

One run measures: the matrix-product peak of this machine in fp32, and in bf16 where the CPU
multiplies bf16 in hardware (torch's oneDNN picks AMX, AVX512-BF16 or AVX2 FMA), on the
model's own projection shapes at `chunk_size` rows; a real prefill of a `context`-token
document, each part of its chunks timed on the engine's own objects (the projections; RoPE,
block writes, the pinning vote and the attention pass inside the cache's `attend`; the rest of
the layer); the projections' and the attention's achieved FLOP/s; and the rate the prefill
would reach with the projections and the attention at that peak and every other part as
measured.

The attention's FLOPs are counted from the keys a query attends (its chunk causally, the
window, the sink block and the selected blocks: 4 FLOPs a key and head dimension for QK and
PV); its pass also merges the partial attentions, which the count leaves out.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from kvchat.config import AttentionMode, Settings
from kvchat.core.engine import Engine, Session
from kvchat.native.cpu import cpu_level, cpu_name, widened_products

from .speed import _prompt_ids

Log = Callable[[str], None]
PEAK_REPEATS = 5
LAYER_PROJECTIONS = ("qkv", "o", "gate_up", "down")

# The parts a chunk's time is split into, in the order they are reported.
PROJECTIONS, ROPE, BLOCK_WRITES, VOTE, ATTENTION, REST = (
    "projections",
    "rope",
    "block_writes",
    "vote",
    "attention_pass",
    "rest",
)


def gemm_flops(rows: int, shapes: list[tuple[int, int]], dtype: torch.dtype) -> dict[str, float]:
    """FLOP/s of x [rows, k] @ w [k, n] for each (k, n), the best of PEAK_REPEATS."""
    rates = {}
    for k, n in shapes:
        x, w = torch.randn(rows, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        torch.matmul(x, w)  # oneDNN builds its primitive on the first call
        best = float("inf")
        for _ in range(PEAK_REPEATS):
            started = time.perf_counter()
            torch.matmul(x, w)
            best = min(best, time.perf_counter() - started)
        rates[f"{k}x{n}"] = 2 * rows * k * n / best
    return rates


class _Clock:
    """Seconds and FLOPs per part, added up by wrappers around the engine's own callables."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.flops: dict[str, float] = defaultdict(float)
        self._undo: list[Callable[[], None]] = []

    def wrap(self, owner: object, name: str, part: str) -> None:
        inner = getattr(owner, name)
        had_own = name in vars(owner)

        def timed(*args: Any) -> Any:
            started = time.perf_counter()
            out = inner(*args)
            self.seconds[part] += time.perf_counter() - started
            return out

        setattr(owner, name, timed)
        self._undo.append(
            (lambda: setattr(owner, name, inner)) if had_own else (lambda: delattr(owner, name))
        )

    def undo(self) -> None:
        for step in reversed(self._undo):
            step()
        self._undo.clear()


class _TimedLinear:
    """A layer's projection, timed: 2 FLOPs per input row, input and output feature."""

    def __init__(self, inner: Callable[[torch.Tensor], torch.Tensor], clock: _Clock) -> None:
        self.inner, self.clock = inner, clock

    def __getattr__(self, name: str) -> Any:  # nbytes, out_features: the layer's own
        return getattr(self.inner, name)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        started = time.perf_counter()
        out = self.inner(x)
        self.clock.seconds[PROJECTIONS] += time.perf_counter() - started
        self.clock.flops[PROJECTIONS] += 2 * x.shape[0] * x.shape[-1] * out.shape[-1]
        return out


def _attention_flops(engine: Engine, context: int) -> float:
    """FLOPs of the attention of a `context`-token prefill: per chunk, each query's keys (half
    its chunk on average, the window and sink before it, the selected blocks once there are
    enough) times 4 x head_dim x query heads, over the sparse layers and the dense ones."""
    cfg, lc = engine.config, engine.settings.long_context
    chunk, total = lc.chunk_size, 0.0
    for start in range(0, context, chunk):
        n = min(chunk, context - start)
        window = min(lc.local_windows_len, start)
        far = start - window
        sink = min(lc.block_size, far)
        selected = min(lc.second_select_num * lc.block_size, max(0, far - sink))
        sparse_keys = (n + 1) / 2 + window + sink + selected
        dense_keys = (n + 1) / 2 + start
        per_key = 4 * cfg.head_dim * cfg.num_heads * n
        dense_layers = min(lc.dense_layer_num, cfg.num_layers)
        if lc.attention == AttentionMode.DENSE:
            dense_layers = cfg.num_layers
        total += per_key * (
            dense_layers * dense_keys + (cfg.num_layers - dense_layers) * sparse_keys
        )
    return total


def run_prefill_bench(
    settings: Settings, contexts: list[int], model_spec: str | None, log: Log
) -> dict[str, Any]:
    """The peak, then for each context the parts of its prefill and its rate at the peak."""
    engine = Engine.load(settings, model_spec)
    lc, cfg = engine.settings.long_context, engine.config
    layer = engine.model.layers[0]
    shapes = [
        (cfg.hidden_size, layer.qkv.out_features),
        (cfg.num_heads * cfg.head_dim, layer.o.out_features),
        (cfg.hidden_size, layer.gate_up.out_features),
        (cfg.intermediate_size, layer.down.out_features),
    ]
    log(f"matrix-product peak on the projection shapes {shapes} at {lc.chunk_size} rows")
    # bf16 only where the CPU multiplies it in hardware: elsewhere torch emulates it at ~1% of
    # fp32's rate (a minute a shape), and kvchat multiplies widened values instead.
    dtypes = [torch.float32]
    if not widened_products(engine.model.device, torch.bfloat16):
        dtypes.insert(0, torch.bfloat16)
    peaks = {
        str(dtype).removeprefix("torch."): gemm_flops(lc.chunk_size, shapes, dtype)
        for dtype in dtypes
    }
    for name, rates in peaks.items():
        log(f"  {name}: " + ", ".join(f"{s} {r / 1e9:.0f}" for s, r in rates.items()) + " GFLOP/s")
    peak = max(rate for rates in peaks.values() for rate in rates.values())
    result = {
        "benchmark": "prefill",
        "model": cfg.name or engine.source.name,
        "cpu": cpu_name(),
        "cpu_level": cpu_level().value,
        "threads": torch.get_num_threads(),
        "chunk_size": lc.chunk_size,
        "attention": lc.attention.value,
        "kv_type": lc.kv_type.value,
        "weights": engine.weight_format,
        "projection_shapes": shapes,
        "peak_flops": peaks,
        "peak": peak,
        "runs": [],
    }
    for context in contexts:
        log(f"prefill of {context:,} tokens, each part timed")
        run = _timed_prefill(engine, _prompt_ids(engine, context), peak)
        result["runs"].append(run)
        for line in _run_lines(run):
            log(line)
    return result


def _timed_prefill(engine: Engine, ids: list[int], peak: float) -> dict[str, Any]:
    clock, attend_clock = _Clock(), _Clock()
    session = Session(engine)
    session.prepare(len(ids) + 1)
    cache = session.cache
    layers = engine.model.layers
    for lay in layers:
        for name in LAYER_PROJECTIONS:
            setattr(lay, name, _TimedLinear(getattr(lay, name), clock))
    for owner, name, part in _cache_parts(cache):
        clock.wrap(owner, name, part)
    attend_clock.wrap(cache, "attend", "attend")
    try:
        started = time.perf_counter()
        session.extend(ids)
        wall = time.perf_counter() - started
    finally:
        clock.undo()
        attend_clock.undo()
        for lay in layers:
            for name in LAYER_PROJECTIONS:
                setattr(lay, name, getattr(lay, name).inner)
        session.drop_cache()
    inside = sum(clock.seconds[p] for p in (ROPE, BLOCK_WRITES, VOTE, ATTENTION))
    seconds = {
        PROJECTIONS: clock.seconds[PROJECTIONS],
        ROPE: clock.seconds[ROPE],
        BLOCK_WRITES: clock.seconds[BLOCK_WRITES],
        VOTE: clock.seconds[VOTE],
        # The pass, and the rest of the cache's attend step (window writes, bookkeeping).
        ATTENTION: clock.seconds[ATTENTION] + attend_clock.seconds["attend"] - inside,
    }
    seconds[REST] = max(0.0, wall - sum(seconds.values()))
    flops = {PROJECTIONS: clock.flops[PROJECTIONS], ATTENTION: _attention_flops(engine, len(ids))}
    at_peak = sum(flops.values()) / peak + sum(s for p, s in seconds.items() if p not in flops)
    parts = {}
    for part, s in seconds.items():
        parts[part] = {"seconds": s, "share": s / wall}
        if part in flops and s:
            rate = flops[part] / s
            parts[part].update(flops=flops[part], flops_per_s=rate, of_peak=rate / peak)
    return {
        "context": len(ids),
        "prefill_seconds": wall,
        "prefill_tok_s": len(ids) / wall,
        "parts": parts,
        "tok_s_at_peak": len(ids) / at_peak,
    }


def _cache_parts(cache: Any) -> list[tuple[object, str, str]]:
    """The cache's callables a prefill chunk's attention step is made of, where it has them."""
    parts = [(cache, "_rotate", ROPE), (cache, "store_blocks", BLOCK_WRITES)]
    selector, path = getattr(cache, "selector", None), getattr(cache, "path", None)
    if selector is not None:
        parts.append((selector, "vote", VOTE))
    if path is not None:
        parts.append((path, "prefill", ATTENTION))
    return [(owner, name, part) for owner, name, part in parts if hasattr(owner, name)]


def summary(result: dict[str, Any]) -> list[str]:
    """The result in a few lines, for the log."""
    lines = [
        f"{result['model']} on {result['cpu']} ({result['cpu_level']}, {result['threads']} "
        f"threads), chunks of {result['chunk_size']}; peak {result['peak'] / 1e9:.0f} GFLOP/s"
    ]
    for run in result["runs"]:
        lines += _run_lines(run)
    return lines


def _run_lines(run: dict[str, Any]) -> list[str]:
    lines = [f"{run['context']:,} tokens: {run['prefill_tok_s']:.0f} tok/s"]
    for part, p in run["parts"].items():
        rate = ""
        if "flops" in p:
            rate = f", {p['flops_per_s'] / 1e9:.0f} GFLOP/s ({p['of_peak']:.0%} of peak)"
        lines.append(f"  {part}: {p['seconds']:.2f} s, {p['share']:.0%}{rate}")
    lines.append(
        f"  with the projections and the attention at the peak, the rest as measured: "
        f"{run['tok_s_at_peak']:.0f} tok/s"
    )
    return lines
