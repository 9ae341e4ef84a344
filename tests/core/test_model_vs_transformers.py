"""Our decoder against transformers' own models on the same random weights (fp32)."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvchat.core.model import Transformer
from kvchat.core.model_files import load_weights
from kvchat.kv.dense import DenseBackend

TOL = 1e-4
SEQ = 23

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    initializer_range=0.2,  # large enough that attention is far from uniform
)

ROPES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}


def _build(kind: str, tmp_path, tie: bool, rope: str = "default", **extra):
    torch.manual_seed(0)
    cls_cfg, cls_model = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    }[kind]
    params = {**ROPES[rope], "rope_theta": 10000.0}
    cfg = cls_cfg(**{**COMMON, **extra}, tie_word_embeddings=tie, rope_parameters=params)
    hf = cls_model(cfg).eval()
    hf.save_pretrained(tmp_path)
    ours = Transformer(load_weights(tmp_path), dtype=torch.float32)
    return hf, ours


def _ours_logits(model: Transformer, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    cfg = model.cfg
    cache = DenseBackend(
        cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, model.rope, model.dtype, "cpu", 1024
    )
    out = []
    with torch.inference_mode():
        for start in range(0, ids.shape[0], chunk):
            out.append(model.forward(ids[start : start + chunk], cache, all_logits=True))
    return torch.cat(out)


def _hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(ids[None]).logits[0].float()


@pytest.mark.parametrize(
    "kind,tie,rope",
    [
        ("llama", False, "default"),
        ("llama", True, "default"),
        ("llama", False, "linear"),
        ("llama", False, "yarn"),
        ("llama", True, "llama3"),
        ("mistral", False, "default"),
        ("qwen2", True, "default"),
        ("qwen2", False, "linear"),
    ],
)
@pytest.mark.parametrize("chunk", [SEQ, 5, 1])
def test_logits_match_transformers(tmp_path, kind, tie, rope, chunk):
    hf, ours = _build(kind, tmp_path, tie, rope)
    ids = torch.randint(0, COMMON["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(1))
    ref = _hf_logits(hf, ids)
    got = _ours_logits(ours, ids, chunk)
    assert ref.std() > 0.1, "weights too small to make the comparison meaningful"
    assert (got - ref).abs().max().item() < TOL


def test_dynamic_rope_beyond_trained_length(tmp_path):
    # Dynamic NTK changes the frequencies with the length of the call, so compare one pass
    # longer than max_position_embeddings, where the scaling is active.
    hf, ours = _build("llama", tmp_path, False, "dynamic", max_position_embeddings=16)
    ids = torch.randint(0, COMMON["vocab_size"], (40,), generator=torch.Generator().manual_seed(2))
    got = _ours_logits(ours, ids, 40)
    assert (got - _hf_logits(hf, ids)).abs().max().item() < TOL


def test_gqa_ratio_one_and_head_dim_override(tmp_path):
    hf, ours = _build("llama", tmp_path, False, num_key_value_heads=4, head_dim=32)
    ids = torch.randint(0, COMMON["vocab_size"], (SEQ,), generator=torch.Generator().manual_seed(3))
    got = _ours_logits(ours, ids, 7)
    assert (got - _hf_logits(hf, ids)).abs().max().item() < TOL
