"""Hugging Face folders: tiny random models saved by transformers, loaded back tensor by tensor."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from kvchat.core.hf_loader import load_hf
from kvchat.core.model_config import RopeScaling, UnsupportedModelError
from kvchat.core.weights import WeightsError

COMMON = dict(
    vocab_size=64,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-5,
)
MODELS = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "mistral": (MistralConfig, MistralForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
}


def save_model(folder, arch="llama", dtype=torch.float32, shard=None, **config):
    torch.manual_seed(0)
    config_cls, model_cls = MODELS[arch]
    model = model_cls(config_cls(**COMMON | config)).to(dtype)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(folder, **kwargs)
    return model


def edit_config(folder, edit) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def assert_same_tensors(weights, model) -> None:
    expected = model.state_dict()
    if model.config.tie_word_embeddings:
        del expected["lm_head.weight"]
    assert weights.tensors.keys() == expected.keys()
    for name, want in expected.items():
        got = weights.tensors[name]
        assert got.dtype == torch.float32 and got.is_contiguous(), name
        assert torch.equal(got, want.to(torch.float32)), name


@pytest.mark.parametrize(
    ("arch", "extra"),
    [
        ("llama", {}),
        ("llama", {"head_dim": 32}),
        ("mistral", {}),
        ("qwen2", {}),
        ("qwen2", {"tie_word_embeddings": True}),
    ],
    ids=["llama", "llama-head32", "mistral", "qwen2", "qwen2-tied"],
)
def test_tiny_models_load_every_tensor(tmp_path, arch, extra):
    model = save_model(tmp_path, arch, **extra)
    weights = load_hf(tmp_path)

    assert_same_tensors(weights, model)
    cfg, hf = weights.config, model.config
    assert cfg.architecture == arch
    assert (cfg.vocab_size, cfg.hidden_size, cfg.intermediate_size, cfg.num_layers) == (
        64,
        64,
        96,
        2,
    )
    assert (cfg.num_heads, cfg.num_kv_heads) == (4, 2)
    assert cfg.head_dim == extra.get("head_dim", 16)
    assert (cfg.rms_norm_eps, cfg.max_position_embeddings) == (1e-5, 128)
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"]
    assert cfg.rope_scaling == RopeScaling()
    assert cfg.tie_word_embeddings == hf.tie_word_embeddings
    assert cfg.attention_bias == (arch == "qwen2")
    assert cfg.bos_token_id == hf.bos_token_id
    assert cfg.eos_token_ids == ((hf.eos_token_id,) if hf.eos_token_id is not None else ())
    assert cfg.name == tmp_path.name
    assert weights.source == tmp_path
    assert weights.int4 == {}
    assert weights.metadata["architectures"] == [type(model).__name__]


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "linear", "factor": 2.0},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ],
    ids=lambda r: r["rope_type"],
)
def test_rope_parameters_transformers5(tmp_path, rope):
    save_model(tmp_path, rope_parameters={**rope, "rope_theta": 500000.0})
    cfg = load_hf(tmp_path).config
    assert cfg.rope_theta == 500000.0
    expected = {k: v for k, v in rope.items() if k != "rope_type"}
    assert cfg.rope_scaling == RopeScaling(rope_type=rope["rope_type"], **expected)


@pytest.mark.parametrize("key", ["type", "rope_type"])
def test_rope_scaling_transformers4(tmp_path, key):
    save_model(tmp_path)

    def to_v4(raw):
        del raw["rope_parameters"]
        raw["rope_theta"] = 250000.0
        raw["rope_scaling"] = {key: "dynamic", "factor": 2.0}

    edit_config(tmp_path, to_v4)
    cfg = load_hf(tmp_path).config
    assert (cfg.rope_theta, cfg.rope_scaling) == (250000.0, RopeScaling("dynamic", 2.0))


def test_unknown_rope_type_is_unsupported(tmp_path):
    save_model(tmp_path)
    edit_config(tmp_path, lambda raw: raw.update(rope_parameters={"rope_type": "longrope"}))
    with pytest.raises(UnsupportedModelError, match="longrope"):
        load_hf(tmp_path)


def test_bf16_checkpoint_becomes_float32(tmp_path):
    model = save_model(tmp_path, dtype=torch.bfloat16)
    assert_same_tensors(load_hf(tmp_path), model)


def test_sharded_checkpoint(tmp_path):
    model = save_model(tmp_path, shard="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    assert_same_tensors(load_hf(tmp_path), model)


def test_generation_config_adds_end_of_turn_ids(tmp_path):
    save_model(tmp_path, eos_token_id=2)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert load_hf(tmp_path).config.eos_token_ids == (2, 7)


def test_unsupported_architecture(tmp_path):
    config = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError) as info:
        load_hf(tmp_path)
    message = str(info.value)
    assert "'GPT2LMHeadModel'" in message and "LlamaForCausalLM" in message


@pytest.mark.parametrize("bias", ["attention_bias", "mlp_bias"])
def test_llama_output_and_mlp_biases_are_unsupported(tmp_path, bias):
    save_model(tmp_path, **{bias: True})
    with pytest.raises(UnsupportedModelError, match=bias):
        load_hf(tmp_path)


def test_missing_tensor(tmp_path):
    save_model(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(
        WeightsError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        load_hf(tmp_path)


def test_shape_mismatch(tmp_path):
    save_model(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(16, 64)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(WeightsError) as info:
        load_hf(tmp_path)
    message = str(info.value)
    assert "model.layers.0.self_attn.k_proj.weight" in message
    assert "(16, 64)" in message and "expected (32, 64)" in message


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors(tmp_path, damage):
    save_model(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(b"\xff" * 100 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(WeightsError, match="unreadable safetensors"):
        load_hf(tmp_path)


def test_no_weights_file(tmp_path):
    save_model(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(WeightsError, match="neither model.safetensors"):
        load_hf(tmp_path)


def test_missing_config_key(tmp_path):
    save_model(tmp_path)
    edit_config(tmp_path, lambda raw: raw.pop("hidden_size"))
    with pytest.raises(WeightsError, match="hidden_size is missing"):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("num_key_value_heads", "x"),
        ("num_key_value_heads", 0.5),
        ("head_dim", -4),
        ("rms_norm_eps", "tiny"),
        ("rope_theta", True),
        ("hidden_size", [64]),
        ("tie_word_embeddings", "yes"),
        ("rope_parameters", "linear"),
        ("rope_parameters", {"rope_type": "linear", "factor": "2"}),
        ("rope_parameters", {"rope_type": "yarn", "factor": 4.0, "beta_fast": {"a": 1}}),
    ],
)
def test_mistyped_config_fields_are_one_line_errors(tmp_path, key, value):
    save_model(tmp_path)
    edit_config(tmp_path, lambda raw: raw.update({key: value}))
    with pytest.raises(WeightsError, match=rf"config\.json: {key}[ .]") as info:
        load_hf(tmp_path)
    assert "\n" not in str(info.value)


def test_a_mistyped_config_exits_2_with_a_message(tmp_path):
    save_model(tmp_path)
    edit_config(tmp_path, lambda raw: raw.update(num_key_value_heads="x"))
    done = subprocess.run(
        [sys.executable, "-m", "kvchat", "plan", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "KVCHAT_HOME": str(tmp_path / "home")},
    )
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "kvchat: error: config.json: num_key_value_heads is 'x', expected a positive int"
    )


@pytest.mark.parametrize(
    "edit",
    [
        lambda raw: raw.update(architectures=[["LlamaForCausalLM"]]),
        lambda raw: raw.update(architectures=None, model_type={}),
    ],
    ids=["nested-architectures", "object-model-type"],
)
def test_an_unhashable_architecture_is_unsupported(tmp_path, edit):
    save_model(tmp_path)
    edit_config(tmp_path, edit)
    with pytest.raises(UnsupportedModelError, match="is not supported"):
        load_hf(tmp_path)


@pytest.mark.parametrize("value", [["model.safetensors"], 1, "../model.safetensors", ""])
def test_a_weight_map_of_no_file_name_is_one_line(tmp_path, value):
    save_model(tmp_path, shard="40KB")
    index = tmp_path / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    raw["weight_map"]["model.norm.weight"] = value
    index.write_text(json.dumps(raw))
    with pytest.raises(WeightsError, match="weight_map must map tensor names to file names"):
        load_hf(tmp_path)
