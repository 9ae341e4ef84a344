"""Read a llama.cpp GGUF file into ModelWeights (Hugging Face names, float32, Q/K rows restored)."""

from __future__ import annotations

import math
import mmap
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from .gguf_header import TensorInfo, read_gguf_layout
from .model_config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeScaling, UnsupportedModelError
from .terminal_text import terminal_safe
from .weights import (
    Int4Groups,
    Int8Groups,
    LazyGroups,
    LazyTensors,
    ModelWeights,
    RowMaker,
    WeightsError,
    expected_shapes,
)

T = GGMLQuantizationType
SUPPORTED_TYPES = frozenset(
    {T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1}
    | {T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
)
# Types whose values fit 4 bits, with a scale and a minimum per 32 (per 16: Q2_K, Q3_K).
INT4_TYPES = frozenset({T.Q4_0, T.Q4_1, T.Q4_K, T.Q2_K, T.Q3_K})
# Types whose values are integers that fit int8, with one scale per 32 (per 16: Q6_K) and
# for Q5_1 and Q5_K a minimum.
INT8_TYPES = frozenset({T.Q8_0, T.Q5_0, T.Q5_1, T.Q5_K, T.Q6_K})
_PER_16 = frozenset({T.Q2_K, T.Q3_K, T.Q6_K})
_WITH_MINIMUM = frozenset({T.Q5_1, T.Q5_K})
# Types whose scales fp16 cannot hold: the K-quants' products of an fp16 and an integer.
_WIDE_SCALES = frozenset({T.Q4_K, T.Q2_K, T.Q3_K})
# llama.cpp's converter interleaves the Q/K rows of these architectures (Qwen2 is left alone).
PERMUTED_ARCHITECTURES = ("llama", "mistral")

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_LAYER_RE = re.compile(r"model\.layers\.(\d+)\.(.+)")


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name for a Hugging Face tensor name."""
    if match := _LAYER_RE.fullmatch(hf_name):
        return f"blk.{match[1]}.{_LAYER_NAMES[match[2]]}"
    return _GLOBAL_NAMES[hf_name]


def load_gguf(path: Path, on_progress: Callable[[int, int], None] | None = None) -> ModelWeights:
    """Every decoder tensor of a GGUF file: int4 groups (Q4_0, Q4_1, Q4_K, Q2_K, Q3_K) and
    int8 groups (Q8_0, Q5_0, Q5_1, Q5_K, Q6_K) for the types that keep them, float32 for
    all, each made from the file when read and not kept (LazyGroups, LazyTensors); the
    config, names, types and shapes are checked before anything is read.
    `on_progress(done, total)` follows the tensors as they are read."""
    reader = _File(path)
    metadata = reader.metadata
    by_name = {t.name: t for t in reader.tensors}
    config = config_from_gguf(metadata, by_name, path)
    planned = _plan(by_name, config, path)
    permute = config.architecture in PERMUTED_ARCHITECTURES
    makers: dict[str, tuple[RowMaker, tuple[int, ...]]] = {}
    tensors = LazyTensors(makers, on_progress)  # filled below
    int4: dict[str, Callable[[], Int4Groups]] = {}
    int8: dict[str, Callable[[], Int8Groups]] = {}
    # All array work is numpy: torch's two-thread kernels stall when other processes share the
    # cores (a 1536x576 int4 dequantization takes 37 ms instead of 0.3 ms on a loaded machine).
    for hf_name, (tensor, shape) in planned.items():
        part = _Part(reader, tensor, _permuted_heads(hf_name, config) if permute else None)
        if tensor.tensor_type in INT4_TYPES and len(shape) == 2:
            int4[hf_name] = part.int4_groups
            rows: Callable[[int, int], np.ndarray] = part.int4_rows
        elif tensor.tensor_type in INT8_TYPES and len(shape) == 2:
            int8[hf_name] = part.int8_groups
            rows = part.int8_rows
        else:
            rows = part.dequantized_rows
        makers[hf_name] = (partial(_float32, rows, shape), shape)
    return ModelWeights(
        config,
        tensors,
        LazyGroups(int4, tensors.report),
        path,
        metadata,
        LazyGroups(int8, tensors.report),
        {hf_name: tensor.tensor_type.name for hf_name, (tensor, _) in planned.items()},
    )


def int4_scale_itemsize(type_names: list[str]) -> int:
    """Bytes of each scale and minimum of a projection whose int4 parts have these types:
    fp16 holds Q4_0's and Q4_1's exactly, the K-quants' need fp32 (pack_int4)."""
    return 4 if any(t.name in type_names for t in _WIDE_SCALES) else 2


def group_size(type_names: list[str]) -> int:
    """Inputs per scale of a projection whose grouped parts have these types (Int4Groups.cat
    and Int8Groups.cat take the finest)."""
    return 16 if any(t.name in type_names for t in _PER_16) else 32


def int8_has_minimum(type_names: list[str]) -> bool:
    """Whether a projection whose int8 parts have these types holds minimums."""
    return any(t.name in type_names for t in _WITH_MINIMUM)


class _Part:
    """One tensor of the file, read a block of rows at a time (all of them where llama.cpp's
    Q/K interleave mixes rows: `heads`), its pages released from the process once read."""

    def __init__(self, reader: _File, tensor: _Tensor, heads: int | None) -> None:
        self.reader, self.tensor, self.heads = reader, tensor, heads
        self.rows = tensor.data.shape[0]

    def _read(self, start: int, stop: int, convert: Callable[[np.ndarray], tuple]) -> tuple:
        data = self.tensor.data
        if self.heads is not None:  # the interleave mixes rows: the whole tensor, then the rows
            whole = tuple(_unpermute(a, self.heads) for a in convert(data))
            self.reader.release(self.tensor, 0, self.rows)
            return tuple(a[start:stop] for a in whole)
        converted = convert(data[start:stop])
        self.reader.release(self.tensor, start, stop)
        return converted

    def int4_groups(self) -> Int4Groups:
        return Int4Groups(*map(torch.from_numpy, self.int4_arrays(0, self.rows)))

    def int8_groups(self) -> Int8Groups:
        return Int8Groups(*map(torch.from_numpy, self.int8_arrays(0, self.rows)))

    def int4_arrays(self, start: int, stop: int) -> tuple[np.ndarray, ...]:
        return self._read(start, stop, partial(_int4_groups, self.tensor.tensor_type))

    def int8_arrays(self, start: int, stop: int) -> tuple[np.ndarray, ...]:
        return self._read(start, stop, partial(_int8_groups, self.tensor.tensor_type))

    def int4_rows(self, start: int, stop: int) -> np.ndarray:
        # Bit-identical to gguf.quants.dequantize: the same float32 multiply, then add.
        q, scale, minimum = self.int4_arrays(start, stop)
        return q.reshape(*scale.shape, -1) * scale[..., None] + minimum[..., None]

    def int8_rows(self, start: int, stop: int) -> np.ndarray:
        q8, scale, *minimum = self.int8_arrays(start, stop)
        rows = q8.reshape(*scale.shape, -1) * scale[..., None]  # as gguf's dequantize
        return rows + minimum[0][..., None] if minimum else rows

    def dequantized_rows(self, start: int, stop: int) -> np.ndarray:
        return self._read(start, stop, self._dequantized)[0]

    def _dequantized(self, data: np.ndarray) -> tuple[np.ndarray]:
        # A copy of its own: gguf gives F32 rows as a view of the pages released next.
        values = dequantize(data, self.tensor.tensor_type)
        return (np.require(values, np.float32, ["C", "W", "O"]),)


def _float32(
    rows: Callable[[int, int], np.ndarray], shape: tuple[int, ...], start: int, stop: int
) -> torch.Tensor:
    # F32 comes back as a read-only view of the memory map; everything else is a fresh copy.
    values = rows(start, stop).reshape(stop - start, *shape[1:])
    return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))


@dataclass(frozen=True)
class _Tensor:
    """A tensor of the file: its data a read-only view of the file's memory map, shaped as
    gguf-py shapes it (the dims reversed; quantized types as bytes, a row's blocks last)."""

    name: str
    tensor_type: T
    shape: tuple[int, ...]  # the dims as the file lists them, the fastest-varying first
    data_offset: int  # in the file
    n_bytes: int
    data: np.ndarray


_PLAIN_DTYPES = {
    T.F32: np.float32, T.F16: np.float16, T.F64: np.float64,
    T.I8: np.int8, T.I16: np.int16, T.I32: np.int32, T.I64: np.int64,
}  # fmt: skip


class _File:
    """A GGUF file mapped into memory: its metadata, its tensors, and the release of the
    pages of the rows read."""

    def __init__(self, path: Path) -> None:
        try:
            with path.open("rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # mmap of an empty file raises ValueError
            raise WeightsError(f"{path} is not a readable GGUF file ({exc})") from exc
        layout = read_gguf_layout(self._map, path)
        self.metadata = layout.metadata
        data = np.frombuffer(self._map, np.uint8)
        self.tensors = [_tensor(info, layout.data_start, data, path) for info in layout.tensors]

    def release(self, tensor: _Tensor, start: int, stop: int) -> None:
        """Drop rows [start, stop) of `tensor` from the process's pages (the page cache keeps
        them; a later read maps them again): a load holds the pages of the rows it converts,
        not of the whole file (a 7B Q4_K_M file is 4.4 GiB)."""
        if not hasattr(mmap, "MADV_DONTNEED"):
            return
        row_bytes = tensor.n_bytes // tensor.data.shape[0]
        first = tensor.data_offset + start * row_bytes
        first -= first % mmap.PAGESIZE
        end = min(tensor.data_offset + stop * row_bytes, len(self._map))
        if end > first:
            self._map.madvise(mmap.MADV_DONTNEED, first, end - first)


def _tensor(info: TensorInfo, data_start: int, data: np.ndarray, path: Path) -> _Tensor:
    try:
        qtype = T(info.type_id)
        block, type_size = GGML_QUANT_SIZES[qtype]
    except (ValueError, KeyError):
        raise WeightsError(f"{path}: tensor {info.name} has unknown type {info.type_id}") from None
    dims = tuple(reversed(info.dims))
    if dims[-1] % block:
        raise WeightsError(f"{path}: tensor {info.name}'s rows are not whole {qtype.name} blocks")
    n_bytes = math.prod(dims) // block * type_size
    first = data_start + info.offset
    if first + n_bytes > data.size:
        raise WeightsError(
            f"{path} is truncated: tensor {info.name} needs bytes "
            f"{first}..{first + n_bytes} but the file has {data.size}"
        )
    raw = data[first : first + n_bytes]
    if qtype in _PLAIN_DTYPES:
        view = raw.view(_PLAIN_DTYPES[qtype]).reshape(dims)
    else:
        view = raw.reshape(*dims[:-1], dims[-1] // block * type_size)
    return _Tensor(info.name, qtype, info.dims, first, n_bytes, view)


def config_from_gguf(
    metadata: dict[str, object], tensors: dict[str, _Tensor], path: Path
) -> ModelConfig:
    """ModelConfig from the `{arch}.*` and `tokenizer.ggml.*` keys of a GGUF file."""
    arch = metadata.get("general.architecture")
    if not isinstance(arch, str):
        raise WeightsError(f"{path} has no general.architecture key")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: architecture {arch!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if "blk.0.attn_output.bias" in tensors:
        raise UnsupportedModelError(f"{path}: attention output biases are not supported")

    def number(key: str, default: float | None = None) -> float:
        value = metadata.get(f"{arch}.{key}", default)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            what = "missing" if value is None else f"invalid ({value!r})"
            raise WeightsError(f"{path}: metadata key {arch}.{key} is {what}")
        return value

    hidden = int(number("embedding_length"))
    heads = int(number("attention.head_count"))
    head_dim = int(number("attention.key_length", number("rope.dimension_count", hidden // heads)))
    rope_theta = float(number("rope.freq_base", 10000.0))
    max_positions = int(number("context_length"))
    return ModelConfig(
        architecture=arch,
        vocab_size=_vocab_size(metadata, tensors, arch),
        hidden_size=hidden,
        intermediate_size=int(number("feed_forward_length")),
        num_layers=int(number("block_count")),
        num_heads=heads,
        num_kv_heads=int(number("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(number("attention.layer_norm_rms_epsilon")),
        rope_theta=rope_theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in tensors,
        rope_scaling=_rope_scaling(metadata, tensors, arch, head_dim, rope_theta),
        bos_token_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(
            dict.fromkeys(
                metadata[key]
                for key in (
                    "tokenizer.ggml.eos_token_id",
                    "tokenizer.ggml.eot_token_id",
                    "tokenizer.ggml.eom_token_id",
                )
                if key in metadata
            )
        ),
        # Printed by `kvchat plan` and shown in the app: the file's text, never its controls.
        name=terminal_safe(str(metadata.get("general.name") or path.stem)),
    )


def _vocab_size(metadata: dict[str, object], tensors: dict[str, _Tensor], arch: str) -> int:
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list):
        return len(tokens)
    if isinstance(size := metadata.get(f"{arch}.vocab_size"), int):
        return size
    embedding = tensors.get("token_embd.weight")
    return int(embedding.shape[-1]) if embedding is not None else 0


def _rope_scaling(
    metadata: dict[str, object],
    tensors: dict[str, _Tensor],
    arch: str,
    head_dim: int,
    rope_theta: float,
) -> RopeScaling:
    if "rope_freqs.weight" in tensors:
        freqs = tensors["rope_freqs.weight"]
        factors = dequantize(freqs.data, freqs.tensor_type).astype(np.float64)
        return _llama3_scaling(factors.reshape(-1), head_dim, rope_theta)
    prefix = f"{arch}.rope.scaling."
    kind = metadata.get(prefix + "type", "none")
    if kind == "none" and f"{arch}.rope.scale_linear" in metadata:  # pre-2024 files
        return RopeScaling("linear", float(metadata[f"{arch}.rope.scale_linear"]))
    if kind == "none":
        return RopeScaling()
    optional = {
        "original_max_position_embeddings": metadata.get(prefix + "original_context_length"),
        "beta_fast": metadata.get(prefix + "yarn_beta_fast"),
        "beta_slow": metadata.get(prefix + "yarn_beta_slow"),
    }
    return RopeScaling(
        rope_type=str(kind),
        factor=float(metadata.get(prefix + "factor", 1.0)),
        **{k: v for k, v in optional.items() if v is not None},
    )


def _llama3_scaling(factors: np.ndarray, head_dim: int, rope_theta: float) -> RopeScaling:
    """Recover Llama 3 RoPE scaling from llama.cpp's per-frequency divisors (rope_freqs).

    The converter wrote 1/f = (1 - s)/factor + s with s = (L/wavelength - low)/(high - low),
    clipped to [0, 1]. The smooth band fixes factor, L/(high - low) and low/(high - low), which
    fix every frequency; low = 1 (as in every Llama 3.x release) picks one of the equivalent
    parameter sets.
    """
    factor = float(factors.max())
    if factor <= 1.0:
        return RopeScaling()
    inv_wavelength = rope_theta ** -(np.arange(0, head_dim, 2) / head_dim) / (2 * math.pi)
    smooth = (1 / factors - 1 / factor) / (1 - 1 / factor)
    band = (smooth > 1e-6) & (smooth < 1 - 1e-6)
    if band.sum() < 2 or len(factors) != len(inv_wavelength):
        raise UnsupportedModelError(
            "rope_freqs does not follow Llama 3 RoPE scaling (no smooth frequency band)"
        )
    slope, intercept = np.polyfit(inv_wavelength[band], smooth[band], 1)
    high = 1.0 - 1.0 / intercept
    return RopeScaling(
        rope_type="llama3",
        factor=round(factor, 6),
        original_max_position_embeddings=round(slope * (high - 1.0)),
        low_freq_factor=1.0,
        high_freq_factor=round(high, 6),
    )


def _plan(
    by_name: dict[str, _Tensor], config: ModelConfig, path: Path
) -> dict[str, tuple[_Tensor, tuple[int, ...]]]:
    """Check presence, type and shape of every needed tensor before reading any of them."""
    planned = {}
    for hf_name, shape in expected_shapes(config).items():
        name = gguf_tensor_name(hf_name)
        tensor = by_name.get(name)
        if tensor is None:
            raise WeightsError(f"{path}: missing tensor {name} ({hf_name})")
        if tensor.tensor_type not in SUPPORTED_TYPES:
            raise WeightsError(
                f"{path}: tensor {name} has type {tensor.tensor_type.name}, which kvchat "
                f"cannot read; supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}"
            )
        found = tuple(reversed(tensor.shape))
        if found != shape:
            raise WeightsError(
                f"{path}: tensor {name} has shape {found}, expected {shape} for {hf_name}"
            )
        planned[hf_name] = (tensor, shape)
    return planned


def _int4_groups(qtype: T, data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, scale, minimum) of rows of a Q4_0 / Q4_1 / Q4_K / Q2_K / Q3_K tensor's data, values
    0..15 with a scale and a minimum per 32 (per 16 for Q2_K and Q3_K) such that
    q * scale + minimum is exact."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
    if qtype == T.Q4_K:
        return _q4_k_groups(blocks)
    if qtype == T.Q2_K:
        return _q2_k_groups(blocks)
    if qtype == T.Q3_K:
        return _q3_k_groups(blocks)
    scale = _half(blocks[..., 0:2])
    if qtype == T.Q4_1:
        minimum, packed = _half(blocks[..., 2:4]), blocks[..., 4:]
    else:  # Q4_0 stores d * (q - 8); -8 * d is exact in float32, so q * d - 8 * d is too
        minimum, packed = scale * np.float32(-8.0), blocks[..., 2:]
    # Byte j of a block holds element j in its low nibble and element j + 16 in its high one.
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, -1)
    return q, scale, minimum


def _q4_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K super-blocks [rows, n, 144] as 4-bit groups of 32: sub-block j's value d * sc_j * q
    - dmin * m_j, with scale d * sc_j and minimum -(dmin * m_j), exact float32 products of an
    fp16 and a 6-bit integer (gguf's own arithmetic, so the sums are bit for bit its too)."""
    rows, n = blocks.shape[:2]
    scale, minimum = _k_scales(blocks)
    # Bytes 32 k .. 32 k + 31 of the 128 hold sub-block 2 k in their low nibbles, 2 k + 1 high.
    packed = blocks[..., 16:].reshape(rows, n, 4, 1, 32)
    q = np.concatenate([packed & 0x0F, packed >> 4], axis=-2)
    return q.reshape(rows, -1), scale, minimum


def _int8_groups(qtype: T, data: np.ndarray) -> tuple[np.ndarray, ...]:
    """(q, scale) of rows of a Q8_0, Q5_0 or Q6_K tensor's data, int8 values q such that
    q * scale is exact (a scale per 32 values, per 16 for Q6_K); (q, scale, minimum) of a Q5_1
    or Q5_K one, q * scale + minimum exact."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, GGML_QUANT_SIZES[qtype][1])
    if qtype == T.Q6_K:
        return _q6_k_groups(blocks)
    if qtype == T.Q5_K:
        return _q5_k_groups(blocks)
    if qtype == T.Q8_0:  # an fp16 scale, then 32 int8 values
        q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8)
        return q.reshape(rows, -1), _half(blocks[..., 0:2])
    # Q5_0: an fp16 scale, 32 high bits, 16 bytes of low nibbles; values 0..31 less 16.
    # Q5_1: an fp16 scale and minimum, then the same values 0..31.
    first = 4 if qtype == T.Q5_1 else 2
    high = np.unpackbits(blocks[..., first : first + 4], axis=-1, bitorder="little")  # bit i
    packed = blocks[..., first + 4 :]
    # Byte j of a block holds element j in its low nibble and element j + 16 in its high one.
    low = np.concatenate([packed & 0x0F, packed >> 4], axis=-1)
    q = low | (high << 4)
    if qtype == T.Q5_1:
        return q.view(np.int8).reshape(rows, -1), _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    q = (q - np.uint8(16)).view(np.int8)  # -16..15, wrapped in uint8
    return q.reshape(rows, -1), _half(blocks[..., 0:2])


def _q5_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q5_K super-blocks [rows, n, 176] as int8 values 0..31 in groups of 32 (its sub-blocks)
    with scale d * sc and minimum -(dmin * m), as Q4_K's (gguf's own arithmetic)."""
    rows, n = blocks.shape[:2]
    scale, minimum = _k_scales(blocks)
    # Bit j of byte i of the 32 high bytes is element i of sub-block j's fifth bit; bytes
    # 32 k .. 32 k + 31 of the 128 low ones hold sub-block 2 k in their low nibbles, 2 k + 1
    # in their high ones.
    high = blocks[..., 16:48].reshape(rows, n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]
    packed = blocks[..., 48:].reshape(rows, n, 4, 1, 32)
    low = np.concatenate([packed & 0x0F, packed >> 4], axis=-2).reshape(rows, n, 8, 32)
    q = (low | ((high & 0x01) << 4)).view(np.int8)
    return q.reshape(rows, -1), scale, minimum


def _k_scales(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's per-32 scale d * sc and minimum -(dmin * m) [rows, n * 8]: exact
    float32 products of an fp16 and a 6-bit integer, as gguf computes them."""
    rows, n = blocks.shape[:2]
    sc, m = (a.reshape(rows, n, 8) for a in Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12)))
    scale = _half(blocks[..., 0:2])[..., None] * sc.astype(np.float32)
    minimum = -(_half(blocks[..., 2:4])[..., None] * m.astype(np.float32))
    return scale.reshape(rows, -1), minimum.reshape(rows, -1)


def _q2_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q2_K super-blocks [rows, n, 84] as values 0..3 with a scale d * sc and a minimum
    -(dmin * m) per 16 (exact float32 products of an fp16 and a 4-bit integer, as gguf's)."""
    rows, n = blocks.shape[:2]
    scales = blocks[..., :16]
    scale = _half(blocks[..., 80:82])[..., None] * (scales & 0x0F).astype(np.float32)
    minimum = -(_half(blocks[..., 82:84])[..., None] * (scales >> 4).astype(np.float32))
    # Each half of 128 values: 32 bytes, value 32 i + j at bits 2 i of byte j.
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
    q = (blocks[..., 16:80].reshape(rows, n, 2, 1, 32) >> shifts) & 0x03
    return q.reshape(rows, -1), scale.reshape(rows, -1), minimum.reshape(rows, -1)


def _q3_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K super-blocks [rows, n, 110] as values 0..7 with a scale d * (sc - 32) and a minimum
    of -4 scales per 16: gguf's values -4..3 times the scale (sc a 6-bit integer: the products
    are exact in float32, as gguf computes them, and so are q * scale + minimum)."""
    rows, n = blocks.shape[:2]
    packed = blocks[..., 96:108]
    # Sixteen 6-bit scales: low 4 bits in bytes 0..7 (low nibbles, then high), high 2 bits
    # in bytes 8..11 (2 bits each).
    low = (packed[..., :8].reshape(rows, n, 1, 8) >> np.array([0, 4], np.uint8)[:, None]) & 0x0F
    high = (packed[..., 8:].reshape(rows, n, 1, 4) >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3
    sc = (low.reshape(rows, n, 16) | (high.reshape(rows, n, 16) << 4)).view(np.int8) - np.int8(32)
    scale = _half(blocks[..., 108:110])[..., None] * sc.astype(np.float32)
    # Each half of 128 values: 32 bytes of 2-bit parts (value 32 i + j at bits 2 i of byte j);
    # bit k of the 32 mask bytes' byte j, where clear, takes 4 from value 32 k + j: so the value
    # plus 4 is the 2-bit part plus 4 times that bit.
    shifts = np.array([0, 2, 4, 6], np.uint8)[:, None]
    two = (blocks[..., 32:96].reshape(rows, n, 2, 1, 32) >> shifts) & 0x03
    mask = (blocks[..., :32].reshape(rows, n, 1, 32) >> np.arange(8, dtype=np.uint8)[:, None]) & 1
    q = two.reshape(rows, n, 8, 32) | (mask << 2)
    scale = scale.reshape(rows, -1)
    return q.reshape(rows, -1), scale, scale * np.float32(-4.0)


def _q6_k_groups(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K super-blocks [rows, n, 210] as int8 values -32..31 with a scale per 16: d * sc, an
    exact float32 product of an fp16 and an int8 (as gguf computes it)."""
    rows, n = blocks.shape[:2]
    # Each half of 128 values: 64 bytes of low nibbles (values 0..63 low, then 64..127 high)
    # and 32 bytes of 2-bit high parts (values 32 i + j at bits 2 i of byte j).
    low = blocks[..., :128].reshape(rows, n, 2, 1, 64) >> np.array([0, 4], np.uint8)[:, None]
    high = (
        blocks[..., 128:192].reshape(rows, n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8)[:, None]
    )
    q = (low & 0x0F).reshape(rows, n, 2, 4, 32) | ((high & 0x03) << 4)
    scale = _half(blocks[..., 208:210])[..., None] * blocks[..., 192:208].view(np.int8)
    return (q - np.uint8(32)).view(np.int8).reshape(rows, -1), scale.reshape(rows, -1)


def _half(two_bytes: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(two_bytes).view(np.float16)[..., 0].astype(np.float32)


def _permuted_heads(hf_name: str, config: ModelConfig) -> int | None:
    if ".q_proj." in hf_name:
        return config.num_heads
    if ".k_proj." in hf_name:
        return config.num_kv_heads
    return None


def _unpermute(a: np.ndarray, heads: int | None) -> np.ndarray:
    """Undo llama.cpp's Q/K row interleave (convert_hf_to_gguf.py LlamaModel.permute)."""
    if heads is None:
        return a
    rows = a.shape[0]
    return a.reshape(heads, rows // heads // 2, 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
