"""With a budget that covers every block, the block-sparse cache must equal dense attention."""

from __future__ import annotations

import pytest
import torch

from .conftest import dense_cache, run, small_settings, sparse_cache

PROMPT = 700  # 21 blocks of 32: sinks, ~15 candidates, the window and a partial block
DECODE = 70  # crosses block boundaries, so generated blocks leave the window too
FULL = 10_000  # second_select_num larger than any candidate count
TOL = 1e-3


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def reference(tiny, ids):
    return {chunk: run(tiny, dense_cache(tiny), ids, chunk, DECODE) for chunk in (64, 200)}


@pytest.mark.parametrize("anchor_type", ["DYNAMIC", "FIXED", "BLOCK_MEAN", "BLOCK_MAX", "QUEST"])
@pytest.mark.parametrize("mode", ["SHARED", "SEPARATE"])
@pytest.mark.parametrize("pinned", [0, 2])
def test_full_budget_equals_dense(tiny, ids, reference, anchor_type, mode, pinned):
    # The prompt's last pass (60 tokens) is shorter than a chunk, so with pinned_blocks its
    # layers vote, and the pins lead every selection of the decode.
    settings = small_settings(
        second_select_num=FULL,
        pinned_blocks=pinned,
        anchor_type=anchor_type,
        head_select_mode=mode,
        dense_layer_num=0,
    )
    got = run(tiny, sparse_cache(tiny, settings), ids, 64, DECODE)
    assert (got - reference[64]).abs().max().item() < TOL


@pytest.mark.parametrize("chunk", [64, 200])
def test_full_budget_any_chunk_size_and_reuse_steps(tiny, ids, reference, chunk):
    settings = small_settings(
        second_select_num=FULL, chunk_size=chunk, dense_layer_num=2, layer_step=2, token_step=3
    )
    got = run(tiny, sparse_cache(tiny, settings), ids, chunk, DECODE)
    assert (got - reference[chunk]).abs().max().item() < TOL


def test_dense_layers_only_equals_dense(tiny, ids, reference):
    # Every layer dense (dense_layer_num >= layers) attends to everything whatever the budget.
    settings = small_settings(second_select_num=1, dense_layer_num=4)
    got = run(tiny, sparse_cache(tiny, settings), ids, 64, DECODE)
    assert (got - reference[64]).abs().max().item() < TOL


def test_small_budget_differs_but_stays_close_to_dense(tiny, ids, reference):
    # A real check that selection is active: with 2 of ~15 blocks the logits move.
    settings = small_settings(second_select_num=2, dense_layer_num=0)
    cache = sparse_cache(tiny, settings)
    got = run(tiny, cache, ids, 64, DECODE)
    assert (got - reference[64]).abs().max().item() > TOL
    selected = cache.stats().layers[1].selected
    assert 0 < len(selected) <= 2
