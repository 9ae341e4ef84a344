"""The caches on the Triton path (the one CUDA takes), run on the CPU by the Triton interpreter.

`ops_backend="triton"` makes the caches take the path kv/kernels.py picks on CUDA: the
sparse_attention, window_probs, score_blocks and write_blocks kernels, and the device block
tier the selected blocks are read from. tests/conftest.py sets TRITON_INTERPRET=1, so all of
it runs here on CPU tensors; only the tier's side stream and events are CUDA-only. The torch
path (the CPU one) is the reference.

The model is the tiny random Llama cut to 2 layers, the prompt 222 tokens, the local window
64: the interpreter is slow. The prompt length puts a block through the window edge during
the decode steps, so blocks join a reused selection there.

Tolerances on the logits (of magnitude ~15): 1e-3 where the store holds full precision (the
paths differ only in summation order; under 1e-4 measured); 2e-2 for INT8 / INT4, where a
last-bit difference in the keys of layer 1 can move one of its stored values by a
quantization step (up to 4e-3 seen). Layer 0 sees identical keys on both paths, so its
store must be bit-identical: the quantizing append is exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import pytest
import torch

pytest.importorskip("triton")

from kvchat.kv.kernels import OPS_ENV, TORCH_OPS, attention_ops  # noqa: E402
from kvchat.kv.sparse import TorchPath, TritonPath  # noqa: E402
from kvchat.kv.triton.ops import TRITON_OPS  # noqa: E402

from .conftest import TINY, dense_cache, run, small_settings, sparse_cache, tiny_model  # noqa: E402

PROMPT = 222
DECODE = 4
FULL_TOL = 1e-3
QUANT_TOL = 2e-2


@pytest.fixture(scope="module")
def model():
    return tiny_model(replace(TINY, num_layers=2))


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(11))


def _settings(**changes):
    base = dict(local_windows_len=64, second_select_num=2, dense_layer_num=0)
    return small_settings(**(base | changes))


@dataclass(frozen=True)
class Case:
    kv_type: str
    mode: str
    anchor_type: str
    chunk: int
    position_mode: str = "native"
    changes: dict = field(default_factory=dict)

    @property
    def id(self) -> str:
        extra = "-".join(f"{k}={v}" for k, v in self.changes.items())
        name = f"{self.kv_type}-{self.mode}-{self.anchor_type}-chunk{self.chunk}"
        return "-".join(filter(None, [name, self.position_mode, extra]))


# Every pair of (kv_type, head_select_mode, anchor_type) values occurs in some case, each with
# one more part of the cache switched on.
CASES = [
    Case("FP16", "SHARED", "DYNAMIC", 64),
    Case("INT8", "SEPARATE", "QUEST", 40, "extrapolate"),
    # The dense layer reads 3 blocks per head through a tier of 2: two runs, merged.
    Case("INT4", "SHARED", "QUEST", 64, changes=dict(dense_layer_num=1, second_select_num=1)),
    Case("INT8", "SHARED", "DYNAMIC", 40, changes=dict(token_step=3, layer_step=2)),
    Case(
        "INT4",
        "SEPARATE",
        "DYNAMIC",
        64,
        changes=dict(preselect_block=True, preselect_block_count=2),
    ),
    Case("FP16", "SEPARATE", "QUEST", 40, changes=dict(token_step=4)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_triton_path_equals_torch_path(model, ids, case):
    settings = _settings(
        kv_type=case.kv_type,
        head_select_mode=case.mode,
        anchor_type=case.anchor_type,
        chunk_size=case.chunk,
        **case.changes,
    )
    reference = sparse_cache(model, settings, case.position_mode, ops_backend="torch")
    cache = sparse_cache(model, settings, case.position_mode, ops_backend="triton")
    assert isinstance(reference.path, TorchPath) and isinstance(cache.path, TritonPath)
    want = run(model, reference, ids, case.chunk, DECODE)
    got = run(model, cache, ids, case.chunk, DECODE)

    tol = FULL_TOL if case.kv_type == "FP16" else QUANT_TOL
    assert (got - want).abs().max().item() < tol
    first = {name: t for name, t in cache.export_state().tensors.items() if name[:2] == "0."}
    expected = reference.export_state().tensors
    for name in ("0.k_pool", "0.v_pool"):
        assert torch.equal(first[name], expected[name]), name
    # The attention the window received (window_probs) and the anchors made from it.
    for name in first.keys() - {"0.k_pool", "0.v_pool"}:
        torch.testing.assert_close(first[name], expected[name], atol=1e-5, rtol=1e-5, msg=name)
    s, ref = cache.stats(), reference.stats()
    assert [layer.selected for layer in s.layers] == [layer.selected for layer in ref.layers]
    assert any(layer.selected for layer in s.layers)
    # The stats count what the tier really copied, and (but where a dense layer reads more
    # blocks than the slots hold) what the torch path counts for a GPU it does not have.
    assert s.misses > 0 and s.bytes_moved == s.misses * cache.path.tier.bytes_per_block
    if "dense_layer_num" not in case.changes:
        assert (s.hits, s.misses) == (ref.hits, ref.misses)
    assert 0 < s.device_slots_used <= s.device_slots_total == cache.path.tier.total


def test_full_budget_and_dense_equal_dense_attention(model, ids):
    want = run(model, dense_cache(model), ids, 64, DECODE)
    dense = run(model, dense_cache(model, ops_backend="triton"), ids, 64, DECODE)
    assert (dense - want).abs().max().item() < FULL_TOL
    settings = _settings(second_select_num=10_000)
    got = run(model, sparse_cache(model, settings, ops_backend="triton"), ids, 64, DECODE)
    assert (got - want).abs().max().item() < FULL_TOL


def test_retune_and_truncate_on_the_tier(model, ids):
    settings = _settings(kv_type="INT8", anchor_type="BLOCK_MEAN")
    caches = {ops: sparse_cache(model, settings, ops_backend=ops) for ops in ("torch", "triton")}
    for cache in caches.values():
        run(model, cache, ids, 64, 2)
    tier = caches["triton"].path.tier
    hits = tier.hits
    assert tier.slots_per_layer == 2 * 2 * 2  # two selections of 2 blocks, 2 KV heads

    outs = {}
    for ops, cache in caches.items():
        cache.retune(replace(settings, second_select_num=1))
        if ops == "triton":
            assert tier.slots_per_layer == 2 * 1 * 2 and tier.used == 0 and tier.hits == hits
        # Back to the middle of the old window buffer: it is reloaded from the store.
        cache.truncate(100)
        outs[ops] = run(model, cache, ids[100:], 64, 2)
    assert (outs["triton"] - outs["torch"]).abs().max().item() < QUANT_TOL
    s = caches["triton"].stats()
    assert s.tokens == PROMPT + 2 and s.device_slots_total == 2 * tier.slots_per_layer
    assert max(len(layer.selected) for layer in s.layers) == 1


def test_ops_choice(model, monkeypatch):
    monkeypatch.delenv(OPS_ENV, raising=False)
    assert attention_ops("cpu") is TORCH_OPS
    cache = sparse_cache(model, _settings())
    assert cache.ops is TORCH_OPS and not isinstance(cache.path, TritonPath)
    assert dense_cache(model).ops is TORCH_OPS
    # Choosing needs no GPU: CUDA gets the kernels, and never the CPU-only torch attention.
    assert attention_ops("cuda") is TRITON_OPS
    with pytest.raises(RuntimeError, match="CPU only"):
        attention_ops("cuda", "torch")

    monkeypatch.setenv(OPS_ENV, "triton")
    assert attention_ops("cpu") is TRITON_OPS
    assert isinstance(sparse_cache(model, _settings()).path, TritonPath)
    assert attention_ops("cpu", "torch") is TORCH_OPS  # an explicit choice wins
    monkeypatch.setenv(OPS_ENV, "fastest")
    with pytest.raises(ValueError, match=f"'fastest' \\({OPS_ENV}\\)"):
        sparse_cache(model, _settings())
