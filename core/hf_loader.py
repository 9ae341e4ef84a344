"""Read a Hugging Face folder (config.json + safetensors, single or sharded) into ModelWeights."""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import fields
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from .model_config import ModelConfig, RopeScaling, UnsupportedModelError
from .weights import ModelWeights, WeightsError, expected_shapes

ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_ROPE_FIELDS = tuple(f.name for f in fields(RopeScaling) if f.name != "rope_type")


def load_hf(folder: Path, on_progress: Callable[[int, int], None] | None = None) -> ModelWeights:
    """Every decoder tensor as float32; config and shapes are checked before any data is read.
    `on_progress(done, total)` follows the tensors."""
    raw = _read_json(folder / "config.json")
    config = config_from_hf(raw, folder.name, _generation_eos(folder))
    shapes = expected_shapes(config)
    with ExitStack() as stack:
        try:
            handles = [
                stack.enter_context(safe_open(folder / file, framework="pt"))
                for file in _shard_files(folder)
            ]
            where = {name: handle for handle in handles for name in handle.keys()}
            for name, shape in shapes.items():
                if name not in where:
                    raise WeightsError(f"{folder}: missing tensor {name}")
                found = tuple(where[name].get_slice(name).get_shape())
                if found != shape:
                    raise WeightsError(
                        f"{folder}: tensor {name} has shape {found}, expected {shape}"
                    )
            tensors = {}
            for done, name in enumerate(shapes, 1):
                tensors[name] = where[name].get_tensor(name).to(torch.float32).contiguous()
                if on_progress is not None:
                    on_progress(done, len(shapes))
        except (SafetensorError, OSError) as exc:
            raise WeightsError(f"{folder}: unreadable safetensors file: {exc}") from exc
    return ModelWeights(config, tensors, {}, folder, raw)


def config_from_hf(
    raw: dict[str, object], name: str = "", extra_eos: tuple[int, ...] = ()
) -> ModelConfig:
    """ModelConfig from a transformers config.json dict (transformers 4 or 5 layout)."""
    names = raw.get("architectures") or []
    arch_name = names[0] if isinstance(names, list) and names else raw.get("model_type")
    if not isinstance(arch_name, str) or arch_name not in ARCHITECTURES:
        raise UnsupportedModelError(
            f"{name}: architecture {arch_name!r} is not supported; "
            f"supported: {', '.join(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[arch_name]
    # Llama's attention_bias also puts a bias on o_proj, which ModelConfig cannot express.
    if raw.get("mlp_bias") or (arch != "qwen2" and raw.get("attention_bias")):
        raise UnsupportedModelError(
            f"{name}: {arch_name} with attention_bias or mlp_bias (o_proj / MLP biases) "
            "is not supported"
        )

    def required(key: str) -> int:
        return _positive(raw, key, None, int)

    hidden, heads = required("hidden_size"), required("num_attention_heads")
    # transformers 5 keeps rope_theta and the scaling in one rope_parameters dict.
    rope_key = "rope_parameters" if raw.get("rope_parameters") else "rope_scaling"
    rope = raw.get(rope_key) or {}
    if not isinstance(rope, dict):
        raise WeightsError(f"config.json: {rope_key} is {rope!r}, expected an object")
    tie = raw.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        raise WeightsError(f"config.json: tie_word_embeddings is {tie!r}, expected true or false")
    bos = raw.get("bos_token_id")
    theta = _positive(raw, "rope_theta", 1e4, float)  # transformers 4 keeps it at the top
    return ModelConfig(
        architecture=arch,
        vocab_size=required("vocab_size"),
        hidden_size=hidden,
        intermediate_size=required("intermediate_size"),
        num_layers=required("num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=_positive(raw, "num_key_value_heads", heads, int),
        head_dim=_positive(raw, "head_dim", hidden // heads, int),
        rms_norm_eps=_positive(raw, "rms_norm_eps", 1e-6, float),
        rope_theta=_positive(rope, "rope_theta", theta, float, where=f"{rope_key}."),
        max_position_embeddings=required("max_position_embeddings"),
        tie_word_embeddings=tie,
        attention_bias=arch == "qwen2",
        rope_scaling=rope_scaling_from_dict(rope, rope_key),
        bos_token_id=bos if isinstance(bos, int) and not isinstance(bos, bool) else None,
        eos_token_ids=tuple(dict.fromkeys(_ids(raw.get("eos_token_id")) + extra_eos)),
        name=name,
    )


def rope_scaling_from_dict(rope: dict[str, object], where: str = "rope_scaling") -> RopeScaling:
    """RopeScaling from `rope_scaling` (key `type` or `rope_type`) or `rope_parameters`."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    values: dict[str, object] = {}
    for key in _ROPE_FIELDS:
        if rope.get(key) is None:
            continue
        if key == "truncate":
            if not isinstance(rope[key], bool):
                raise WeightsError(
                    f"config.json: {where}.{key} is {rope[key]!r}, expected true or false"
                )
            values[key] = rope[key]
        elif key == "original_max_position_embeddings":
            values[key] = _positive(rope, key, None, int, where=f"{where}.")
        else:  # yarn's mscale and attention factors may be 0
            values[key] = _positive(
                rope, key, None, float, zero_ok=key != "factor", where=f"{where}."
            )
    return RopeScaling(rope_type=str(kind), **values)


def _positive(
    raw: dict[str, object],
    key: str,
    default: float | None,
    kind: type,
    zero_ok: bool = False,
    where: str = "",
) -> int | float:
    """raw[key] (or `default` when absent or null) as a positive int or finite float."""
    value = raw.get(key)
    if value is None and default is not None:
        return default
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int and not isinstance(value, int):
        number = False
    if not number or not (0 <= value if zero_ok else 0 < value) or value == float("inf"):
        what = "missing" if value is None else f"{value!r}, expected a positive {kind.__name__}"
        raise WeightsError(f"config.json: {where}{key} is {what}")
    return kind(value)


def _ids(value: object) -> tuple[int, ...]:
    values = value if isinstance(value, list) else [value]
    return tuple(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def _generation_eos(folder: Path) -> tuple[int, ...]:
    """Chat models often list their end-of-turn tokens only in generation_config.json."""
    path = folder / "generation_config.json"
    return _ids(_read_json(path).get("eos_token_id")) if path.is_file() else ()


def _shard_files(folder: Path) -> list[str]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        files = list(weight_map.values()) if isinstance(weight_map, dict) else [None]
        if not all(isinstance(f, str) and f and Path(f).name == f for f in files):
            raise WeightsError(f"{index}: weight_map must map tensor names to file names")
        return sorted(set(files))
    if not (folder / "model.safetensors").is_file():
        raise WeightsError(
            f"{folder} has neither model.safetensors nor model.safetensors.index.json"
        )
    return ["model.safetensors"]


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise WeightsError(f"{path}: unreadable JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise WeightsError(f"{path}: expected a JSON object")
    return data
