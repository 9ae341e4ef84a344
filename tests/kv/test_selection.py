"""Block scoring, top-k selection and the prefill preselection vote, on seeded tensors."""

from __future__ import annotations

import math
import time

import pytest
import torch

from kvchat.kv.anchors import ANCHOR_TYPES, block_anchors
from kvchat.kv.selection import HEAD_SELECT_MODES, preselect_vote, score_blocks, select_top

N_HEADS = 9
N_KV_HEADS = 3
GROUP = N_HEADS // N_KV_HEADS
HEAD_DIM = 64
BLOCK_SIZE = 16
N_BLOCKS = 256
# Planted keys get this norm; random keys have norm ~sqrt(HEAD_DIM) = 8.
PLANT_NORM = 48.0


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _anchor_num(anchor_type: str) -> int:
    return 4 if anchor_type in ("DYNAMIC", "FIXED") else 1


def _random_keys(seed: int, n_blocks: int = N_BLOCKS) -> torch.Tensor:
    return torch.randn(n_blocks, N_KV_HEADS, BLOCK_SIZE, HEAD_DIM, generator=_gen(seed))


def _plant(keys: torch.Tensor, block: int, kv_head: int, direction: torch.Tensor, seed: int):
    """Make every key of (block, kv_head) point along `direction`, with a little noise."""
    unit = direction / direction.norm()
    noise = 0.1 * torch.randn(BLOCK_SIZE, HEAD_DIM, generator=_gen(seed))
    keys[block, kv_head] = PLANT_NORM * unit + noise


def _group_direction(q: torch.Tensor, kv_head: int) -> torch.Tensor:
    """The direction that the query heads sharing kv_head agree on (their sum)."""
    return q.view(N_KV_HEADS, GROUP, -1)[kv_head].reshape(-1, q.shape[-1]).sum(dim=0)


def _anchors(keys: torch.Tensor, anchor_type: str) -> torch.Tensor:
    received = torch.rand(keys.shape[:-1], generator=_gen(99))
    return block_anchors(keys, anchor_type, _anchor_num(anchor_type), received)


def _brute_scores(q: torch.Tensor, anchors: torch.Tensor, anchor_type: str) -> torch.Tensor:
    """Per query head and block, straight from the definitions: [n_heads, n_blocks]."""
    group = q.shape[0] // anchors.shape[1]
    scores = torch.empty(q.shape[0], anchors.shape[0])
    for head in range(q.shape[0]):
        rows = anchors[:, head // group]
        if anchor_type == "QUEST":
            bound = torch.maximum(q[head] * rows[:, 0], q[head] * rows[:, 1])
            scores[head] = bound.sum(dim=-1)
        else:
            scores[head] = rows[:, 0] @ q[head]
    return scores


@pytest.mark.parametrize("mode", HEAD_SELECT_MODES)
@pytest.mark.parametrize("anchor_type", ANCHOR_TYPES)
def test_planted_block_ranks_first(anchor_type, mode):
    q = torch.randn(N_HEADS, HEAD_DIM, generator=_gen(1))
    keys = _random_keys(2)
    planted = 137
    for kv_head in range(N_KV_HEADS):
        _plant(keys, planted, kv_head, _group_direction(q, kv_head), seed=3 + kv_head)
    scores = score_blocks(q, _anchors(keys, anchor_type), anchor_type, mode)
    top = select_top(scores, 1)
    if mode == "SHARED":
        assert scores.shape == (N_BLOCKS,)
        assert top.tolist() == [planted]
    else:
        assert scores.shape == (N_KV_HEADS, N_BLOCKS)
        assert top.tolist() == [[planted]] * N_KV_HEADS


@pytest.mark.parametrize("anchor_type", ANCHOR_TYPES)
def test_separate_heads_select_their_own_blocks(anchor_type):
    q = torch.randn(N_HEADS, HEAD_DIM, generator=_gen(4))
    keys = _random_keys(5)
    planted = [11, 200, 42]
    for kv_head, block in enumerate(planted):
        _plant(keys, block, kv_head, _group_direction(q, kv_head), seed=6 + kv_head)
    anchors = _anchors(keys, anchor_type)
    separate = select_top(score_blocks(q, anchors, anchor_type, "SEPARATE"), 1)
    assert separate.flatten().tolist() == planted
    shared = select_top(score_blocks(q, anchors, anchor_type, "SHARED"), 3)
    assert shared.tolist() == sorted(planted)


@pytest.mark.parametrize("anchor_type", ANCHOR_TYPES)
def test_scores_match_definitions(anchor_type):
    q = torch.randn(N_HEADS, HEAD_DIM, generator=_gen(7))
    anchors = _anchors(_random_keys(8, 40), anchor_type)
    per_head = _brute_scores(q, anchors, anchor_type)
    separate = score_blocks(q, anchors, anchor_type, "SEPARATE")
    shared = score_blocks(q, anchors, anchor_type, "SHARED")
    torch.testing.assert_close(separate, per_head.view(N_KV_HEADS, GROUP, -1).sum(dim=1))
    torch.testing.assert_close(shared, per_head.sum(dim=0), rtol=1e-5, atol=1e-3)


def test_quest_bounds_the_true_max():
    keys = _random_keys(9, 64)
    anchors = block_anchors(keys, "QUEST", 1)
    # One query head per KV head: each score bounds that head's own max q.k.
    q = torch.randn(N_KV_HEADS, HEAD_DIM, generator=_gen(10))
    scores = score_blocks(q, anchors, "QUEST", "SEPARATE")
    true_max = torch.einsum("hd,nhtd->hnt", q, keys).amax(dim=-1)
    assert (scores >= true_max - 1e-4).all()
    # Grouped heads: the summed bounds bound the max of the summed scores.
    q = torch.randn(N_HEADS, HEAD_DIM, generator=_gen(11))
    scores = score_blocks(q, anchors, "QUEST", "SEPARATE")
    summed_q = q.view(N_KV_HEADS, GROUP, HEAD_DIM).sum(dim=1)
    true_max = torch.einsum("hd,nhtd->hnt", summed_q, keys).amax(dim=-1)
    assert (scores >= true_max - 1e-4).all()


def test_low_precision_query_is_accepted():
    q = torch.randn(N_HEADS, HEAD_DIM, generator=_gen(12))
    anchors = _anchors(_random_keys(13, 8), "BLOCK_MEAN")
    scores = score_blocks(q.to(torch.bfloat16), anchors, "BLOCK_MEAN", "SEPARATE")
    assert scores.dtype == torch.float32
    torch.testing.assert_close(
        scores, score_blocks(q, anchors, "BLOCK_MEAN", "SEPARATE"), rtol=0.02, atol=0.1
    )


def test_score_blocks_rejects_bad_inputs():
    q = torch.randn(N_HEADS, HEAD_DIM)
    anchors = torch.zeros(4, N_KV_HEADS, 1, HEAD_DIM)
    with pytest.raises(ValueError, match="head select mode"):
        score_blocks(q, anchors, "FIXED", "PER_HEAD")
    with pytest.raises(ValueError, match="R=2"):
        score_blocks(q, anchors, "QUEST", "SHARED")
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        score_blocks(torch.randn(8, HEAD_DIM), anchors, "FIXED", "SHARED")
    with pytest.raises(ValueError, match="head_dim=32"):
        score_blocks(torch.randn(N_HEADS, 32), anchors, "FIXED", "SHARED")


def test_no_candidate_blocks():
    q = torch.randn(N_HEADS, HEAD_DIM)
    anchors = torch.zeros(0, N_KV_HEADS, 2, HEAD_DIM)
    assert score_blocks(q, anchors, "QUEST", "SHARED").shape == (0,)
    scores = score_blocks(q, anchors, "QUEST", "SEPARATE")
    assert select_top(scores, 4).shape == (N_KV_HEADS, 0)


def test_select_top_sorted_indices():
    scores = torch.randn(N_KV_HEADS, 100, generator=_gen(14))
    top = select_top(scores, 10)
    assert top.dtype == torch.long and top.shape == (N_KV_HEADS, 10)
    for head in range(N_KV_HEADS):
        expected = scores[head].topk(10).indices.sort().values
        assert top[head].tolist() == expected.tolist()


def test_select_top_edge_counts():
    scores = torch.randn(7, generator=_gen(15))
    assert select_top(scores, 7).tolist() == list(range(7))
    assert select_top(scores, 100).tolist() == list(range(7))
    assert select_top(scores.expand(2, 7), 9).tolist() == [list(range(7))] * 2
    empty = select_top(scores, 0)
    assert empty.dtype == torch.long and empty.shape == (0,)
    assert select_top(scores.expand(2, 7), 0).shape == (2, 0)
    assert select_top(scores, 8).dtype == torch.long
    with pytest.raises(ValueError, match="k must be >= 0"):
        select_top(scores, -1)


def _brute_vote(q_last: torch.Tensor, anchors: torch.Tensor, anchor_type: str) -> torch.Tensor:
    votes = torch.zeros(anchors.shape[0])
    for query in range(q_last.shape[1]):
        scores = _brute_scores(q_last[:, query], anchors, anchor_type)
        votes += torch.softmax(scores / math.sqrt(HEAD_DIM), dim=-1).sum(dim=0)
    return votes


@pytest.mark.parametrize("anchor_type", ANCHOR_TYPES)
def test_preselect_vote_keeps_attended_block(anchor_type):
    q_last = torch.randn(N_HEADS, 8, HEAD_DIM, generator=_gen(16))
    keys = _random_keys(17)
    planted = 77
    for kv_head in range(N_KV_HEADS):
        _plant(keys, planted, kv_head, _group_direction(q_last, kv_head), seed=18 + kv_head)
    anchors = _anchors(keys, anchor_type)
    assert preselect_vote(q_last, anchors, anchor_type, 1).tolist() == [planted]
    kept = preselect_vote(q_last, anchors, anchor_type, 20)
    assert kept.dtype == torch.long and kept.shape == (20,)
    assert planted in kept.tolist()
    assert kept.tolist() == sorted(kept.tolist())
    expected = select_top(_brute_vote(q_last, anchors, anchor_type), 20)
    assert kept.tolist() == expected.tolist()


def test_timing_8192_blocks(capsys):
    """Not an assertion: the cost of one selection at 1M tokens / 128-token blocks."""
    n_blocks = 8192
    q = torch.randn(N_HEADS, HEAD_DIM, generator=_gen(20))
    lines = []
    for anchor_type in ("BLOCK_MEAN", "QUEST"):
        rows = 2 if anchor_type == "QUEST" else 1
        anchors = torch.randn(n_blocks, N_KV_HEADS, rows, HEAD_DIM, generator=_gen(21))
        for mode in HEAD_SELECT_MODES:
            best = _best_ms(lambda a=anchors, t=anchor_type, m=mode: _select(q, a, t, m))
            lines.append(f"{anchor_type:>10} {mode:>8}: {best:.3f} ms")
    with capsys.disabled():
        print(f"\nscore_blocks + select_top(96), {n_blocks} blocks, 9 q / 3 kv heads, d=64:")
        print("\n".join(lines))


def _select(q: torch.Tensor, anchors: torch.Tensor, anchor_type: str, mode: str) -> None:
    select_top(score_blocks(q, anchors, anchor_type, mode), 96)


def _best_ms(fn, repeats: int = 30) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3
