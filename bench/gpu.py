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

from kvchat.config import LongContextSettings, Settings
from kvchat.core.model import Transformer
from kvchat.core.model_config import ModelConfig, RopeScaling
from kvchat.core.weights import ModelWeights, expected_shapes, load_weights, resolve_model_path
from kvchat.kv.anchors import anchor_dtype, anchor_rows, block_anchors
from kvchat.kv.backend import check_capacity
from kvchat.kv.cuda_tier import DeviceBlockTier
from kvchat.kv.kernels import AttentionOps, attention_ops
from kvchat.kv.positions import RopeTables, rotate
from kvchat.kv.quant import KV_TYPES, BlockPool, bytes_per_token
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
    "Each context N: the block store is filled with random K/V of the model's shape in the "
    "chosen kv_type (quantized by the append kernel, anchors computed from those keys, the local "
    "window reloaded from the store) up to N - prefill_tokens; the last prefill_tokens are "
    "prefilled through the model (prefill_tok_s: attention to the local window, the sink block "
    "and the selected blocks; completed blocks quantized into the host store); then "
    "decode_tokens greedy tokens are decoded (decode_tok_s, after 2 untimed tokens). The cache "
    "is bench/gpu.py's FilledSparseCache, a benchmark fixture and not the engine's "
    "SparseBackend: block store in host DRAM, a device block tier (LRU, 2 selections per layer) "
    "in front of it, top second_select_num blocks per layer by anchor score (SHARED), Triton "
    "kernels. Not modelled: dense layers, preselection, layer_step / token_step reuse, DYNAMIC "
    "attention statistics (DYNAMIC runs as FIXED with one anchor per block: the same scoring "
    "cost), CUDA graphs. Bytes per decoded token: HBM = weights + local window, sink and "
    "selected-block bytes read + anchors scanned + tier bytes written; PCIe = blocks copied into "
    "the tier (misses). Roofline fractions divide bytes/token x tok/s by the device copy rate "
    "(bytes read + written per second) and the pinned host-to-device rate measured in this run."
)


class GpuRequiredError(RuntimeError):
    """The benchmark was asked to run on a GPU and there is none."""


@dataclass(frozen=True)
class CacheShape:
    """The block-sparse cache's shape for the benchmark (from long_context settings)."""

    block: int
    window: int
    select: int
    chunk: int
    anchor_type: str
    kv_type: str

    @property
    def window_capacity(self) -> int:
        return self.window + 2 * self.block + self.chunk


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class FilledSparseCache:
    """A block-sparse cache whose store can be filled with random K/V (see the module doc).

    Per layer: host BlockPools for K and V (pageable: misses go through the tier's pinned
    staging buffer, and pinning a whole store would round every pool up to a power of two),
    anchors (in kv.anchors.anchor_dtype), a full-precision local window and the sink block on
    the device. Every layer selects the top `select` blocks (SHARED) among those before the
    window by anchor score, fetches them through a DeviceBlockTier and runs one
    sparse_attention kernel.

    It implements the pass protocol of AttentionBackend that Transformer.forward drives
    (begin / attend / commit, length, max_chunk) and nothing else: a benchmark never
    truncates, saves or reloads it.
    """

    name = "bench-sparse"
    position_mode = "native"

    def __init__(
        self,
        cfg: ModelConfig,
        rope: RopeTables,
        dtype: torch.dtype,
        device: torch.device,
        ops: AttentionOps,
        shape: CacheShape,
        max_tokens: int,
    ) -> None:
        self.cfg, self.rope, self.dtype, self.device, self.ops = cfg, rope, dtype, device, ops
        self.shape = shape
        self.max_tokens = max_tokens
        self.max_chunk = shape.chunk
        n_kv, dim, block = cfg.num_kv_heads, cfg.head_dim, shape.block
        self.max_blocks = -(-max_tokens // block)
        n_slots = n_kv * self.max_blocks
        rows = anchor_rows(shape.anchor_type)
        win = (n_kv, shape.window_capacity, dim)
        self.k_pools = [
            BlockPool(n_slots, block, dim, shape.kv_type, dtype) for _ in range(cfg.num_layers)
        ]
        self.v_pools = [
            BlockPool(n_slots, block, dim, shape.kv_type, dtype) for _ in range(cfg.num_layers)
        ]
        anchors_dtype = anchor_dtype(shape.anchor_type, dtype)
        self.anchors = [
            torch.zeros(self.max_blocks, n_kv, rows, dim, dtype=anchors_dtype, device=device)
            for _ in self.k_pools
        ]
        self.win_k = [torch.zeros(win, dtype=dtype, device=device) for _ in self.k_pools]
        self.win_v = [torch.zeros(win, dtype=dtype, device=device) for _ in self.k_pools]
        self.sink_k = [
            torch.zeros(n_kv, block, dim, dtype=dtype, device=device) for _ in self.k_pools
        ]
        self.sink_v = [
            torch.zeros(n_kv, block, dim, dtype=dtype, device=device) for _ in self.k_pools
        ]
        # Room for two selections per layer, so blocks kept from one step to the next hit.
        self.tier = DeviceBlockTier(
            self.k_pools, self.v_pools, 2 * n_kv * max(shape.select, 1), device
        )
        self._head_base = torch.arange(n_kv).unsqueeze(1) * self.max_blocks
        self._block_ids = torch.arange(self.max_blocks, device=device)
        self._length = self._n_new = self._n_stored = self._win_base = 0
        self._cos = self._sin = torch.empty(0)
        self.hbm_read_bytes = 0  # KV, anchor and sink bytes the attention of decode steps read

    @property
    def length(self) -> int:
        return self._length

    @property
    def stored_tokens(self) -> int:
        """Tokens whose blocks are in the store (the rest are only in the local window)."""
        return self._n_stored * self.shape.block

    # -- the random fill ---------------------------------------------------------------------
    def fill_random(self, upto: int, seed: int, blocks_per_step: int = 1024) -> None:
        """Store random K/V for every block from the current end up to token `upto` (a block
        boundary), then reload the local window from the store as the engine does."""
        block = self.shape.block
        if upto % block or upto < self._n_stored * block or upto > self.max_tokens:
            raise ValueError(f"cannot fill up to {upto}: not a block boundary past the stored end")
        gen = torch.Generator(device=self.device).manual_seed(seed)
        n_kv, dim = self.cfg.num_kv_heads, self.cfg.head_dim
        first, last = self._n_stored, upto // block
        for layer in range(self.cfg.num_layers):
            for b0 in range(first, last, blocks_per_step):
                b1 = min(b0 + blocks_per_step, last)
                shape = (n_kv, b1 - b0, block, dim)
                k = torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)
                v = torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)
                self._store(layer, b0, k, v)
        self._n_stored = last
        self._length = upto
        self.tier.invalidate()
        self._reload_window()

    def _store(self, layer: int, b0: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write blocks b0.. of every KV head (k, v [n_kv, n, block, D] on the device) to the
        host store, and their anchors (and the sink copy for block 0) on the device."""
        n_kv, n, block, dim = k.shape
        if b0 == 0:
            self.sink_k[layer].copy_(k[:, 0])
            self.sink_v[layer].copy_(v[:, 0])
        anchors = block_anchors(k.transpose(0, 1), self.shape.anchor_type, 1)
        self.anchors[layer][b0 : b0 + n] = anchors
        kv_type = self.shape.kv_type
        for values, pools in ((k, self.k_pools), (v, self.v_pools)):
            # Quantize on the device into a staging pool, then copy each head's contiguous
            # run of rows into the host store: one device-to-host pass over the bytes.
            staging = BlockPool(n_kv * n, block, dim, kv_type, self.dtype, self.device)
            ids = torch.arange(n_kv * n, device=self.device)
            self.ops.write_blocks(staging, ids, values.reshape(n_kv * n, block, dim))
            host = pools[layer].storage
            for h in range(n_kv):
                lo = h * self.max_blocks + b0
                host[lo : lo + n].copy_(staging.storage[h * n : (h + 1) * n])

    def _reload_window(self) -> None:
        start = self._window_start(self._length)
        block, n_kv, dim = self.shape.block, self.cfg.num_kv_heads, self.cfg.head_dim
        first, last = start // block, self._length // block
        n = (last - first) * block
        slots = (self._head_base + torch.arange(first, last)).reshape(-1)
        out = torch.empty(len(slots), block, dim, dtype=self.dtype)
        for layer in range(self.cfg.num_layers):
            # Random keys stand for keys already rotated at their positions.
            for pool, win in (
                (self.k_pools[layer], self.win_k[layer]),
                (self.v_pools[layer], self.win_v[layer]),
            ):
                win[:, :n] = pool.gather(slots, out).view(n_kv, n, dim).to(self.device)
        self._win_base = start

    def _window_start(self, length: int) -> int:
        return max(0, (length - self.shape.window) // self.shape.block * self.shape.block)

    # -- a pass ------------------------------------------------------------------------------
    def begin(self, n_new: int) -> None:
        check_capacity(self._length + n_new, self.max_tokens)
        if n_new > self.shape.chunk:
            raise ValueError(f"a pass of {n_new} tokens exceeds the chunk size {self.shape.chunk}")
        start = self._window_start(self._length)
        if self._length + n_new - self._win_base > self.shape.window_capacity:
            keep, src = self._length - start, start - self._win_base
            for buf in (*self.win_k, *self.win_v):
                buf[:, :keep] = buf[:, src : src + keep].clone()
            self._win_base = start
        self._n_new = n_new
        self._cos, self._sin = self.rope.cos_sin(self._length, n_new, self.dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        n, block = self._n_new, self.shape.block
        qa, ka = rotate(q, self._cos, self._sin), rotate(k, self._cos, self._sin)
        o = self._length - self._win_base
        win_k, win_v = self.win_k[layer], self.win_v[layer]
        win_k[:, o : o + n] = ka
        win_v[:, o : o + n] = v
        complete = (self._length + n) // block
        if complete > self._n_stored:
            lo, hi = self._n_stored * block - self._win_base, complete * block - self._win_base
            shape = (self.cfg.num_kv_heads, complete - self._n_stored, block, self.cfg.head_dim)
            self._store(
                layer,
                self._n_stored,
                win_k[:, lo:hi].reshape(shape),
                win_v[:, lo:hi].reshape(shape),
            )
        window_start = self._window_start(self._length)
        ws = window_start - self._win_base
        n_cand = window_start // block - 1  # blocks before the window, minus the sink
        tier_slots = None
        if n_cand > 0 and self.shape.select > 0:
            cand = self._block_ids[1 : 1 + n_cand]
            scores = self.ops.score_blocks(
                qa.float().mean(dim=1), self.anchors[layer], self.shape.anchor_type, "SHARED", cand
            )
            chosen = cand[self.ops.select_top(scores, self.shape.select)].cpu()
            tier_slots = self.tier.fetch(layer, self._head_base + chosen)
        sinks = window_start >= block
        sink_k = self.sink_k[layer] if sinks else self.sink_k[layer][:, :0]
        sink_v = self.sink_v[layer] if sinks else self.sink_v[layer][:, :0]
        out, _ = self.ops.sparse_attention(
            qa, qa, win_k[:, ws : o + n], win_v[:, ws : o + n], sink_k, sink_v,
            self.tier.k, self.tier.v, tier_slots, True,
        )  # fmt: skip
        self.tier.release(layer)
        if n == 1:
            itemsize = self.dtype.itemsize
            n_kv, dim = self.cfg.num_kv_heads, self.cfg.head_dim
            selected = 0 if tier_slots is None else tier_slots.numel()
            self.hbm_read_bytes += (
                2 * n_kv * dim * itemsize * (o + n - ws + sink_k.shape[1])
                + selected * self.tier.bytes_per_block
                + max(n_cand, 0) * self.anchors[layer][0].nbytes
            )
        return out

    def commit(self) -> None:
        self._length += self._n_new
        self._n_stored = self._length // self.shape.block
        self._n_new = 0


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
    shape: CacheShape,
    contexts: tuple[int, ...],
    prefill_tokens: int,
    decode_tokens: int,
    bandwidth: dict,
    ops: AttentionOps,
    deadline: float,
    log: Log,
) -> dict:
    """Fill, prefill a slice and decode at each context (see MEASURED). Contexts are rounded
    up to whole blocks and run in increasing order, each filled on top of the previous one; the
    prefill slice is at most half a context and starts after the previous context's tokens."""
    cfg, device, block = model.cfg, model.device, shape.block
    contexts = tuple(sorted({max(2 * block, -(-c // block) * block) for c in contexts}))
    warmup = 2
    cache = FilledSparseCache(
        cfg, model.rope, model.dtype, device, ops, shape, max(contexts) + warmup + decode_tokens
    )
    weights = model.decode_read_bytes  # the embedding row it counts is read on the host
    gen = torch.Generator().manual_seed(0)
    runs = []
    fill_rate = None  # tokens per second of the last fill, to foresee the next one
    for context in contexts:
        stored = cache.stored_tokens
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
            for lo in range(0, prefill, shape.chunk):
                logits = model.forward(ids[lo : lo + shape.chunk], cache)
        _sync(device)
        row["prefill_s"] = time.perf_counter() - started
        row["prefill_tok_s"] = prefill / row["prefill_s"]
        token = int(logits[-1].argmax())
        with torch.inference_mode():
            for _ in range(warmup):
                token = int(model.forward(torch.tensor([token]), cache)[-1].argmax())
            before, read_before = cache.tier.stats(), cache.hbm_read_bytes
            started = time.perf_counter()
            for _ in range(decode_tokens):
                token = int(model.forward(torch.tensor([token]), cache)[-1].argmax())
            decode_s = time.perf_counter() - started
        after = cache.tier.stats()
        tok_s = decode_tokens / decode_s
        kv_bytes = (cache.hbm_read_bytes - read_before) / decode_tokens
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
            store_bytes=_store_bytes(cfg, shape.kv_type, context, model.dtype.itemsize),
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
        "kv_type": shape.kv_type,
        "weight_bytes": weights,
        "cache": {
            "block_size": shape.block,
            "local_windows_len": shape.window,
            "second_select_num": shape.select,
            "chunk_size": shape.chunk,
            "anchor_type": shape.anchor_type,
            "tier_slots_per_layer": cache.tier.slots_per_layer,
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
            shape = _cache_shape(
                lc, dry_run, model.cfg, model.dtype.itemsize, max(plan.contexts), plan.kv_type
            )
            try:
                result = bench_model(
                    model, plan.label, shape, plan.contexts,
                    64 if dry_run else 2 * shape.chunk, 2 if dry_run else decode_tokens,
                    bandwidth, attention_ops(device, backend=plan.ops), deadline, log,
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
            ModelPlan(TINY_LLAMA.name, tiny, "INT4", contexts or DRY_CONTEXTS, "triton"),
            ModelPlan(smollm_label, smollm, "INT8", (contexts or DRY_CONTEXTS)[:1], "torch"),
        ]
    return [
        ModelPlan(LLAMA3_8B.name, llama_8b, None, contexts or GPU_CONTEXTS, "triton"),
        ModelPlan(smollm_label, smollm, None, contexts or GPU_CONTEXTS, "triton"),
    ]


def _cache_shape(
    lc: LongContextSettings,
    dry_run: bool,
    cfg: ModelConfig,
    itemsize: int,
    max_context: int,
    kv_override: str | None,
) -> CacheShape:
    # DYNAMIC anchors need the attention blocks received; a random fill has none, so they are
    # FIXED anchors (the same scoring cost). anchor_num is 1 (scoring cost does not depend on it).
    anchor_type = "FIXED" if lc.anchor_type == "DYNAMIC" else lc.anchor_type
    if dry_run:
        return CacheShape(32, 64, 2, 32, anchor_type, kv_override or "FP16")
    budget = int(HOST_STORE_SHARE * psutil.virtual_memory().available)
    kv_type = kv_override or choose_kv_type(cfg, itemsize, max_context, lc.kv_type, budget)
    return CacheShape(
        block=lc.block_size,
        window=lc.local_windows_len,
        select=lc.second_select_num,
        chunk=lc.chunk_size,
        anchor_type=anchor_type,
        kv_type=kv_type,
    )


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
