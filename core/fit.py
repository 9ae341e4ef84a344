"""Settings sized for a document: the smallest change to long_context under which a context
of n tokens fits this machine, and the largest context any kv_type could hold.

The plan (core/plan.py) says whether a context fits; this module searches it. A fit raises
long_context.max_seq_len to the context (rounded up) and, when the memory asks for it, stores
the blocks more compactly: FP16, then INT8, then INT4, never a less exact type than the one
set.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from kvchat.config import AttentionMode, KvType, LongContextSettings

from .plan import MemoryPlan, PlanRefusedError, gib

# Most exact first: a fit takes the first type, from the one set on, whose plan fits.
KV_TYPES = (KvType.FP16, KvType.INT8, KvType.INT4)
# max_seq_len steps: what `--set` flags and the settings screen show stays readable.
STEP = 4096
# long_context.max_seq_len's largest allowed value (config/schema.py).
MAX_CONTEXT = 4_194_304

PlanAt = Callable[[LongContextSettings, int], MemoryPlan]


def round_up(n: int, step: int = STEP) -> int:
    return -(-n // step) * step


@dataclass(frozen=True)
class Fit:
    """Long-context settings under which a context of `n_tokens` fits."""

    n_tokens: int
    long_context: LongContextSettings
    changes: tuple[tuple[str, object], ...]  # ("long_context.max_seq_len", 524288), ...
    plan: MemoryPlan

    def flags(self) -> str:
        """The `--set` options that apply this fit on the command line."""
        return " ".join(f"--set {key}={value}" for key, value in self.changes)

    def describe(self) -> str:
        """What the fit changes and what the context then needs, in one line."""
        what = {
            "long_context.max_seq_len": lambda v: f"max_seq_len {v:,}",
            "long_context.kv_type": lambda v: f"kv_type {v}",
        }
        changes = ", ".join(what[key](value) for key, value in self.changes)
        p = self.plan
        return (
            f"{changes}: {self.n_tokens:,} tokens then need {gib(p.total_bytes)} in all "
            f"(KV cache {gib(p.kv_bytes)} as {p.kv_type}) of {gib(p.usable_bytes)} usable"
        )


def fit_context(lc: LongContextSettings, n_tokens: int, plan_at: PlanAt) -> Fit | None:
    """The fit for a context of `n_tokens` (prompt and reply); None when `lc` holds it as it
    is. PlanRefusedError when no kv_type fits this machine (or the context passes the largest
    max_seq_len allowed)."""
    if n_tokens > MAX_CONTEXT:
        raise PlanRefusedError(
            f"{n_tokens:,} tokens are more than kvchat holds (long_context.max_seq_len is at "
            f"most {MAX_CONTEXT:,}); load a shorter text."
        )
    max_seq_len = lc.max_seq_len if n_tokens <= lc.max_seq_len else round_up(n_tokens)
    last_plan = None
    for kv_type in _kv_types(lc):
        fitted = replace(lc, max_seq_len=max_seq_len, kv_type=kv_type)
        last_plan = plan_at(fitted, n_tokens)
        if last_plan.fits:
            changes = tuple(
                (f"long_context.{name}", getattr(fitted, name))
                for name in ("max_seq_len", "kv_type")
                if getattr(fitted, name) != getattr(lc, name)
            )
            return Fit(n_tokens, fitted, changes, last_plan) if changes else None
    assert last_plan is not None
    if lc.attention == AttentionMode.DENSE:
        raise PlanRefusedError(
            f"{last_plan.refusal_summary()} with dense attention, which keeps every key. "
            "Use long_context.attention=sparse, load a shorter text or free memory."
        )
    raise PlanRefusedError(
        f"{last_plan.refusal_summary()}, even as {last_plan.kv_type}, the most compact "
        "kv_type. Load a shorter text or free memory."
    )


def largest_context(lc: LongContextSettings, plan_at: PlanAt) -> int:
    """The largest context (a multiple of STEP, at most MAX_CONTEXT) the most compact kv_type
    fits on this machine now: the most a document may hold before a fit is even possible."""
    compact = replace(lc, kv_type=_kv_types(lc)[-1])
    lo, hi = 0, MAX_CONTEXT // STEP
    while lo < hi:  # plans grow with n: the last step that fits
        mid = (lo + hi + 1) // 2
        if plan_at(replace(compact, max_seq_len=mid * STEP), mid * STEP).fits:
            lo = mid
        else:
            hi = mid - 1
    return max(lo * STEP, lc.max_seq_len)


def _kv_types(lc: LongContextSettings) -> tuple[KvType, ...]:
    """The kv_types a fit may choose: the one set and the more compact ones (dense attention
    stores no blocks, so only its own)."""
    if lc.attention == AttentionMode.DENSE:
        return (KvType(lc.kv_type),)
    return KV_TYPES[KV_TYPES.index(KvType(lc.kv_type)) :]
