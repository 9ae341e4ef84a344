"""Block anchors: each type's definition, the DYNAMIC fallback, batch vs single, validation."""

from __future__ import annotations

import pytest
import torch

from kvchat.kv.anchors import (
    ANCHOR_TYPES,
    anchor_dtype,
    anchor_itemsize,
    anchor_rows,
    block_anchors,
    fixed_indices,
    validate_anchor_settings,
)

N_KV_HEADS = 3
BLOCK_SIZE = 16
HEAD_DIM = 64


def _keys(seed: int, *lead: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*lead, N_KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=gen)


def _received(seed: int, *lead: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(*lead, N_KV_HEADS, BLOCK_SIZE, generator=gen)


def _one_hot_keys() -> torch.Tensor:
    """Token t's key is e_t, so a mean of keys shows which tokens it averaged."""
    return torch.eye(BLOCK_SIZE).expand(N_KV_HEADS, BLOCK_SIZE, BLOCK_SIZE)


def test_anchor_rows():
    assert anchor_rows("QUEST") == 2
    for anchor_type in ("DYNAMIC", "FIXED", "BLOCK_MEAN", "BLOCK_MAX"):
        assert anchor_rows(anchor_type) == 1
    with pytest.raises(ValueError, match="unknown anchor_type"):
        anchor_rows("MEDIAN")


@pytest.mark.parametrize(
    ("anchor_type", "anchor_num", "block_size", "message"),
    [
        ("MEDIAN", 1, 16, "unknown anchor_type"),
        ("QUEST", 2, 16, "anchor_num must be 1"),
        ("BLOCK_MEAN", 4, 16, "anchor_num must be 1"),
        ("BLOCK_MAX", 2, 16, "anchor_num must be 1"),
        ("DYNAMIC", 17, 16, "cannot exceed block_size"),
        ("FIXED", 32, 16, "cannot exceed block_size"),
        ("FIXED", 0, 16, "anchor_num must be >= 1"),
        ("DYNAMIC", 1, 0, "block_size must be >= 1"),
    ],
)
def test_validate_rejects(anchor_type, anchor_num, block_size, message):
    with pytest.raises(ValueError, match=message):
        validate_anchor_settings(anchor_type, anchor_num, block_size)


@pytest.mark.parametrize(
    ("anchor_type", "anchor_num"),
    [("DYNAMIC", 16), ("FIXED", 1), ("BLOCK_MEAN", 1), ("BLOCK_MAX", 1), ("QUEST", 1)],
)
def test_validate_accepts(anchor_type, anchor_num):
    validate_anchor_settings(anchor_type, anchor_num, 16)


def test_fixed_indices_are_slice_middles():
    assert fixed_indices(16, 4, torch.device("cpu")).tolist() == [2, 6, 10, 14]
    assert fixed_indices(128, 1, torch.device("cpu")).tolist() == [64]
    assert fixed_indices(8, 8, torch.device("cpu")).tolist() == list(range(8))
    for anchor_num in range(1, 17):
        idx = fixed_indices(16, anchor_num, torch.device("cpu"))
        assert idx.unique().numel() == anchor_num
        assert 0 <= idx.min() and idx.max() < 16


def test_fixed_anchor_averages_spaced_keys():
    anchors = block_anchors(_one_hot_keys(), "FIXED", 4)
    expected = torch.zeros(BLOCK_SIZE)
    expected[[2, 6, 10, 14]] = 0.25
    assert anchors.shape == (N_KV_HEADS, 1, BLOCK_SIZE)
    for head in range(N_KV_HEADS):
        torch.testing.assert_close(anchors[head, 0], expected)


def test_dynamic_picks_top_received_tokens():
    received = _received(1)
    anchors = block_anchors(_one_hot_keys(), "DYNAMIC", 3, received)
    for head in range(N_KV_HEADS):
        top = received[head].argsort(descending=True)[:3]
        assert set(anchors[head, 0].nonzero().flatten().tolist()) == set(top.tolist())

    keys = _keys(2)
    anchors = block_anchors(keys, "DYNAMIC", 3, received)
    for head in range(N_KV_HEADS):
        top = received[head].argsort(descending=True)[:3]
        torch.testing.assert_close(anchors[head, 0], keys[head, top].mean(dim=0))


def test_dynamic_without_attention_falls_back_to_fixed():
    keys = _keys(3)
    fixed = block_anchors(keys, "FIXED", 4)
    torch.testing.assert_close(block_anchors(keys, "DYNAMIC", 4), fixed)
    zeros = torch.zeros(N_KV_HEADS, BLOCK_SIZE)
    torch.testing.assert_close(block_anchors(keys, "DYNAMIC", 4, zeros), fixed)


def test_dynamic_falls_back_per_block_and_head():
    keys = _keys(4, 2)
    received = _received(5, 2)
    received[1, 2] = 0.0
    anchors = block_anchors(keys, "DYNAMIC", 4, received)
    fixed = block_anchors(keys, "FIXED", 4)
    torch.testing.assert_close(anchors[1, 2], fixed[1, 2])
    top = received[0, 2].argsort(descending=True)[:4]
    torch.testing.assert_close(anchors[0, 2, 0], keys[0, 2, top].mean(dim=0))


def test_whole_block_statistics():
    keys = _keys(6)
    torch.testing.assert_close(block_anchors(keys, "BLOCK_MEAN", 1)[:, 0], keys.mean(dim=1))
    torch.testing.assert_close(block_anchors(keys, "BLOCK_MAX", 1)[:, 0], keys.amax(dim=1))
    quest = block_anchors(keys, "QUEST", 1)
    assert quest.shape == (N_KV_HEADS, 2, HEAD_DIM)
    torch.testing.assert_close(quest[:, 0], keys.amin(dim=1))
    torch.testing.assert_close(quest[:, 1], keys.amax(dim=1))


@pytest.mark.parametrize("anchor_type", ANCHOR_TYPES)
def test_batch_matches_single_blocks(anchor_type):
    anchor_num = 4 if anchor_type in ("DYNAMIC", "FIXED") else 1
    keys = _keys(7, 5).to(torch.bfloat16)
    received = _received(8, 5)
    batch = block_anchors(keys, anchor_type, anchor_num, received)
    assert batch.dtype == torch.float32
    assert batch.shape == (5, N_KV_HEADS, anchor_rows(anchor_type), HEAD_DIM)
    for block in range(5):
        single = block_anchors(keys[block], anchor_type, anchor_num, received[block])
        torch.testing.assert_close(batch[block], single)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="3-D or 4-D"):
        block_anchors(torch.zeros(BLOCK_SIZE, HEAD_DIM), "FIXED", 1)
    with pytest.raises(ValueError, match="received must have shape"):
        block_anchors(_keys(9), "DYNAMIC", 2, torch.ones(N_KV_HEADS, BLOCK_SIZE + 1))


def test_key_valued_anchors_are_stored_in_the_keys_dtype():
    for anchor_type in ("QUEST", "BLOCK_MAX"):
        assert anchor_dtype(anchor_type, torch.bfloat16) == torch.bfloat16
        assert anchor_dtype(anchor_type, torch.float32) == torch.float32
        assert anchor_itemsize(anchor_type, 2) == 2
    for anchor_type in ("DYNAMIC", "FIXED", "BLOCK_MEAN"):
        assert anchor_dtype(anchor_type, torch.bfloat16) == torch.float32
        assert anchor_itemsize(anchor_type, 2) == 4
    # Exact: the minimum and maximum of bf16 keys are bf16 keys.
    keys = _keys(9, 5).to(torch.bfloat16)
    for anchor_type in ("QUEST", "BLOCK_MAX"):
        anchors = block_anchors(keys, anchor_type, 1)
        assert torch.equal(anchors.to(torch.bfloat16).float(), anchors)
