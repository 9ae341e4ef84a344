"""Which file a model name or path means (a bundled model, a .gguf file, a Hugging Face folder
or cache entry, an Ollama model), and its weights loaded by the loader for its format."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .gguf_loader import load_gguf
from .hf_loader import load_hf
from .model_sources import OLLAMA_PREFIX, hf_cache_model, ollama_model, parse_repo_spec
from .weights import (
    BUNDLED_MODELS,
    SPLIT_MODELS,
    ModelWeights,
    WeightsError,
    bundled_model_path,
    split_model_path,
)


def resolve_model_path(spec: str) -> Path:
    """The path to load for a bundled model name, a .gguf file, a Hugging Face folder, a repo
    in the Hugging Face cache (org/name[:QUANT]) or an Ollama model (ollama:NAME[:TAG])."""
    if spec in BUNDLED_MODELS:
        return bundled_model_path(BUNDLED_MODELS[spec])
    if spec in SPLIT_MODELS:
        return split_model_path(SPLIT_MODELS[spec])
    path = Path(spec).expanduser()
    if path.exists():
        return path.resolve()
    if spec.startswith(OLLAMA_PREFIX):
        return ollama_model(spec)
    if (repo := parse_repo_spec(spec)) is not None:
        return hf_cache_model(repo)
    known = ", ".join([*BUNDLED_MODELS, *SPLIT_MODELS])
    if path.suffix == ".gguf" or len(path.parts) > 1:
        raise WeightsError(f"model file or folder not found: {path}")
    raise WeightsError(
        f"{spec!r} is neither a bundled model nor an existing path; bundled models: {known} "
        "(or give a .gguf file, a Hugging Face folder, org/name from the Hugging Face cache "
        "or ollama:NAME; `kvchat models` lists them)"
    )


def load_weights(
    spec: str | Path, on_progress: Callable[[int, int], None] | None = None
) -> ModelWeights:
    """Load a GGUF file, a Hugging Face folder (config.json + safetensors) or a bundled model;
    `on_progress(done, total)` follows the tensors read."""
    path = resolve_model_path(spec) if isinstance(spec, str) else spec.expanduser().resolve()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise WeightsError(
                f"{path} is a folder without config.json; "
                "expected a Hugging Face model folder or a .gguf file"
            )
        return load_hf(path, on_progress)
    if path.is_file():
        return load_gguf(path, on_progress)
    raise WeightsError(f"model file or folder not found: {path}")
