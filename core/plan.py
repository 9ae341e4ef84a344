"""Memory planning: what a context of n tokens needs, and whether this machine has it.

The numbers follow the caches' own allocations (kv/dense.py, kv/sparse/, kv/quant.py), so
the Engine can check a plan before any prefill and an accepted prompt never ends in an
out-of-memory kill halfway through.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvchat.config import AttentionMode, KvType, LongContextSettings
from kvchat.kv.anchors import anchor_itemsize, anchor_rows
from kvchat.kv.pinning import gathered_blocks
from kvchat.kv.quant import bytes_per_token
from kvchat.kv.sparse import window_capacity

from .errors import UserError
from .memory import available_memory
from .model_config import ModelConfig

# Leave room for the OS, the UI and allocator slack.
USABLE_FRACTION = 0.85
# Kernel scratch, thread pools and malloc arenas a long prefill leaves behind, beyond the
# runtime measured at load: ~40 MiB over the cache itself for a 1M-token run
# (tests/kv/test_million.py); for SmolLM2 at 128K after 4K, 32K and dense 32K sessions in the
# same process (`kvchat bench speed`), the held memory ends 22 MiB over the plan's other terms
# and the last chunk's temporaries reach 142 MiB of its 145 MiB activation term: a peak 19 MiB
# over what 64 MiB here would plan.
RUNTIME_BYTES = 128 * 1024**2
# The prompt's token ids as Python lists (the conversation's, the session's, the pass's):
# a 28-byte int object each, shared, plus an 8-byte slot in each list.
TOKEN_ID_BYTES = 64
PLAN_SIZES = (4096, 32768, 65536, 131072, 524288, 1048576)


class PlanRefusedError(UserError, ValueError):
    """A prompt exceeds the configured context or this machine's memory; says what to change."""


@dataclass(frozen=True)
class MemoryPlan:
    n_tokens: int
    attention: AttentionMode
    kv_type: str
    weights_bytes: int
    kv_bytes: int  # keys and values: the DRAM block store (sparse) or the whole cache (dense)
    anchor_bytes: int
    resident_bytes: int  # kept on the compute device: sinks, local window, gather buffers
    activation_bytes: int  # transient tensors of one prefill chunk, token ids, runtime scratch
    available_bytes: int  # host memory available now
    allocated_bytes: int = 0  # already held by the current cache
    runtime_bytes: int = 0  # the process besides weights and cache: interpreter, libraries

    @property
    def cache_bytes(self) -> int:
        return self.kv_bytes + self.anchor_bytes + self.resident_bytes

    @property
    def total_bytes(self) -> int:
        """The whole process's memory at this context size (what its RSS should stay under)."""
        return self.runtime_bytes + self.weights_bytes + self.cache_bytes + self.activation_bytes

    @property
    def needed_bytes(self) -> int:
        """Memory still to be allocated (the weights are loaded already)."""
        return max(self.cache_bytes - self.allocated_bytes, 0) + self.activation_bytes

    @property
    def usable_bytes(self) -> float:
        return self.available_bytes * USABLE_FRACTION

    @property
    def fits(self) -> bool:
        return self.needed_bytes <= self.usable_bytes

    def refusal_summary(self) -> str:
        return (
            f"{self.n_tokens:,} tokens need {gib(self.needed_bytes)} more memory (KV cache "
            f"{gib(self.kv_bytes)} as {self.kv_type}) but only {gib(self.usable_bytes)} is "
            "usable"
        )

    def refusal(self) -> str:
        return (
            f"{self.refusal_summary()}. Shorten the document, use a smaller "
            "long_context.kv_type (INT8, INT4), or lower long_context.max_seq_len."
        )


class ModelTooLargeError(PlanRefusedError):
    """A model whose weights, as they would be held, and a first context do not fit the memory
    available: refused before any tensor is read. Carries the plan's figures for a report."""

    def __init__(
        self, message: str, cfg: ModelConfig, weights: dict[str, int], itemsize: int
    ) -> None:
        super().__init__(message)
        self.cfg, self.weights, self.itemsize = cfg, weights, itemsize


def weights_line(weights: dict[str, int]) -> str:
    """Bytes by format as `kvchat plan` prints them: "int8 0.47 GiB, bfloat16 0.25 GiB"."""
    return ", ".join(f"{kind} {gib(n)}" for kind, n in weights.items())


def check_model_fits(
    cfg: ModelConfig,
    lc: LongContextSettings,
    itemsize: int,
    weights: dict[str, int],
    runtime_bytes: int,
) -> None:
    """ModelTooLargeError unless the weights (bytes by format, core/weight_plan.py) and a
    first prefill chunk's context fit the memory available now."""
    n = min(lc.chunk_size, lc.max_seq_len)
    total = sum(weights.values())
    p = plan_memory(cfg, lc, n, itemsize, total, available_memory(), 0, runtime_bytes)
    if total + p.needed_bytes > p.usable_bytes:
        raise ModelTooLargeError(
            f"{cfg.name or cfg.architecture} needs {gib(total)} for its weights as loaded "
            f"({weights_line(weights)}) and {gib(p.needed_bytes)} for a first {n:,}-token "
            f"context, but only {gib(p.usable_bytes)} of memory is usable now; free memory or "
            + (
                "run it in bfloat16 (model.dtype: auto), which keeps the file's quantized layers"
                if itemsize == 4
                else "choose a smaller model or a lower-bit quantization of it"
            ),
            cfg,
            weights,
            itemsize,
        )


def gib(n: float) -> str:
    """A byte count as GiB with two decimals, as the plan's messages and tables show it."""
    return f"{n / 1024**3:.2f} GiB"


def plan_memory(
    cfg: ModelConfig,
    lc: LongContextSettings,
    n_tokens: int,
    itemsize: int,
    weights_bytes: int,
    available_bytes: int,
    allocated_bytes: int = 0,
    runtime_bytes: int = 0,
) -> MemoryPlan:
    layers, kv_heads, dim = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    qkv = (cfg.num_heads + 2 * kv_heads) * dim
    activation = (
        RUNTIME_BYTES
        + TOKEN_ID_BYTES * n_tokens
        + 4 * lc.chunk_size * (4 * cfg.hidden_size + 3 * cfg.intermediate_size + 3 * qkv)
    )
    if lc.attention == AttentionMode.DENSE:
        kv = n_tokens * 2 * layers * kv_heads * dim * itemsize
        return MemoryPlan(
            n_tokens,
            AttentionMode.DENSE,
            {2: "BF16", 4: "FP32"}[itemsize],
            weights_bytes,
            kv,
            0,
            0,
            activation,
            available_bytes,
            allocated_bytes,
            runtime_bytes,
        )
    blocks = -(-n_tokens // lc.block_size)
    per_block = lc.block_size * bytes_per_token(dim, lc.kv_type, itemsize)
    kv = blocks * layers * 2 * kv_heads * per_block
    anchor_size = anchor_itemsize(lc.anchor_type, itemsize)
    anchors = blocks * layers * kv_heads * anchor_rows(lc.anchor_type) * dim * anchor_size
    # Window keys (twice in extrapolate mode), values, attention received, sinks.
    window = layers * kv_heads * window_capacity(lc) * (3 * dim * itemsize + 4)
    sinks = layers * 2 * kv_heads * lc.block_size * dim * itemsize
    gather = gather_bytes(lc, kv_heads, dim, n_tokens, itemsize)
    return MemoryPlan(
        n_tokens,
        AttentionMode.SPARSE,
        lc.kv_type,
        weights_bytes,
        kv,
        anchors,
        window + sinks + gather,
        activation,
        available_bytes,
        allocated_bytes,
        runtime_bytes,
    )


def gather_bytes(
    lc: LongContextSettings, n_kv_heads: int, head_dim: int, n_tokens: int, itemsize: int
) -> int:
    """The host buffers stored blocks are gathered into, keys and values: a layer's selection,
    every block for dense layers, and a question's vote over the stored keys."""
    blocks = -(-n_tokens // lc.block_size)
    selected = lc.second_select_num
    if lc.dense_layer_num > 0:
        selected = max(selected, blocks)
    gathered = max(selected, gathered_blocks(lc, blocks))
    return 2 * n_kv_heads * gathered * lc.block_size * head_dim * itemsize


def plan_table(
    cfg: ModelConfig,
    lc: LongContextSettings,
    itemsize: int,
    weights_bytes: int,
    runtime_bytes: int = 0,
) -> str:
    """The `kvchat plan` report: memory by context size, then which kv_type fits 1M tokens."""
    available = available_memory()
    lines = [
        f"{cfg.name or cfg.architecture}: {cfg.num_layers} layers, {cfg.num_kv_heads} KV heads x "
        f"{cfg.head_dim}, weights {gib(weights_bytes)}, runtime {gib(runtime_bytes)} "
        f"(interpreter, libraries, tokenizer; in the totals); attention {lc.attention}, "
        f"kv_type {lc.kv_type}, block {lc.block_size}, window {lc.local_windows_len}, "
        f"select {lc.second_select_num}",
        f"host memory available now: {gib(available)} (plans may use {USABLE_FRACTION:.0%} of it)",
        "",
        f"{'tokens':>9} {'KV (DRAM)':>11} {'anchors':>10} {'resident':>10} {'weights':>10} "
        f"{'total':>10}  fits",
    ]
    for n in PLAN_SIZES:
        p = plan_memory(cfg, lc, n, itemsize, weights_bytes, available, runtime_bytes=runtime_bytes)
        lines.append(
            f"{n:>9} {gib(p.kv_bytes):>11} {gib(p.anchor_bytes):>10} "
            f"{gib(p.resident_bytes):>10} {gib(p.weights_bytes):>10} {gib(p.total_bytes):>10}  "
            f"{'yes' if p.total_bytes <= available * USABLE_FRACTION else 'NO'}"
        )
    if lc.attention == AttentionMode.SPARSE:
        lines += ["", f"at {PLAN_SIZES[-1]} tokens, by long_context.kv_type:"]
        for kv_type in KvType:
            p = plan_memory(
                cfg,
                replace(lc, kv_type=kv_type),
                PLAN_SIZES[-1],
                itemsize,
                weights_bytes,
                available,
                runtime_bytes=runtime_bytes,
            )
            verdict = "fits" if p.total_bytes <= available * USABLE_FRACTION else "does not fit"
            lines.append(f"  {kv_type:<5} total {gib(p.total_bytes):>10}  {verdict}")
    return "\n".join(lines) + "\n"
