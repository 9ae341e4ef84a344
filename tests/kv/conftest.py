"""A tiny random Llama to drive the caches through the real model code, fast."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kvchat.config import LongContextSettings
from kvchat.core.model import Transformer
from kvchat.core.model_config import ModelConfig
from kvchat.core.weights import ModelWeights, expected_shapes
from kvchat.kv.dense import DenseBackend
from kvchat.kv.sparse import AttendPath, SparseBackend

TINY = ModelConfig(
    architecture="llama",
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=True,
)


def tiny_model(cfg: ModelConfig = TINY, seed: int = 0, dtype=torch.float32) -> Transformer:
    gen = torch.Generator().manual_seed(seed)
    tensors = {
        name: (
            torch.randn(shape, generator=gen) * (0.3 if len(shape) == 2 else 0.1)
            + (len(shape) == 1)
        )
        for name, shape in expected_shapes(cfg).items()
    }
    weights = ModelWeights(config=cfg, tensors=tensors, int4={}, source=Path("tiny"), metadata={})
    return Transformer(weights, dtype=dtype)


def small_settings(**changes) -> LongContextSettings:
    base = LongContextSettings(
        chunk_size=64,
        max_seq_len=4096,
        block_size=32,
        local_windows_len=128,
        second_select_num=4,
        pinned_blocks=0,
        dense_layer_num=1,
        attention="sparse",
    )
    return replace(base, **changes)


def dense_cache(
    model: Transformer, max_tokens: int = 4096, ops_backend: str | None = None
) -> DenseBackend:
    c = model.cfg
    return DenseBackend(
        c.num_layers,
        c.num_kv_heads,
        c.head_dim,
        model.rope,
        model.dtype,
        "cpu",
        max_tokens,
        ops_backend,
    )


def sparse_cache(
    model: Transformer,
    settings: LongContextSettings,
    position_mode: str = "native",
    ops_backend: str | None = None,
    path: type[AttendPath] | None = None,
) -> SparseBackend:
    geom = model.cache_geometry(settings.max_seq_len)
    return SparseBackend(geom, model.rope, settings, position_mode, ops_backend, path)


def run(model: Transformer, cache, ids: torch.Tensor, chunk: int, decode: int = 0) -> torch.Tensor:
    """Logits of every prompt position (chunked prefill), then of `decode` one-token steps.

    The decode steps feed the prompt's tokens again rather than sampled ones, so two caches
    that differ slightly still see the same inputs.
    """
    out = []
    with torch.inference_mode():
        for s in range(0, len(ids), chunk):
            out.append(model.forward(ids[s : s + chunk], cache, all_logits=True))
        for i in range(decode):
            out.append(model.forward(ids[i : i + 1], cache))
    return torch.cat(out)


@pytest.fixture(scope="session")
def tiny() -> Transformer:
    return tiny_model()
