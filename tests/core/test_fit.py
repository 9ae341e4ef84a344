"""Settings sized for a document: the fit the planner's own numbers choose, and the largest
context a fit can reach."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvchat.config import AttentionMode, KvType, LongContextSettings
from kvchat.core.fit import MAX_CONTEXT, STEP, fit_context, largest_context
from kvchat.core.plan import PlanRefusedError, plan_memory

from .test_plan import SMOL, SPARSE

GIB = 1024**3
WEIGHTS = 100_000_000


def planner(available: int):
    """plan_at over SmolLM2's shapes with bf16 values and `available` bytes free."""
    return lambda lc, n: plan_memory(SMOL, lc, n, 2, WEIGHTS, available)


def kv_needed(kv_type: KvType, n_tokens: int) -> int:
    """The whole plan at `n_tokens` as `kv_type`: what `available` must beat for it to fit."""
    plan = plan_memory(SMOL, replace(SPARSE, kv_type=kv_type), n_tokens, 2, WEIGHTS, 0)
    return plan.needed_bytes


def between(kv_type: KvType, n_tokens: int, looser: KvType) -> int:
    """Free memory in which `kv_type` holds n_tokens but `looser` does not."""
    low, high = kv_needed(kv_type, n_tokens), kv_needed(looser, n_tokens)
    assert low < high
    return int((low + high) / 2 / 0.85)


def test_a_context_the_settings_hold_needs_no_fit():
    assert fit_context(SPARSE, 4096, planner(64 * GIB)) is None
    # Even where max_seq_len is no multiple of the step the fit rounds to.
    assert fit_context(replace(SPARSE, max_seq_len=1000), 39, planner(64 * GIB)) is None


def test_a_context_past_max_seq_len_raises_it_to_a_round_size():
    fit = fit_context(SPARSE, 150_001, planner(64 * GIB))
    assert fit is not None
    assert fit.changes == (("long_context.max_seq_len", 151_552),)
    assert fit.long_context == replace(SPARSE, max_seq_len=151_552)
    assert fit.flags() == "--set long_context.max_seq_len=151552"
    assert "max_seq_len 151,552" in fit.describe() and "150,001 tokens" in fit.describe()


@pytest.mark.parametrize(
    ("fits", "fails", "expected"),
    [(KvType.INT8, KvType.FP16, KvType.INT8), (KvType.INT4, KvType.INT8, KvType.INT4)],
)
def test_memory_that_needs_compact_blocks_chooses_the_most_exact_type_that_fits(
    fits, fails, expected
):
    n = 1 << 20
    fit = fit_context(SPARSE, n, planner(between(fits, n, fails)))
    assert fit is not None
    assert fit.long_context.kv_type == expected and fit.long_context.max_seq_len == n
    assert fit.changes == (
        ("long_context.max_seq_len", n),
        ("long_context.kv_type", expected),
    )
    assert fit.flags() == (
        f"--set long_context.max_seq_len={n} --set long_context.kv_type={expected}"
    )
    assert fit.plan.fits and fit.plan.kv_type == expected


def test_a_fit_never_takes_a_less_exact_type_than_the_one_set():
    n = 1 << 20
    int4 = replace(SPARSE, kv_type=KvType.INT4)
    fit = fit_context(int4, n, planner(64 * GIB))
    assert fit is not None and fit.long_context.kv_type == KvType.INT4


def test_memory_no_type_fits_is_refused_naming_the_most_compact():
    with pytest.raises(PlanRefusedError) as e:
        fit_context(SPARSE, 1 << 20, planner(GIB))
    assert "even as INT4" in str(e.value) and "1,048,576 tokens need" in str(e.value)


def test_a_context_past_the_largest_max_seq_len_is_refused():
    with pytest.raises(PlanRefusedError, match="at most 4,194,304"):
        fit_context(SPARSE, MAX_CONTEXT + 1, planner(1024 * GIB))


def test_dense_attention_only_raises_max_seq_len():
    dense = replace(SPARSE, attention=AttentionMode.DENSE)
    fit = fit_context(dense, 150_000, planner(64 * GIB))
    assert fit is not None and fit.changes == (("long_context.max_seq_len", 151_552),)
    with pytest.raises(PlanRefusedError, match="with dense attention, which keeps every key"):
        fit_context(dense, 1 << 20, planner(8 * GIB))


@pytest.mark.parametrize("available", [2 * GIB, 8 * GIB, 20 * GIB])
def test_the_largest_context_is_the_last_step_the_most_compact_type_fits(available):
    plan_at = planner(available)
    largest = largest_context(SPARSE, plan_at)
    int4 = replace(SPARSE, kv_type=KvType.INT4)
    assert largest % STEP == 0
    assert plan_at(int4, largest).fits
    assert not plan_at(int4, largest + STEP).fits
    # And a fit exists right up to it.
    fit = fit_context(SPARSE, largest, plan_at)
    assert fit is not None and fit.plan.fits


def test_the_largest_context_never_falls_below_max_seq_len():
    lc = LongContextSettings(max_seq_len=65_536)
    assert largest_context(lc, planner(0)) == 65_536
