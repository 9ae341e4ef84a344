"""The prompt's vote for the blocks its answer reads (kv/pinning.py) and how the cache uses it."""

from __future__ import annotations

import math

import pytest
import torch

from kvchat.core.plan import gather_bytes
from kvchat.kv import cpu_kernel, pinning
from kvchat.kv.sparse import CacheGeometry, SparseBackend

from .conftest import small_settings
from .test_sparse_parts import NoRotation


@pytest.mark.parametrize("block_max", ["torch", "kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_shares_are_a_softmax_over_each_blocks_best_key(dtype, block_max):
    if block_max == "kernel" and cpu_kernel.load() is None:
        pytest.skip("no C++ compiler: the torch reduction is used instead")
    reduce = cpu_kernel.block_max if block_max == "kernel" else pinning.torch_block_max
    gen = torch.Generator().manual_seed(1)
    n_kv, group, n_q, dim, block, n_blocks = 2, 3, 5, 16, 4, 300  # five chunks of blocks
    q = torch.randn(n_kv * group, n_q, dim, generator=gen)
    keys = torch.randn(n_kv, n_blocks * block, dim, generator=gen)
    first, last = 7, n_blocks

    def read(lo: int, hi: int) -> torch.Tensor:
        return keys[:, lo * block : hi * block]

    got = pinning.layer_shares(q, read, first, last, dtype, reduce)
    rows = q.reshape(n_kv, group * n_q, dim)
    scores = rows @ keys[:, first * block :].transpose(1, 2) / math.sqrt(dim)
    best = scores.unflatten(-1, (last - first, block)).amax(-1)
    want = torch.softmax(best, -1).flatten(0, 1).amax(0)
    assert got.shape == (last - first,) and got.dtype == torch.float32
    tol = {"rtol": 1e-4, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.1, "atol": 1e-3}
    torch.testing.assert_close(got, want, **tol)
    assert got.argmax() == want.argmax()


def test_pick_takes_the_top_votes_and_the_blocks_after_them():
    votes = torch.tensor([0.1, 0.9, 0.0, 0.2, 0.8])  # blocks 3..7
    assert pinning.pick(votes, 3, 2, last=8).tolist() == [4, 5, 7]  # 8 is not a candidate
    assert pinning.pick(votes, 3, 3, last=8).tolist() == [4, 5, 6, 7]  # 5 once
    assert pinning.pick(votes, 3, 0, last=8).tolist() == []


PROMPT, CHUNK, B, D = 700, 64, 32, 32


def _cache(settings, device: str = "cpu") -> SparseBackend:
    """One layer, two query heads over one KV head, positions that rotate nothing."""
    return SparseBackend(
        CacheGeometry(1, 2, 1, D, torch.float32, torch.device(device), 4096, 4096),
        NoRotation(device),
        settings,
        "native",
    )


def _planted_cache(
    pinned_blocks: int, device: str = "cpu", kv_type: str = "FP16"
) -> tuple[SparseBackend, torch.Tensor]:
    """One layer whose prompt plants `needle` in the keys of block 5 and ends with queries
    along it (a question that names the block); the decode query points elsewhere."""
    gen = torch.Generator().manual_seed(3)
    settings = small_settings(
        second_select_num=4,
        pinned_blocks=pinned_blocks,
        dense_layer_num=0,
        chunk_size=CHUNK,
        kv_type=kv_type,
    )
    cache = _cache(settings, device)
    needle = torch.randn(D, generator=gen)
    needle = 4 * needle / needle.norm()
    keys = 0.1 * torch.randn(1, PROMPT, D, generator=gen)
    keys[0, 5 * B : 6 * B] += needle
    for start in range(0, PROMPT, CHUNK):
        n = min(CHUNK, PROMPT - start)
        q = 0.1 * torch.randn(2, n, D, generator=gen)
        if start + n == PROMPT:
            q[:, -8:] += needle  # the prompt's last queries ask for the needle
        v = torch.randn(1, n, D, generator=gen)
        cache.begin(n)
        cache.attend(0, *(t.to(device) for t in (q, keys[:, start : start + n], v)))
        cache.commit()
    return cache, needle


# On a GPU the vote runs on the host, beside the block store, with host tables.
@pytest.mark.parametrize("pinned_blocks", [0, 1])
def test_a_block_the_question_names_is_read_by_the_answer(pinned_blocks, device):
    cache, needle = _planted_cache(pinned_blocks, device)
    elsewhere = -needle  # the answer's query alone would rank block 5 last
    q, zero = elsewhere.expand(2, 1, D).to(device), torch.zeros(1, 1, D, device=device)
    cache.begin(1)
    cache.attend(0, q, zero, zero)
    cache.commit()
    selected = cache.stats().layers[0].selected
    assert (5 in selected) == (pinned_blocks > 0)
    if pinned_blocks:
        assert cache.selector.pinned.tolist() == [5, 6]  # the block and the one after it
        assert len(selected) == 4  # inside second_select_num


def test_the_plan_holds_the_keys_a_vote_gathers():
    # Quantized keys are dequantized into the gather buffer for the vote, more blocks at once
    # than a selection reads.
    cache, _ = _planted_cache(1, kv_type="INT8")
    assert cache.selector.pinned.tolist() == [5, 6]
    planned = gather_bytes(cache.lc, 1, D, PROMPT, torch.float32.itemsize)
    assert 2 * 4 * B * D * 4 < cache.gather_bytes() <= planned


def test_pins_take_at_most_half_the_budget():
    settings = small_settings(second_select_num=8, pinned_blocks=5)
    cache = _cache(settings)
    assert cache.selector.pin_count() == 2  # 2 pins and the 2 blocks after them: 4 of 8
    cache.retune(small_settings(second_select_num=3, pinned_blocks=5))
    assert cache.selector.pin_count() == 0


def test_pins_last_for_one_answer_and_only_short_passes_vote():
    cache, _ = _planted_cache(1)
    assert cache.selector.pinned.tolist() == [5, 6]
    cache.begin(CHUNK)  # a full chunk: a document's middle, no vote
    assert cache.selector.pinned.numel() == 0 and cache.selector.votes is None
    cache.truncate(PROMPT)
    assert cache.selector.pinned.numel() == 0
