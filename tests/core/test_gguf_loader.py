"""GGUF loading: every tensor type against independent references, the Q/K row permutation
against transformers' own GGUF loader, and the errors a user sees for bad files."""

from __future__ import annotations

import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGUFReader, GGUFWriter
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from kvchat.core.gguf_loader import load_gguf
from kvchat.core.model_config import RopeScaling, UnsupportedModelError
from kvchat.core.tokenizer import TokenizerError, load_tokenizer
from kvchat.core.weights import WeightsError

VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 32, 256, 512, 2, 4, 2  # K-quants need 256-wide rows
HEAD_DIM = HIDDEN // HEADS

# Hugging Face name -> llama.cpp name (gguf-py tensor_mapping.py), with the HF shape.
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": ("token_embd.weight", (VOCAB, HIDDEN)),
    "model.norm.weight": ("output_norm.weight", (HIDDEN,)),
}
LAYER_TENSORS = {
    "input_layernorm.weight": ("attn_norm.weight", (HIDDEN,)),
    "self_attn.q_proj.weight": ("attn_q.weight", (HEADS * HEAD_DIM, HIDDEN)),
    "self_attn.k_proj.weight": ("attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "self_attn.v_proj.weight": ("attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN)),
    "self_attn.o_proj.weight": ("attn_output.weight", (HIDDEN, HEADS * HEAD_DIM)),
    "post_attention_layernorm.weight": ("ffn_norm.weight", (HIDDEN,)),
    "mlp.gate_proj.weight": ("ffn_gate.weight", (INTER, HIDDEN)),
    "mlp.up_proj.weight": ("ffn_up.weight", (INTER, HIDDEN)),
    "mlp.down_proj.weight": ("ffn_down.weight", (HIDDEN, INTER)),
}
QWEN2_BIASES = {
    "self_attn.q_proj.bias": ("attn_q.bias", (HEADS * HEAD_DIM,)),
    "self_attn.k_proj.bias": ("attn_k.bias", (KV_HEADS * HEAD_DIM,)),
    "self_attn.v_proj.bias": ("attn_v.bias", (KV_HEADS * HEAD_DIM,)),
}


def tensor_table(arch: str, tied: bool = True) -> dict[str, tuple[str, tuple[int, ...]]]:
    table = dict(GLOBAL_TENSORS)
    layer = LAYER_TENSORS | (QWEN2_BIASES if arch == "qwen2" else {})
    for i in range(LAYERS):
        table |= {f"model.layers.{i}.{hf}": (f"blk.{i}.{g}", s) for hf, (g, s) in layer.items()}
    if not tied:
        table["lm_head.weight"] = ("output.weight", (VOCAB, HIDDEN))
    return table


# Every HF name of the tiny models -> its GGUF name (Qwen2 untied has them all).
GGUF_NAMES = {hf: gguf for hf, (gguf, _) in tensor_table("qwen2", tied=False).items()}


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute: HF rows -> GGUF rows."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def to_gguf_rows(hf_name: str, w: np.ndarray, arch: str) -> np.ndarray:
    if arch == "qwen2":
        return w
    if ".q_proj." in hf_name:
        return permute(w, HEADS)
    if ".k_proj." in hf_name:
        return permute(w, KV_HEADS)
    return w


def base_metadata(arch: str) -> dict[str, object]:
    return {
        "general.name": "tiny",
        f"{arch}.block_count": LAYERS,
        f"{arch}.context_length": 128,
        f"{arch}.embedding_length": HIDDEN,
        f"{arch}.feed_forward_length": INTER,
        f"{arch}.attention.head_count": HEADS,
        f"{arch}.attention.head_count_kv": KV_HEADS,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5,
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": [f"t{i}" for i in range(VOCAB)],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
    }


def write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray | tuple[np.ndarray, T]],
    metadata: dict[str, object],
) -> Path:
    """Write a GGUF; a tensor is a float array or (raw block bytes, type). None drops a key."""
    writer = GGUFWriter(path, arch)
    for key, value in metadata.items():
        if value is None:
            continue
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_array(key, value)
    for name, value in tensors.items():
        data, qtype = value if isinstance(value, tuple) else (value, None)
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def random_model(arch: str = "llama", tied: bool = True, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        hf: rng.standard_normal(shape).astype(np.float32)
        for hf, (_, shape) in tensor_table(arch, tied).items()
    }


def write_model(
    path: Path,
    hf: dict[str, np.ndarray],
    arch: str = "llama",
    weight_type: T = T.F32,
    metadata: dict[str, object] | None = None,
) -> Path:
    """Write HF-layout weights the way llama.cpp does: Q/K rows permuted, matrices quantized."""
    tensors = {}
    for name, w in hf.items():
        rows = to_gguf_rows(name, w, arch)
        qtype = weight_type if w.ndim == 2 else T.F32
        tensors[GGUF_NAMES[name]] = (quantize(rows, qtype), qtype)
    return write_gguf(path, arch, tensors, base_metadata(arch) | (metadata or {}))


# --- float and legacy quant types: quantize known weights, bound the error ------------------


def quant_step(w: np.ndarray, qtype: T) -> np.ndarray:
    """Per element, the quantization step of its 32-wide block.

    The worst error is one step (an extreme clipped to the far end of the grid), plus the fp16
    rounding of the block scale times up to 16 steps: under 1% of a step.
    """
    blocks = w.reshape(-1, 32)
    amax, span = np.abs(blocks).max(1), blocks.max(1) - blocks.min(1)
    step = {
        T.Q8_0: amax / 127,
        T.Q4_0: amax / 8,
        T.Q4_1: span / 15,
        T.Q5_0: amax / 16,
        T.Q5_1: span / 31,
    }[qtype]
    return np.repeat(step * 1.01, 32).reshape(w.shape)


@pytest.mark.parametrize(
    "qtype", [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1], ids=lambda t: t.name
)
def test_quantizable_types_load_within_their_error_bound(tmp_path, qtype):
    hf = random_model()
    weights = load_gguf(write_model(tmp_path / "m.gguf", hf, weight_type=qtype))

    assert weights.tensors.keys() == hf.keys()
    for name, want in hf.items():
        got = weights.tensors[name]
        assert got.dtype == torch.float32 and got.is_contiguous()
        got = got.numpy()
        if qtype == T.F32 or want.ndim == 1:
            np.testing.assert_array_equal(got, want, err_msg=name)
        elif qtype == T.F16:
            np.testing.assert_allclose(got, want, rtol=2**-11, atol=2**-25, err_msg=name)
        elif qtype == T.BF16:
            np.testing.assert_allclose(got, want, rtol=2**-8, atol=0, err_msg=name)
        else:
            assert (np.abs(got - want) <= quant_step(want, qtype)).all(), name


@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1], ids=lambda t: t.name)
def test_int4_groups_reproduce_the_gguf_dequantization_exactly(tmp_path, qtype):
    hf = random_model()
    path = write_model(tmp_path / "m.gguf", hf, weight_type=qtype)
    weights = load_gguf(path)
    in_file = {t.name: t for t in GGUFReader(path).tensors}

    matrices = [name for name, w in hf.items() if w.ndim == 2]
    assert sorted(weights.int4) == sorted(matrices)
    for name in matrices:
        groups = weights.int4[name]
        out_features, in_features = hf[name].shape
        assert groups.q.dtype == torch.uint8 and groups.q.shape == (out_features, in_features)
        assert int(groups.q.max()) <= 15
        assert groups.scale.dtype == groups.minimum.dtype == torch.float32
        assert groups.scale.shape == groups.minimum.shape == (out_features, in_features // 32)
        expand = lambda t: t.repeat_interleave(32, dim=1)  # noqa: E731
        rebuilt = groups.q.to(torch.float32) * expand(groups.scale) + expand(groups.minimum)
        assert torch.equal(rebuilt, weights.tensors[name]), name
        assert torch.equal(groups.dequantize(), weights.tensors[name]), name
        # ...and the float tensor is gguf's own dequantization, rows restored to HF order.
        raw = in_file[GGUF_NAMES[name]].data
        assert np.array_equal(to_gguf_rows(name, rebuilt.numpy(), "llama"), dequantize(raw, qtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_building_the_model_reports_every_tensor_once(tmp_path, dtype):
    """Progress counts the tensors read as groups (bf16: the int4 and int8 layers) as well as
    those read as floats, each once, up to the total."""
    from kvchat.core.model import Transformer

    hf = random_model(tied=False)
    tensors = {}
    for name, w in hf.items():
        qtype = (T.Q8_0 if name == "lm_head.weight" else T.Q4_0) if w.ndim == 2 else T.F32
        tensors[GGUF_NAMES[name]] = (quantize(w, qtype), qtype)
    path = write_gguf(tmp_path / "m.gguf", "llama", tensors, base_metadata("llama"))
    progress: list[tuple[int, int]] = []
    weights = load_gguf(path, lambda done, total: progress.append((done, total)))
    Transformer(weights, dtype=dtype, weight_format="int4" if dtype == torch.bfloat16 else "dense")
    assert progress == [(i, len(hf)) for i in range(1, len(hf) + 1)]


# --- K-quants: raw blocks against a dequantizer written from ggml-quants.c ------------------


def half(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[:, at : at + 2].copy().view(np.float16)[:, 0].astype(np.float32)


def ref_q2_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q2_K; block_q2_K = {scales[16], qs[64], d, dmin}."""
    scales, qs, d, dmin = b[:, :16], b[:, 16:80], half(b, 80), half(b, 82)
    y = np.empty((len(b), 256), np.float32)
    for n in range(2):
        q = qs[:, 32 * n : 32 * n + 32]
        for j in range(4):
            for h in range(2):
                sc = scales[:, 8 * n + 2 * j + h]
                dl, ml = d * (sc & 0xF), dmin * (sc >> 4)
                vals = (q[:, 16 * h : 16 * h + 16] >> (2 * j)) & 3
                at = 128 * n + 32 * j + 16 * h
                y[:, at : at + 16] = dl[:, None] * vals - ml[:, None]
    return y


def ref_q3_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q3_K; block_q3_K = {hmask[32], qs[64], scales[12], d}."""
    hmask, qs, d = b[:, :32], b[:, 32:96], half(b, 108)
    a0, a1, tmp = b[:, 96:108].copy().view("<u4").T
    km1, km2 = np.uint32(0x03030303), np.uint32(0x0F0F0F0F)
    aux = np.stack(
        [
            (a0 & km2) | (((tmp >> 0) & km1) << 4),
            (a1 & km2) | (((tmp >> 2) & km1) << 4),
            ((a0 >> 4) & km2) | (((tmp >> 4) & km1) << 4),
            ((a1 >> 4) & km2) | (((tmp >> 6) & km1) << 4),
        ],
        axis=1,
    ).astype("<u4")
    scales = aux.view(np.int8).astype(np.float32) - 32
    y = np.empty((len(b), 256), np.float32)
    m = 1
    for n in range(2):
        q = qs[:, 32 * n : 32 * n + 32]
        for j in range(4):
            for h in range(2):
                part = slice(16 * h, 16 * h + 16)
                dl = d * scales[:, 8 * n + 2 * j + h]
                low = ((q[:, part] >> (2 * j)) & 3).astype(np.float32)
                high = np.where(hmask[:, part] & m, 0, 4)
                at = 128 * n + 32 * j + 16 * h
                y[:, at : at + 16] = dl[:, None] * (low - high)
            m <<= 1
    return y


def scale_min_k4(j: int, q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    if j < 4:
        return q[:, j] & 63, q[:, j + 4] & 63
    return (q[:, j + 4] & 0xF) | ((q[:, j - 4] >> 6) << 4), (q[:, j + 4] >> 4) | (
        (q[:, j] >> 6) << 4
    )


def ref_q4_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q4_K; block_q4_K = {d, dmin, scales[12], qs[128]}."""
    d, dmin, scales, qs = half(b, 0), half(b, 2), b[:, 4:16], b[:, 16:144]
    y = np.empty((len(b), 256), np.float32)
    for k in range(4):
        (sc1, m1), (sc2, m2) = scale_min_k4(2 * k, scales), scale_min_k4(2 * k + 1, scales)
        q = qs[:, 32 * k : 32 * k + 32]
        y[:, 64 * k : 64 * k + 32] = (d * sc1)[:, None] * (q & 0xF) - (dmin * m1)[:, None]
        y[:, 64 * k + 32 : 64 * k + 64] = (d * sc2)[:, None] * (q >> 4) - (dmin * m2)[:, None]
    return y


def ref_q5_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q5_K; block_q5_K = {d, dmin, scales[12], qh[32], qs[128]}."""
    d, dmin, scales, qh, ql = half(b, 0), half(b, 2), b[:, 4:16], b[:, 16:48], b[:, 48:176]
    y = np.empty((len(b), 256), np.float32)
    u1, u2 = 1, 2
    for k in range(4):
        (sc1, m1), (sc2, m2) = scale_min_k4(2 * k, scales), scale_min_k4(2 * k + 1, scales)
        q = ql[:, 32 * k : 32 * k + 32]
        lo = (q & 0xF) + np.where(qh & u1, 16, 0)
        hi = (q >> 4) + np.where(qh & u2, 16, 0)
        y[:, 64 * k : 64 * k + 32] = (d * sc1)[:, None] * lo - (dmin * m1)[:, None]
        y[:, 64 * k + 32 : 64 * k + 64] = (d * sc2)[:, None] * hi - (dmin * m2)[:, None]
        u1, u2 = u1 << 2, u2 << 2
    return y


def ref_q6_k(b: np.ndarray) -> np.ndarray:
    """dequantize_row_q6_K; block_q6_K = {ql[128], qh[64], int8 scales[16], d}."""
    ql, qh, sc, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), half(b, 208)
    y = np.empty((len(b), 256), np.float32)
    for n in range(2):
        lo, hi, s = ql[:, 64 * n : 64 * n + 64], qh[:, 32 * n : 32 * n + 32], sc[:, 8 * n :]
        for h in range(2):
            part, far = slice(16 * h, 16 * h + 16), slice(32 + 16 * h, 48 + 16 * h)
            quads = [
                (lo[:, part] & 0xF) | (((hi[:, part] >> 0) & 3) << 4),
                (lo[:, far] & 0xF) | (((hi[:, part] >> 2) & 3) << 4),
                (lo[:, part] >> 4) | (((hi[:, part] >> 4) & 3) << 4),
                (lo[:, far] >> 4) | (((hi[:, part] >> 6) & 3) << 4),
            ]
            for r, q in enumerate(quads):
                at = 128 * n + 32 * r + 16 * h
                scale = d * s[:, h + 2 * r]
                y[:, at : at + 16] = scale[:, None] * (q.astype(np.float32) - 32)
    return y


# type -> (block bytes, offsets of its fp16 scale fields, reference dequantizer)
K_QUANTS = {
    T.Q2_K: (84, (80, 82), ref_q2_k),
    T.Q3_K: (110, (108,), ref_q3_k),
    T.Q4_K: (144, (0, 2), ref_q4_k),
    T.Q5_K: (176, (0, 2), ref_q5_k),
    T.Q6_K: (210, (208,), ref_q6_k),
}


def random_blocks(
    rng: np.random.Generator, qtype: T, shape: tuple[int, int], scale: float = 1e-2
) -> np.ndarray:
    """Random block bytes for a [rows, cols] tensor, with sane fp16 super-block scales (up to
    `scale`)."""
    size, halves, _ = K_QUANTS[qtype]
    n_blocks = shape[0] * shape[1] // 256
    blocks = rng.integers(0, 256, (n_blocks, size), dtype=np.uint8)
    for at in halves:
        values = rng.uniform(scale / 10, scale, n_blocks).astype(np.float16)
        blocks[:, at : at + 2] = values.view(np.uint8).reshape(n_blocks, 2)
    return blocks.reshape(shape[0], -1)


@pytest.mark.parametrize("qtype", list(K_QUANTS), ids=lambda t: t.name)
def test_k_quants_match_an_independent_dequantizer(tmp_path, qtype):
    assert GGML_QUANT_SIZES[qtype] == (256, K_QUANTS[qtype][0])
    rng = np.random.default_rng(1)
    ref = K_QUANTS[qtype][2]
    tensors, expected = {}, {}  # GGUF name -> bytes; HF name -> floats in GGUF row order
    for hf, (name, shape) in tensor_table("llama").items():
        if len(shape) == 1:
            tensors[name] = expected[hf] = rng.standard_normal(shape).astype(np.float32)
            continue
        raw = random_blocks(rng, qtype, shape)
        tensors[name] = (raw, qtype)
        expected[hf] = ref(raw.reshape(-1, K_QUANTS[qtype][0])).reshape(shape)
    path = write_gguf(tmp_path / "k.gguf", "llama", tensors, base_metadata("llama"))

    weights = load_gguf(path)

    for hf, want in expected.items():
        got = to_gguf_rows(hf, weights.tensors[hf].numpy(), "llama")
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6, err_msg=hf)


@pytest.mark.parametrize(
    ("qtype", "kind", "group_size"),
    [
        (T.Q2_K, "int4", 16),
        (T.Q3_K, "int4", 16),
        (T.Q4_K, "int4", 32),
        (T.Q5_K, "int8", 32),
        (T.Q6_K, "int8", 16),
    ],
    ids=["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"],
)
def test_k_quant_groups_reproduce_the_gguf_dequantization_exactly(
    tmp_path, qtype, kind, group_size
):
    """Q4_K's sub-blocks are 4-bit groups of 32 (scale d * sc, minimum -dmin * m), Q2_K's
    4-bit groups of 16 (values 0..3, the same scale and minimum), Q3_K's 4-bit groups of 16
    (values 0..7: gguf's -4..3 plus 4, scale d * (sc - 32), minimum -4 scales), Q5_K's int8
    groups of 32 (Q4_K's scale and minimum, values 0..31) and Q6_K's int8 groups of 16 (scale
    d * sc, values -32..31): gguf's own values, bit for bit."""
    rng = np.random.default_rng(2)
    tensors = {}
    for name, shape in tensor_table("llama").values():
        raw = rng.standard_normal(shape).astype(np.float32) if len(shape) == 1 else None
        tensors[name] = raw if raw is not None else (random_blocks(rng, qtype, shape), qtype)
    path = write_gguf(tmp_path / "k.gguf", "llama", tensors, base_metadata("llama"))
    weights = load_gguf(path)
    in_file = {t.name: t for t in GGUFReader(path).tensors}

    held = weights.int4 if kind == "int4" else weights.int8
    assert (weights.int8 if kind == "int4" else weights.int4) == {}
    matrices = [hf for hf, (_, shape) in tensor_table("llama").items() if len(shape) == 2]
    assert sorted(held) == sorted(matrices)
    for hf in matrices:
        groups = held[hf]
        rows, columns = weights.tensors.shape(hf)
        assert groups.scale.shape == (rows, columns // group_size)
        rebuilt = groups.dequantize()
        assert torch.equal(rebuilt, weights.tensors[hf]), hf
        raw = in_file[GGUF_NAMES[hf]].data
        assert np.array_equal(to_gguf_rows(hf, rebuilt.numpy(), "llama"), dequantize(raw, qtype))
        low, high = {T.Q5_K: (0, 31), T.Q3_K: (0, 7), T.Q2_K: (0, 3), T.Q4_K: (0, 15)}.get(
            qtype, (-32, 31)
        )
        assert low <= int(groups.q.min()) and int(groups.q.max()) <= high


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q5_1], ids=lambda t: t.name)
def test_int8_groups_reproduce_the_gguf_dequantization_exactly(tmp_path, qtype):
    """Q5_0's 5-bit values less 16 fit int8 as Q8_0's do, and Q5_1's 0..31 with their
    minimum: the same groups, exact."""
    hf = random_model()
    path = write_model(tmp_path / "m.gguf", hf, weight_type=qtype)
    weights = load_gguf(path)
    in_file = {t.name: t for t in GGUFReader(path).tensors}

    matrices = [name for name, w in hf.items() if w.ndim == 2]
    assert sorted(weights.int8) == sorted(matrices) and not weights.int4
    for name in matrices:
        groups = weights.int8[name]
        out_features, in_features = hf[name].shape
        assert groups.q.dtype == torch.int8 and groups.q.shape == (out_features, in_features)
        assert groups.scale.dtype == torch.float32
        assert groups.scale.shape == (out_features, in_features // 32)
        rebuilt = groups.dequantize()
        assert torch.equal(rebuilt, weights.tensors[name]), name
        raw = in_file[GGUF_NAMES[name]].data
        assert np.array_equal(to_gguf_rows(name, rebuilt.numpy(), "llama"), dequantize(raw, qtype))
        if qtype == T.Q5_0:
            assert -16 <= int(groups.q.min()) and int(groups.q.max()) <= 15
        assert (groups.minimum is not None) == (qtype == T.Q5_1)


def test_int8_layers_run_q5_0_and_q8_0_weights_close_to_their_exact_values(tmp_path):
    """bf16 on the CPU: a Qwen2 model's Q5_0 projections (biases and all) and its Q8_0 output
    layer run on their int8 groups, a prompt pass through the unpacked weights and decode
    steps through the int8 products, within bf16's reach of the fp32 model on the exact
    weights; the memory they hold is the groups', not bf16 copies."""
    from kvchat.core import cpu_ops
    from kvchat.core.linear import Int8Linear
    from kvchat.core.model import Transformer

    if cpu_ops.load() is None:
        pytest.skip("no C++ compiler: the int8 products are not built")
    hf = random_model("qwen2", tied=False)
    hf = {name: w * 0.05 for name, w in hf.items()}  # a stable scale through the layers
    path = tmp_path / "m.gguf"
    tensors = {}
    for name, w in hf.items():
        qtype = (T.Q8_0 if name == "lm_head.weight" else T.Q5_0) if w.ndim == 2 else T.F32
        tensors[GGUF_NAMES[name]] = (quantize(w, qtype), qtype)
    write_gguf(path, "qwen2", tensors, base_metadata("qwen2"))
    model = Transformer(load_gguf(path), dtype=torch.bfloat16, weight_format="int4")
    exact = Transformer(load_gguf(path), dtype=torch.float32, weight_format="dense")
    linears = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    assert all(isinstance(m, Int8Linear) for m in [*linears, model.lm_head])
    matrices = sum(w.size for name, w in hf.items() if w.ndim == 2 and "embed" not in name)
    assert sum(m.nbytes for m in [*linears, model.lm_head]) < 1.2 * matrices  # int8, padded

    _assert_close_to_exact(model, exact)


def _assert_close_to_exact(model, exact) -> None:
    """The bf16 model's logits for an 80-token prompt pass (past UNPACK_ROWS: the unpacked
    weights) and three decode steps (the integer products) within 3% of the largest of the
    fp32 model's on the exact weights."""
    from kvchat.kv.dense import DenseBackend

    cfg = model.cfg
    prompt = torch.tensor([3, 17, 5, 29, 11, 2, 8, 30] * 10)

    def run(m, dtype: torch.dtype) -> list[torch.Tensor]:
        cache = DenseBackend(
            cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, m.rope, dtype, "cpu", 96
        )
        logits = [m.forward(prompt, cache)]
        for token in (4, 9, 21):
            logits.append(m.forward(torch.tensor([token]), cache))
        return logits

    for got, want in zip(run(model, torch.bfloat16), run(exact, torch.float32), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max().item())


# --- the real model: Q/K permutation and everything else against transformers --------------


@pytest.fixture(scope="module")
def transformers_smollm2(smollm2_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            smollm2_path.parent, gguf_file=smollm2_path.name
        )
    return model


def test_smollm2_matches_transformers_gguf_loader(smollm2_weights, transformers_smollm2):
    ours = smollm2_weights.tensors
    theirs = transformers_smollm2.state_dict()
    assert smollm2_weights.config.tie_word_embeddings
    assert set(theirs) - set(ours) == {"lm_head.weight"}
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    # q_proj / k_proj are the permuted ones; equality of every tensor covers them too.
    unequal = [name for name, t in ours.items() if not torch.equal(t, theirs[name])]
    assert unequal == []
    # The tied embedding is Q8_0 in this file: its int8 groups are the same table.
    embed = smollm2_weights.int8["model.embed_tokens.weight"].dequantize()
    assert torch.equal(embed, theirs["lm_head.weight"])
    for layer in (0, 29):  # the int4 groups carry the same row order
        for proj in ("q_proj", "k_proj"):
            name = f"model.layers.{layer}.self_attn.{proj}.weight"
            assert torch.equal(smollm2_weights.int4[name].dequantize(), theirs[name]), name


def test_smollm2_config_matches_transformers(smollm2_weights, transformers_smollm2):
    cfg, hf = smollm2_weights.config, transformers_smollm2.config
    assert cfg.architecture == "llama"
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (
        hf.num_hidden_layers,
        hf.hidden_size,
        hf.intermediate_size,
    )
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        hf.num_attention_heads,
        hf.num_key_value_heads,
        hf.head_dim,
    )
    assert cfg.vocab_size == hf.vocab_size == 49152
    assert cfg.max_position_embeddings == hf.max_position_embeddings == 8192
    assert cfg.rope_theta == hf.rope_parameters["rope_theta"] == 100000.0
    assert cfg.rms_norm_eps == 1e-5 and math.isclose(
        cfg.rms_norm_eps, hf.rms_norm_eps, rel_tol=1e-6
    )
    assert cfg.rope_scaling == RopeScaling()
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    assert len(smollm2_weights.int4) == 30 * 7  # every layer matrix is Q4_1; the embedding is Q8_0
    assert smollm2_weights.metadata["tokenizer.ggml.model"] == "gpt2"
    assert len(smollm2_weights.metadata["tokenizer.ggml.tokens"]) == 49152


# --- config, architectures and metadata -----------------------------------------------------


def test_tiny_llama_config_and_metadata(tmp_path):
    meta = {"tokenizer.ggml.eot_token_id": 3, "llama.rope.freq_base": 500000.0}
    weights = load_gguf(write_model(tmp_path / "m.gguf", random_model(), metadata=meta))
    cfg = weights.config
    assert (cfg.architecture, cfg.name, cfg.vocab_size) == ("llama", "tiny", VOCAB)
    assert (cfg.num_layers, cfg.hidden_size, cfg.intermediate_size) == (LAYERS, HIDDEN, INTER)
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (HEADS, KV_HEADS, HEAD_DIM)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (1e-5, 5e5, 128)
    assert cfg.tie_word_embeddings and not cfg.attention_bias
    assert (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2, 3))
    assert weights.metadata["general.architecture"] == "llama"
    assert weights.metadata["tokenizer.ggml.tokens"][:2] == ["t0", "t1"]
    assert weights.source == tmp_path / "m.gguf"


def test_rope_freq_base_defaults_to_10000(tmp_path):
    weights = load_gguf(write_model(tmp_path / "m.gguf", random_model()))
    assert weights.config.rope_theta == 10000.0


def test_untied_output_becomes_lm_head(tmp_path):
    hf = random_model(tied=False)
    weights = load_gguf(write_model(tmp_path / "m.gguf", hf))
    assert not weights.config.tie_word_embeddings
    np.testing.assert_array_equal(weights.tensors["lm_head.weight"].numpy(), hf["lm_head.weight"])


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_other_architectures(tmp_path, arch):
    hf = random_model(arch)
    weights = load_gguf(write_model(tmp_path / "m.gguf", hf, arch=arch))
    assert weights.config.architecture == arch
    assert weights.config.attention_bias == (arch == "qwen2")
    assert weights.tensors.keys() == hf.keys()
    for name, want in hf.items():  # to_gguf_rows left Qwen2 unpermuted, permuted Mistral
        np.testing.assert_array_equal(weights.tensors[name].numpy(), want, err_msg=name)


def test_llama_qkv_biases_are_unpermuted_like_their_weights(tmp_path):
    hf = random_model("qwen2")  # has q/k/v biases; written as llama, so permuted
    weights = load_gguf(write_model(tmp_path / "m.gguf", hf, arch="llama"))
    assert weights.config.attention_bias
    for name, want in hf.items():
        np.testing.assert_array_equal(weights.tensors[name].numpy(), want, err_msg=name)


def test_attention_output_bias_is_unsupported(tmp_path):
    hf = random_model()
    tensors = {GGUF_NAMES[n]: to_gguf_rows(n, w, "llama") for n, w in hf.items()}
    tensors["blk.0.attn_output.bias"] = np.zeros(HIDDEN, np.float32)
    path = write_gguf(tmp_path / "m.gguf", "llama", tensors, base_metadata("llama"))
    with pytest.raises(UnsupportedModelError, match="attention output biases"):
        load_gguf(path)


def test_linear_rope_scaling_from_metadata(tmp_path):
    meta = {
        "llama.rope.scaling.type": "linear",
        "llama.rope.scaling.factor": 4.0,
        "llama.rope.scaling.original_context_length": 32,
    }
    weights = load_gguf(write_model(tmp_path / "m.gguf", random_model(), metadata=meta))
    assert weights.config.rope_scaling == RopeScaling("linear", 4.0, 32)


def llama3_rope_factors(
    theta: float, dim: int, factor: float, low: float, high: float, original: int
) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors (rope_freqs.weight)."""
    freqs = 1.0 / (theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    low_wavelen, high_wavelen = original / low, original / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_wavelen:
            factors.append(1)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_llama3_rope_scaling_recovered_from_rope_freqs(tmp_path):
    # A small trained context puts several of the 32 frequencies in the smooth band.
    factors = llama3_rope_factors(500000.0, HEAD_DIM, 8.0, 1.0, 4.0, original=64)
    hf = random_model()
    tensors = {GGUF_NAMES[n]: to_gguf_rows(n, w, "llama") for n, w in hf.items()}
    tensors["rope_freqs.weight"] = factors
    meta = base_metadata("llama") | {"llama.rope.freq_base": 500000.0}
    weights = load_gguf(write_gguf(tmp_path / "m.gguf", "llama", tensors, meta))

    rs = weights.config.rope_scaling
    assert (rs.rope_type, rs.factor, rs.low_freq_factor) == ("llama3", 8.0, 1.0)
    assert rs.original_max_position_embeddings == 64
    assert math.isclose(rs.high_freq_factor, 4.0, rel_tol=1e-4)
    assert "rope_freqs.weight" not in weights.tensors


# --- errors -------------------------------------------------------------------------------


def test_truncated_real_file(tmp_path, smollm2_path):
    cut = tmp_path / "half.gguf"
    with smollm2_path.open("rb") as src:
        cut.write_bytes(src.read(smollm2_path.stat().st_size // 2))
    with pytest.raises(WeightsError, match=r"half\.gguf.*truncated"):
        load_gguf(cut)


def test_file_cut_inside_its_header(tmp_path):
    full = write_model(tmp_path / "m.gguf", random_model())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(full.read_bytes()[:200])
    with pytest.raises(WeightsError, match=r"cut\.gguf"):
        load_gguf(cut)


@pytest.mark.parametrize("content", [b"", b"\x00" * 10, b"GGUF" + bytes(range(256)) * 8])
def test_garbage_with_a_gguf_name(tmp_path, content):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(content)
    with pytest.raises(WeightsError, match=r"garbage\.gguf is not a readable GGUF file"):
        load_gguf(path)


@pytest.mark.parametrize("arch", ["gpt2", "phi3"])
def test_unsupported_architecture_is_reported_before_any_tensor_is_read(tmp_path, arch):
    # No llama-style keys and a tensor of a type kvchat cannot read: only the architecture
    # check can produce an UnsupportedModelError here.
    tensors = {"token_embd.weight": (np.zeros((4, 18), np.uint8), T.IQ4_NL)}
    path = write_gguf(tmp_path / "m.gguf", arch, tensors, {"general.name": "other"})
    with pytest.raises(UnsupportedModelError) as info:
        load_gguf(path)
    message = str(info.value)
    assert repr(arch) in message and "llama, mistral, qwen2" in message


def test_missing_tensor(tmp_path):
    hf = random_model()
    del hf["model.layers.1.mlp.up_proj.weight"]
    path = write_model(tmp_path / "missing.gguf", hf)
    with pytest.raises(WeightsError, match=r"missing\.gguf: missing tensor blk\.1\.ffn_up\.weight"):
        load_gguf(path)


def test_shape_mismatch(tmp_path):
    hf = random_model()
    hf["model.layers.0.self_attn.k_proj.weight"] = np.zeros((HEAD_DIM, HIDDEN), np.float32)
    with pytest.raises(WeightsError, match=r"blk\.0\.attn_k\.weight has shape \(64, 256\), "):
        load_gguf(write_model(tmp_path / "m.gguf", hf))


def test_unsupported_tensor_type(tmp_path):
    hf = random_model()
    tensors = {GGUF_NAMES[n]: to_gguf_rows(n, w, "llama") for n, w in hf.items()}
    tensors["blk.0.ffn_gate.weight"] = (np.zeros((INTER, HIDDEN // 32 * 18), np.uint8), T.IQ4_NL)
    path = write_gguf(tmp_path / "m.gguf", "llama", tensors, base_metadata("llama"))
    with pytest.raises(WeightsError, match=r"blk\.0\.ffn_gate\.weight has type IQ4_NL"):
        load_gguf(path)


def test_missing_metadata_key(tmp_path):
    meta = {"llama.block_count": None}
    with pytest.raises(WeightsError, match=r"llama\.block_count is missing"):
        load_gguf(write_model(tmp_path / "m.gguf", random_model(), metadata=meta))


# --- hostile headers: refused before gguf-py trusts their counts ---------------------------

U64_MAX_HALF = 2**63


def _header(n_tensors: int, n_kv: int, body: bytes) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + body


def _key(name: bytes) -> bytes:
    return struct.pack("<Q", len(name)) + name


HOSTILE_HEADERS = {
    # one key/value: an array of 2^63 uint8
    "array-count": _header(0, 1, _key(b"a") + struct.pack("<IIQ", 9, 0, U64_MAX_HALF)),
    "string-array-count": _header(0, 1, _key(b"a") + struct.pack("<IIQ", 9, 8, U64_MAX_HALF)),
    "string-length": _header(0, 1, struct.pack("<Q", U64_MAX_HALF) + b"a"),
    "kv-count": _header(0, U64_MAX_HALF, _key(b"a") + struct.pack("<IB", 0, 1)),
    "tensor-count": _header(U64_MAX_HALF, 0, _key(b"t") + struct.pack("<IQIQ", 1, 4, 0, 0)),
    "five-dims": _header(1, 0, _key(b"t") + struct.pack("<I5QIQ", 5, 1, 1, 1, 1, 1, 0, 0)),
    "huge-dims": _header(1, 0, _key(b"t") + struct.pack("<I2QIQ", 2, 2**40, 2**40, 0, 0)),
    "nested-arrays": _header(
        0, 1, _key(b"a") + struct.pack("<IIQ", 9, 9, 1) + struct.pack("<IQ", 9, 1) * 8
    ),
    "unknown-type": _header(0, 1, _key(b"a") + struct.pack("<I", 77) + bytes(8)),
}


@pytest.mark.parametrize("name", HOSTILE_HEADERS)
def test_a_hostile_header_is_refused_in_one_line(tmp_path, name):
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(HOSTILE_HEADERS[name])
    with pytest.raises(WeightsError, match=rf"{name}\.gguf is not a readable GGUF file") as info:
        load_gguf(path)
    assert "\n" not in str(info.value)
    with pytest.raises(TokenizerError, match=rf"{name}\.gguf is not a readable GGUF file"):
        load_tokenizer(path)


# The model loads and the tokenizer converts in a child whose address space is capped, so an
# allocation the header asks for fails there instead of swapping this machine.
CAPPED_LOAD = """
import resource, sys
from pathlib import Path
from kvchat.core.tokenizer import TokenizerError, load_tokenizer
from kvchat.core.weights import WeightsError
from kvchat.core.model_files import load_weights
cap = 6 << 30
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
for load, error in ((load_weights, WeightsError), (load_tokenizer, TokenizerError)):
    try:
        load(Path(sys.argv[1]))
    except error as e:
        print("refused:", e)
"""


def test_an_array_count_of_2_63_is_refused_at_once_under_a_memory_cap(tmp_path):
    path = tmp_path / "bomb.gguf"
    path.write_bytes(HOSTILE_HEADERS["array-count"])
    done = subprocess.run(
        [sys.executable, "-c", CAPPED_LOAD, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KVCHAT_HOME": str(tmp_path / "home")},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.count("refused:") == 2 and "not a readable GGUF file" in done.stdout


def test_a_block_count_beyond_the_tensors_is_refused(tmp_path):
    meta = {"llama.block_count": 1_000_000}
    path = write_model(tmp_path / "m.gguf", random_model(), metadata=meta)
    with pytest.raises(WeightsError, match=r"block_count says 1000000 layers, .* tensors for 2"):
        load_gguf(path)


def test_a_model_name_never_carries_terminal_controls(tmp_path):
    meta = {"general.name": "tiny \x1b]0;owned\x07 \x9b2J model"}
    path = write_model(tmp_path / "m.gguf", random_model(), metadata=meta)
    assert load_gguf(path).config.name == "tiny ]0;owned 2J model"


# --- the weights' plan: bytes by format from the header, before any tensor is read ----------

MIXES = {
    # every matrix one type
    **{t.name: {"": t} for t in (T.Q4_0, T.Q4_1, T.Q8_0, T.Q5_0, T.Q5_1, *K_QUANTS, T.F16)},
    # llama.cpp's Q4_K_M and Q5_K_M: v, down and the output layer Q6_K (fused q, k, v mix)
    "Q4_K_M": {"": T.Q4_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K},
    "Q5_K_M": {"": T.Q5_K, "attn_v": T.Q6_K, "ffn_down": T.Q6_K, "output": T.Q6_K},
    # Q3_K_M-like: Q3_K's scales per 16 fused with a Q4_K v, a Q5_K down, a Q6_K output layer
    "Q3_K_M": {
        "": T.Q3_K,
        "attn_v": T.Q4_K,
        "attn_output": T.Q4_K,
        "ffn_down": T.Q5_K,
        "output": T.Q6_K,
    },
    # Qwen2.5-Coder-0.5B's: Q5_0 with Q8_0 v and output, Q4_K / Q6_K down
    "qwen": {"": T.Q5_0, "attn_v": T.Q8_0, "output": T.Q8_0, "blk.0.ffn_down": T.Q4_K},
}


def _mixed_model(path: Path, arch: str, mix: dict[str, T], tied: bool) -> Path:
    """Weights of a stable scale through the layers (~0.05) in the types `mix` names (a key
    found in the GGUF name, else the type under "")."""
    rng = np.random.default_rng(4)
    tensors = {}
    for gguf_name, shape in tensor_table(arch, tied).values():
        if len(shape) == 1:
            tensors[gguf_name] = 1 + 0.1 * rng.standard_normal(shape).astype(np.float32)
            continue
        qtype = next((t for key, t in mix.items() if key and key in gguf_name), mix[""])
        if qtype in K_QUANTS:
            tensors[gguf_name] = (random_blocks(rng, qtype, shape, 1e-4), qtype)
        else:
            w = 0.05 * rng.standard_normal(shape).astype(np.float32)
            tensors[gguf_name] = (quantize(w, qtype), qtype)
    return write_gguf(path, arch, tensors, base_metadata(arch))


@pytest.mark.parametrize("mix", list(MIXES))
@pytest.mark.parametrize(("arch", "tied"), [("llama", True), ("qwen2", False)])
def test_the_weights_plan_is_what_the_model_holds(tmp_path, mix, arch, tied):
    """bf16 on the CPU (int4, int8 and bf16 layers) and fp32: the plan from the file's types
    and shapes, byte for byte what the built model holds by format."""
    from kvchat.core.model import Transformer, decoder_ops
    from kvchat.core.weight_plan import planned_weights

    path = _mixed_model(tmp_path / "m.gguf", arch, MIXES[mix], tied)
    cpu = torch.device("cpu")
    for dtype, weight_format in [(torch.bfloat16, "int4"), (torch.float32, "dense")]:
        weights = load_gguf(path)
        plan = planned_weights(weights, weight_format, dtype, cpu, decoder_ops(cpu, dtype))
        model = Transformer(weights, dtype=dtype, weight_format=weight_format)
        assert plan == model.bytes_by_format(), (mix, dtype)
        if mix == "Q4_K_M" and dtype == torch.bfloat16:  # q and k as int4, v as int8
            assert [p.format for p in model.layers[0].qkv.parts] == ["int4", "int8"]


@pytest.mark.parametrize("mix", ["Q4_K_M", "Q5_K_M", "Q3_K_M"])
def test_k_quant_mixes_run_on_their_groups_close_to_their_exact_weights(tmp_path, mix):
    """Q4_K_M-like (q and k Q4_K, v and down Q6_K): the fused q, k and v run as an int4 layer
    beside an int8 one. Q5_K_M-like: one int8 layer with a scale per 16 and minimums.
    Q3_K_M-like: q and k Q3_K and v Q4_K as one int4 layer with a scale per 16. The logits of
    a prompt pass and decode steps stay within bf16's reach of the fp32 model on the exact
    weights."""
    from kvchat.core import cpu_ops
    from kvchat.core.linear import ConcatLinear, PackedInt4Linear
    from kvchat.core.model import Transformer

    if cpu_ops.load() is None:
        pytest.skip("no C++ compiler: the int4 and int8 products are not built")
    path = _mixed_model(tmp_path / "m.gguf", "qwen2", MIXES[mix], tied=False)
    model = Transformer(load_gguf(path), dtype=torch.bfloat16, weight_format="int4")
    exact = Transformer(load_gguf(path), dtype=torch.float32, weight_format="dense")
    if mix == "Q4_K_M":
        assert all(isinstance(layer.qkv, ConcatLinear) for layer in model.layers)
    elif mix == "Q3_K_M":
        if cpu_ops.load().int4_vectorized:  # else torch's int4 kernel takes v's groups of 32
            assert all(
                isinstance(layer.qkv, PackedInt4Linear)
                and layer.qkv.pack.scale.shape[1] == 256 // 16
                for layer in model.layers
            )
    else:
        assert all(
            layer.qkv.minimum is not None and layer.qkv.scale.shape[1] == 2 * 256 // 32
            for layer in model.layers
        )
        assert set(model.bytes_by_format()) == {"int8", "bfloat16"}
    _assert_close_to_exact(model, exact)


def test_the_bundled_models_weights_plan_is_what_it_holds(smollm2_path):
    from kvchat.core.model import Transformer, decoder_ops
    from kvchat.core.weight_plan import planned_weights

    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    weights = load_gguf(smollm2_path)
    plan = planned_weights(weights, "int4", bf16, cpu, decoder_ops(cpu, bf16))
    assert plan == Transformer(weights, dtype=bf16, weight_format="int4").bytes_by_format()


def test_a_model_that_cannot_fit_is_refused_before_a_tensor_is_read(fake_cgroups, capsys):
    """With 100 MiB usable the bundled model's 0.15 GiB of weights cannot load: the engine
    refuses it in one line naming the weights by format, and `kvchat plan` prints the rows
    from the file's header first; no tensor is read."""
    from kvchat.config import load_settings
    from kvchat.core.engine import Engine
    from kvchat.core.plan import ModelTooLargeError
    from kvchat.tui.cli import EXIT_USAGE, main

    fake_cgroups("0::/box", {"box/memory.max": str(100 << 20), "box/memory.current": "0"})
    read: list[tuple[int, int]] = []
    with pytest.raises(ModelTooLargeError) as refused:
        Engine.load(load_settings().settings, "smollm2-135m", lambda *p: read.append(p))
    assert read == []
    message = str(refused.value)
    assert "for its weights as loaded (int4 0.06 GiB, bfloat16 0.05 GiB, int8 0.03 GiB)" in message
    assert "usable now" in message and "\n" not in message

    assert main(["plan"]) == EXIT_USAGE
    out, err = capsys.readouterr()
    assert out.startswith("weights as they would load: int4 0.06 GiB")
    assert "host memory available now: 0.10 GiB" in out
    assert err.startswith("kvchat: error: ") and "usable now" in err


@pytest.mark.parametrize("mix", ["Q4_0", "Q4_K", "Q2_K", "Q3_K", "Q5_0", "Q5_K", "Q6_K"])
def test_an_untied_table_keeps_its_groups_and_looks_up_the_exact_rows(tmp_path, mix):
    """bf16 on the CPU: the table of an untied model stays in the file's int4 or int8 groups,
    and its rows are the exact weights rounded to bf16 once, as a bf16 matrix would hold."""
    from kvchat.core.embedding import Int4Table, Int8Table
    from kvchat.core.model import Transformer

    path = _mixed_model(tmp_path / "m.gguf", "qwen2", MIXES[mix], tied=False)
    weights = load_gguf(path)
    model = Transformer(weights, dtype=torch.bfloat16, weight_format="int4")
    int4 = mix in ("Q4_0", "Q4_K", "Q2_K", "Q3_K")
    assert isinstance(model.embed, Int4Table if int4 else Int8Table)
    ids = torch.tensor([5, 0, 31, 5, 17])
    want = weights.tensors["model.embed_tokens.weight"][ids].bfloat16()
    assert torch.equal(model.embed(ids), want)
    # bytes a value: int4 with a scale and minimum per 32 (fp16 or fp32) or per 16 (fp32: 1.0)
    bound = {"Q2_K": 1.01, "Q3_K": 1.01}.get(mix, 0.8 if int4 else 1.3)
    assert model.embed.nbytes < VOCAB * HIDDEN * bound
