"""The decode step's one-call layer (kv/csrc/decode_layer.cpp) against the Python path it
replaces: the same kernels in the same order, so the same bits, selections and counts."""

from __future__ import annotations

import pytest
import torch

from kvchat.kv.kernels import cpu_kernels
from kvchat.kv.sparse import CpuKernelPath, FusedCpuPath

from .conftest import run, small_settings, sparse_cache, tiny_model

pytestmark = pytest.mark.skipif(
    cpu_kernels("cpu") is None, reason="the C++ CPU kernels do not build here"
)

CASES = [
    {},
    {"kv_type": "INT8"},
    {"kv_type": "INT4", "head_select_mode": "SEPARATE"},
    {"head_select_mode": "SEPARATE", "anchor_type": "BLOCK_MEAN"},
    {"token_step": 3, "layer_step": 2, "dense_layer_num": 0},
    {"second_select_num": 0},
    {"pinned_blocks": 1},
    {"pinned_blocks": 1, "kv_type": "INT8", "head_select_mode": "SEPARATE"},
]


@pytest.fixture(scope="module")
def model():
    return tiny_model(dtype=torch.bfloat16)


def _ids(n: int, seed: int = 3) -> torch.Tensor:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


def _pair(model, changes: dict, position_mode: str):
    """A cache on the one-call path (counting its calls) and one on the Python path."""
    settings = small_settings(**changes)
    fused = sparse_cache(model, settings, position_mode)
    plain = sparse_cache(model, settings, position_mode, path=CpuKernelPath)
    assert isinstance(fused.path, FusedCpuPath)
    calls = []
    one_call = fused.path.decode_step
    fused.path.decode_step = lambda layer, *a: calls.append(layer) or one_call(layer, *a)
    return fused, plain, calls


@pytest.mark.parametrize("changes", CASES)
@pytest.mark.parametrize("position_mode", ["native", "extrapolate"])
def test_one_call_layer_equals_the_python_path(model, changes, position_mode):
    fused, plain, calls = _pair(model, changes, position_mode)
    ids = _ids(600)
    # 70 steps move blocks out of the window and shift the window buffer in place.
    got = run(model, fused, ids, 64, decode=70)
    want = run(model, plain, ids, 64, decode=70)
    assert torch.equal(got, want)
    assert fused.stats() == plain.stats()
    # The prompt's last pass (24 tokens) votes: both paths take the same pins first.
    assert torch.equal(fused.selector.pinned, plain.selector.pinned)
    assert (fused.selector.pinned.numel() > 0) == ("pinned_blocks" in changes)
    dense = small_settings(**changes).dense_layer_num
    assert len(calls) == 70 * (model.cfg.num_layers - dense)
    # After a truncate below the window, which reloads the window buffer in place.
    for cache in (fused, plain):
        cache.truncate(300)
    got = run(model, fused, ids[300:400], 64, decode=5)
    want = run(model, plain, ids[300:400], 64, decode=5)
    assert torch.equal(got, want)
    assert fused.stats() == plain.stats()


def test_one_call_layer_reads_a_restored_state(model):
    # load_state restores into the buffers the C++ objects hold, not new ones.
    fused, plain, calls = _pair(model, {}, "extrapolate")
    ids = _ids(500, seed=5)
    run(model, plain, ids, 64)
    fused.load_state(plain.export_state())
    got = run(model, fused, ids[:20], 64, decode=20)[-20:]
    want = run(model, plain, ids[:20], 64, decode=20)[-20:]
    assert calls and torch.equal(got, want)
