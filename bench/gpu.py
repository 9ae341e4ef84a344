"""`kvchat bench gpu`: kernel correctness and long-context speed on a CUDA GPU, as JSON.

Sections, each recorded even when another fails:
1. bandwidth: a device-to-device copy (HBM roofline) and a pinned host-to-device copy (PCIe
   roofline), measured in the same run as everything else;
2. correctness: every Triton kernel against the torch reference on the GPU
   (bench/kernel_checks.py: bf16, fp16 and fp32; every kv_type, anchor type, GQA 1/3/4/8);
3. speed: prefill and decode tok/s at each context size for a Llama-3-8B-shaped model with
   random bf16 weights and for the bundled SmolLM2, with the bytes each decoded token moves
   over HBM and PCIe and their fractions of the measured rooflines.

What the speed numbers measure: see MEASURED (also written into the JSON).

`--dry-run` runs every section on the CPU with tiny shapes and the Triton interpreter, so CI
proves the script runs end to end; its numbers mean nothing.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from kvchat.config import AnchorType, KvType, LongContextSettings, PositionMode, Settings
from kvchat.core.model import Transformer
from kvchat.core.model_config import ModelConfig, RopeScaling
from kvchat.core.model_files import load_weights, resolve_model_path
from kvchat.core.weights import ModelWeights, expected_shapes
from kvchat.kv.kernels import attention_ops
from kvchat.kv.quant import KV_TYPES, bytes_per_token
from kvchat.kv.sparse import SparseBackend
from kvchat.native.cpu import cpu_name

Log = Callable[[str], None]

LLAMA3_8B = ModelConfig(
    architecture="llama",
    vocab_size=128_256,
    hidden_size=4096,
    intermediate_size=14_336,
    num_layers=32,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500_000.0,
    max_position_embeddings=131_072,
    tie_word_embeddings=False,
    rope_scaling=RopeScaling(
        "llama3", factor=8.0, original_max_position_embeddings=8192, high_freq_factor=4.0
    ),
    name="llama-3-8b-shaped (random weights)",
)
# The dry run's stand-in for the 8B model: same family, a few hundred KB.
TINY_LLAMA = replace(
    LLAMA3_8B,
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=8,
    num_kv_heads=2,
    head_dim=32,
    name="tiny-llama (random weights, dry run)",
)
GPU_CONTEXTS = (32_768, 131_072, 1_048_576)
DRY_CONTEXTS = (256, 512)
# Share of available host memory the block store may take when kv_type is chosen.
HOST_STORE_SHARE = 0.4
# A 1M-token prefill of an 8B model does not fit in minutes, so most of each context is filled.
MEASURED = (
    "Each context N: the engine's block-sparse cache (kv/sparse, the long_context settings, "
    "Triton kernels, native positions) has its store filled by SparseBackend.fill_random with "
    "random K/V of the model's shape in the chosen kv_type (quantized by the append kernel, "
    "anchors computed from the stored keys, the local window reloaded from the store) up to "
    "N - prefill_tokens; the last prefill_tokens are prefilled through the model "
    "(prefill_tok_s); then decode_tokens greedy tokens are decoded (decode_tok_s, after 2 "
    "untimed tokens). DYNAMIC anchors run as FIXED (a random fill has no attention statistics; "
    "the same scoring cost). Not modelled: CUDA graphs. Bytes per decoded token: HBM = weights "
    "+ the cache's decode_read_bytes (local window, sinks, selected blocks, anchors scanned) + "
    "tier bytes written; PCIe = blocks copied into the tier (misses). Roofline fractions divide "
    "bytes/token x tok/s by the device copy rate (bytes read + written per second) and the "
    "pinned host-to-device rate measured in this run."
)


class GpuRequiredError(RuntimeError):
    """The benchmark was asked to run on a GPU and there is none."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- measurements ------------------------------------------------------------------------------
def measure_bandwidth(device: torch.device, copy_bytes: int, h2d_bytes: int, repeats: int) -> dict:
    """Device copy rate (bytes read + written per second) and pinned host-to-device rate."""
    src = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    _sync(device)
    copy_s = time.perf_counter() - started
    del src, dst
    pinned = device.type == "cuda"
    host = torch.ones(h2d_bytes, dtype=torch.uint8, pin_memory=pinned)
    target = torch.empty(h2d_bytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=pinned)
    _sync(device)
    started = time.perf_counter()
    for _ in range(repeats):
        target.copy_(host, non_blocking=pinned)
    _sync(device)
    h2d_s = time.perf_counter() - started
    return {
        "device_copy_gbs": 2 * copy_bytes * repeats / copy_s / 1e9,
        "h2d_gbs": h2d_bytes * repeats / h2d_s / 1e9,
        "h2d_pinned": pinned,
        "copy_bytes": copy_bytes,
        "h2d_bytes": h2d_bytes,
        "repeats": repeats,
    }


def random_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, seed: int = 0
) -> Transformer:
    """A model of cfg's shape with N(0, 0.02) weights made on the device (the embedding table
    stays on the CPU, as the model keeps it)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(cfg).items():
        if len(shape) == 1:
            t = torch.ones(shape, dtype=dtype, device=device)
        else:
            t = torch.randn(shape, generator=gen, dtype=dtype, device=device).mul_(0.02)
        tensors[name] = t.cpu() if name == "model.embed_tokens.weight" else t
    weights = ModelWeights(config=cfg, tensors=tensors, int4={}, source=Path(cfg.name), metadata={})
    return Transformer(weights, dtype=dtype, device=device)


def choose_kv_type(
    cfg: ModelConfig, itemsize: int, max_tokens: int, wanted: str, budget: int
) -> str:
    """The most precise kv_type, from `wanted` down, whose store for max_tokens fits budget."""
    order = KV_TYPES[KV_TYPES.index(wanted) :]
    for kv_type in order:
        if _store_bytes(cfg, kv_type, max_tokens, itemsize) <= budget:
            return kv_type
    return order[-1]


def _store_bytes(cfg: ModelConfig, kv_type: str, tokens: int, itemsize: int) -> int:
    return (
        2
        * cfg.num_layers
        * cfg.num_kv_heads
        * bytes_per_token(cfg.head_dim, kv_type, itemsize)
        * tokens
    )


def bench_model(
    model: Transformer,
    label: str,
    lc: LongContextSettings,
    contexts: tuple[int, ...],
    prefill_tokens: int,
    decode_tokens: int,
    bandwidth: dict,
    ops_backend: str,
    deadline: float,
    log: Log,
) -> dict:
    """Fill, prefill a slice and decode at each context (see MEASURED). Contexts are rounded
    up to whole blocks and run in increasing order, each filled on top of the previous one; the
    prefill slice is at most half a context and starts after the previous context's tokens."""
    cfg, device, block = model.cfg, model.device, lc.block_size
    contexts = tuple(sorted({max(2 * block, -(-c // block) * block) for c in contexts}))
    warmup = 2
    geom = model.cache_geometry(max(contexts) + warmup + decode_tokens)
    cache = SparseBackend(geom, model.rope, lc, PositionMode.NATIVE, ops_backend)
    weights = model.decode_read_bytes  # the embedding row it counts is read on the host
    gen = torch.Generator().manual_seed(0)
    runs = []
    fill_rate = None  # tokens per second of the last fill, to foresee the next one
    for context in contexts:
        stored = cache.stats().blocks_in_dram * block
        start = max(context - min(prefill_tokens, context // 2 // block * block), stored)
        prefill = context - start
        to_fill = start - stored
        foreseen = 0.0 if fill_rate is None else 1.5 * to_fill / fill_rate
        if time.perf_counter() + foreseen > deadline:
            runs.append({"context": context, "skipped": "time budget"})
            log(f"  {context:>8} tokens: skipped (the time budget would be spent)")
            continue
        row: dict = {
            "context": context,
            "random_fill_tokens": start,
            "prefill_tokens": prefill,
        }
        started = time.perf_counter()
        cache.fill_random(start, seed=context)
        _sync(device)
        row["fill_s"] = time.perf_counter() - started
        fill_rate = max(to_fill, 1) / row["fill_s"]
        ids = torch.randint(0, cfg.vocab_size, (prefill,), generator=gen)
        started = time.perf_counter()
        with torch.inference_mode():
            for lo in range(0, prefill, cache.max_chunk):
                logits = model.forward(ids[lo : lo + cache.max_chunk], cache)
        _sync(device)
        row["prefill_s"] = time.perf_counter() - started
        row["prefill_tok_s"] = prefill / row["prefill_s"]
        token = int(logits[-1].argmax())
        kv_read = 0
        with torch.inference_mode():
            for _ in range(warmup):
                token = int(model.forward(torch.tensor([token]), cache)[-1].argmax())
            before = cache.stats()
            started = time.perf_counter()
            for _ in range(decode_tokens):
                kv_read += cache.decode_read_bytes()
                token = int(model.forward(torch.tensor([token]), cache)[-1].argmax())
            decode_s = time.perf_counter() - started
        after = cache.stats()
        tok_s = decode_tokens / decode_s
        kv_bytes = kv_read / decode_tokens
        pcie = (after.bytes_moved - before.bytes_moved) / decode_tokens
        hbm = weights + kv_bytes + pcie  # missed blocks are also written into the tier
        lookups = after.hits + after.misses - before.hits - before.misses
        row.update(
            decode_tokens=decode_tokens,
            decode_s=decode_s,
            decode_tok_s=tok_s,
            hbm_bytes_per_token=hbm,
            hbm_weight_bytes_per_token=weights,
            hbm_kv_bytes_per_token=kv_bytes,
            pcie_bytes_per_token=pcie,
            hbm_roofline_fraction=hbm * tok_s / (bandwidth["device_copy_gbs"] * 1e9),
            pcie_roofline_fraction=pcie * tok_s / (bandwidth["h2d_gbs"] * 1e9),
            tier_hit_rate=(after.hits - before.hits) / lookups if lookups else 0.0,
            store_bytes=_store_bytes(cfg, lc.kv_type, context, model.dtype.itemsize),
        )
        log(
            f"  {context:>8} tokens: fill {row['fill_s']:.1f}s, prefill {row['prefill_tok_s']:.0f} "
            f"tok/s, decode {tok_s:.1f} tok/s, {hbm / 1e6:.1f} MB HBM + {pcie / 1e6:.2f} MB PCIe "
            f"per token ({row['hbm_roofline_fraction']:.0%} / {row['pcie_roofline_fraction']:.0%} "
            f"of roofline), tier hits {row['tier_hit_rate']:.0%}"
        )
        runs.append(row)
    return {
        "model": label,
        "dtype": str(model.dtype).removeprefix("torch."),
        "kv_type": lc.kv_type,
        "weight_bytes": weights,
        "cache": {
            "block_size": block,
            "local_windows_len": lc.local_windows_len,
            "second_select_num": lc.second_select_num,
            "chunk_size": lc.chunk_size,
            "anchor_type": lc.anchor_type,
            "device_slots_per_layer": cache.stats().device_slots_total // cfg.num_layers,
        },
        "runs": runs,
    }


def _section(report: dict, name: str, log: Log, work: Callable[[], object]) -> object:
    """Run one section; an exception is recorded in the report and the run goes on."""
    try:
        return work()
    except Exception as e:  # one broken section must not cost the whole GPU run
        log(f"{name}: FAILED: {e!r}")
        report["errors"].append(
            {"section": name, "error": repr(e), "traceback": traceback.format_exc()}
        )
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return None


def run_gpu_bench(
    settings: Settings,
    dry_run: bool = False,
    contexts: tuple[int, ...] | None = None,
    decode_tokens: int = 32,
    budget_s: float = 420.0,
    log: Log = print,
) -> dict:
    """Every section on the GPU (or, dry_run, on the CPU with tiny shapes); a JSON-ready dict."""
    began = time.perf_counter()
    deadline = began + budget_s
    if dry_run:
        _require_interpreter()
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            raise GpuRequiredError(
                "`kvchat bench gpu` needs a CUDA GPU; use --dry-run to try it on a CPU"
            )
        device, dtype = torch.device("cuda"), torch.bfloat16
    ops = attention_ops(device, backend="triton")
    report: dict = {
        "benchmark": "gpu",
        "dry_run": dry_run,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "cuda": torch.version.cuda,
        "errors": [],
        "measured": MEASURED,
    }
    mode = " (dry run: CPU, Triton interpreter, tiny shapes)" if dry_run else ""
    log(f"bench gpu on {report['device']}{mode}")
    mib = 1 << 20
    bandwidth = _section(
        report,
        "bandwidth",
        log,
        lambda: measure_bandwidth(
            device,
            16 * mib if dry_run else 1024 * mib,
            16 * mib if dry_run else 512 * mib,
            3 if dry_run else 10,
        ),
    )
    report["bandwidth"] = bandwidth
    if bandwidth:
        log(
            f"bandwidth: device copy {bandwidth['device_copy_gbs']:.0f} GB/s, "
            f"host->device {bandwidth['h2d_gbs']:.1f} GB/s"
        )

    def correctness() -> dict:
        from kvchat.bench.kernel_checks import run_all

        dtypes = [torch.float32] if dry_run else [torch.bfloat16, torch.float16, torch.float32]
        results = run_all(ops, device, dtypes, large=not dry_run)
        failed = [r for r in results if not r.passed]
        for r in failed:
            log(f"  FAIL {r.kernel} [{r.case}]: {r.max_abs_err:.3g} > {r.tolerance:.3g}")
        log(f"correctness: {len(results) - len(failed)}/{len(results)} checks passed")
        return {
            "passed": len(results) - len(failed),
            "failed": len(failed),
            "results": [r.as_dict() for r in results],
        }

    report["correctness"] = _section(report, "correctness", log, correctness)
    lc = settings.long_context
    report["models"] = []
    if bandwidth is None:
        return _finish(report, began)
    for plan in _model_plans(dry_run, contexts):

        def run_one(plan: ModelPlan = plan) -> dict:
            started = time.perf_counter()
            model = plan.build(dtype, device)
            log(f"{plan.label}: built in {time.perf_counter() - started:.1f}s")
            cache_lc = _cache_settings(
                lc, dry_run, model.cfg, model.dtype.itemsize, max(plan.contexts), plan.kv_type
            )
            try:
                result = bench_model(
                    model, plan.label, cache_lc, plan.contexts,
                    64 if dry_run else 2 * cache_lc.chunk_size, 2 if dry_run else decode_tokens,
                    bandwidth, plan.ops, deadline, log,
                )  # fmt: skip
            finally:
                del model
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            return {**result, "ops": plan.ops}

        result = _section(report, plan.label, log, run_one)
        if result is not None:
            report["models"].append(result)
    return _finish(report, began)


@dataclass(frozen=True)
class ModelPlan:
    label: str
    build: Callable[[torch.dtype, torch.device], Transformer]
    kv_type: str | None  # None: the most precise that fits in host memory
    contexts: tuple[int, ...]
    ops: str  # kv.kernels backend


def _model_plans(dry_run: bool, contexts: tuple[int, ...] | None) -> list[ModelPlan]:
    def smollm(dtype: torch.dtype, device: torch.device) -> Transformer:
        return Transformer(
            load_weights(resolve_model_path("smollm2-135m")), dtype=dtype, device=device
        )

    def tiny(dtype: torch.dtype, device: torch.device) -> Transformer:
        return random_model(TINY_LLAMA, dtype, device)

    def llama_8b(dtype: torch.dtype, device: torch.device) -> Transformer:
        return random_model(LLAMA3_8B, dtype, device)

    smollm_label = "smollm2-135m (bundled GGUF)"
    if dry_run:
        # The tiny model runs the kernels in the interpreter, on a quantized store (the
        # dequantizing paths are the ones that matter on a GPU); SmolLM2's 30 layers would
        # take minutes there, so its dry run drives the same harness with the torch ops.
        return [
            ModelPlan(TINY_LLAMA.name, tiny, KvType.INT4, contexts or DRY_CONTEXTS, "triton"),
            ModelPlan(smollm_label, smollm, KvType.INT8, (contexts or DRY_CONTEXTS)[:1], "torch"),
        ]
    return [
        ModelPlan(LLAMA3_8B.name, llama_8b, None, contexts or GPU_CONTEXTS, "triton"),
        ModelPlan(smollm_label, smollm, None, contexts or GPU_CONTEXTS, "triton"),
    ]


def _cache_settings(
    lc: LongContextSettings,
    dry_run: bool,
    cfg: ModelConfig,
    itemsize: int,
    max_context: int,
    kv_override: str | None,
) -> LongContextSettings:
    """The user's long_context settings, with the kv_type that fits in host memory (or the
    plan's), FIXED for DYNAMIC anchors (a random fill has no attention statistics) and, for
    the dry run, a tiny window and budget."""
    anchor_type = AnchorType.FIXED if lc.anchor_type == AnchorType.DYNAMIC else lc.anchor_type
    if dry_run:
        return replace(
            lc,
            anchor_type=anchor_type,
            kv_type=kv_override or KvType.FP16,
            block_size=32,
            local_windows_len=64,
            second_select_num=2,
            chunk_size=32,
        )
    budget = int(HOST_STORE_SHARE * psutil.virtual_memory().available)
    kv_type = kv_override or choose_kv_type(cfg, itemsize, max_context, lc.kv_type, budget)
    return replace(lc, anchor_type=anchor_type, kv_type=kv_type)


def _finish(report: dict, began: float) -> dict:
    report["elapsed_s"] = time.perf_counter() - began
    report["host"] = {"cores": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total}
    return report


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


def _require_interpreter() -> None:
    """The dry run needs Triton's interpreter, which is chosen when a kernel is defined."""
    loaded = [m for m in sys.modules if m.startswith("kvchat.kv.triton.")]
    if os.environ.get("TRITON_INTERPRET") != "1":
        if loaded:
            raise RuntimeError(
                "the dry run needs TRITON_INTERPRET=1 before kvchat's kernels are imported; "
                "run it in a fresh process"
            )
        os.environ["TRITON_INTERPRET"] = "1"
