"""The decoder: a Llama-family transformer (Llama, Mistral, Qwen2) in plain PyTorch.

Attention is delegated to an `AttentionBackend`, which owns the KV cache; this file only
knows projections, norms and the MLP. The token embedding stays on the CPU (the table can be
large) and only the rows of the current chunk move to the compute device.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from types import ModuleType

import torch
import torch.nn.functional as F

from kvchat.kv.backend import AttentionBackend
from kvchat.kv.sparse import CacheGeometry

from . import cpu_ops
from .embedding import DenseTable, Int4Table, Int8Table, TokenTable, grouped_table
from .gguf_loader import group_size
from .int4_layer import Int4DecodeLayer
from .linear import (
    ConcatLinear,
    DenseLinear,
    Int8Linear,
    Linear,
    PackedInt4Linear,
    make_linear,
    part_runs,
)
from .rope import Rope
from .weights import Groups, ModelWeights, WeightsError


def decoder_ops(device: torch.device, dtype: torch.dtype) -> ModuleType | None:
    """core/cpu_ops.py's module where the decoder uses it (bf16 on the CPU), else None."""
    return cpu_ops.load() if device.type == "cpu" and dtype == torch.bfloat16 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 like the reference implementation; bf16 variance loses digits.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the fused projection's output [..., gate | up]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: Linear  # q, k and v projections fused: one matmul instead of three
    o: Linear
    mlp_norm: torch.Tensor
    gate_up: Linear  # gate and up projections fused
    down: Linear


class Transformer:
    """Weights plus the forward pass. Holds no per-sequence state: that is the backend's."""

    def __init__(
        self,
        weights: ModelWeights,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        weight_format: str = "dense",
    ) -> None:
        cfg = weights.config
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        t = weights.tensors
        # bf16 on the CPU: norms and the MLP's SiLU-and-multiply in one C++ call each (the
        # same values but for rare last-bit roundings), and a Q8_0 output layer read as stored.
        ops = decoder_ops(self.device, dtype)
        self._rms_norm = rms_norm if ops is None else ops.rms_norm
        self._silu_mul = silu_mul if ops is None else ops.silu_mul

        def check(name: str, shape: tuple[int, ...]) -> None:
            if name not in t:
                raise WeightsError(f"{weights.source}: tensor {name!r} is missing")
            if t.shape(name) != shape:
                raise WeightsError(
                    f"{weights.source}: tensor {name!r} has shape {t.shape(name)}, expected {shape}"
                )

        def tensor(
            name: str, shape: tuple[int, ...], as_dtype: torch.dtype = torch.float32
        ) -> torch.Tensor:
            """Weight `name` in `as_dtype`, made from the file as it is read (LazyTensors)."""
            check(name, shape)
            return t.converted(name, as_dtype)

        def vec(name: str, size: int) -> torch.Tensor:
            return tensor(name, (size,)).to(device=self.device, dtype=dtype)

        def dense(shapes: dict[str, tuple[int, ...]]) -> list[torch.Tensor]:
            return [tensor(name, shape, dtype) for name, shape in shapes.items()]

        def read(held: Mapping[str, Groups], names: list[str]) -> list[Groups]:
            return [held[name] for name in names]

        def linear(names: list[str], out_sizes: list[int], in_size: int, bias: bool) -> Linear:
            """One layer for the fused parts `names`, or one for each run of parts whose layers
            are of one kind (part_runs)."""
            shapes = {f"{n}.weight": (o, in_size) for n, o in zip(names, out_sizes, strict=True)}
            for name, shape in shapes.items():
                check(name, shape)
            biases = (
                torch.cat(
                    [tensor(f"{n}.bias", (o,)) for n, o in zip(names, out_sizes, strict=True)]
                )
                if bias
                else None
            )
            keys = list(shapes)
            int4 = [key in weights.int4 for key in keys]
            int8 = [key in weights.int8 for key in keys]
            types = [weights.file_types.get(key, "") for key in keys]
            sizes = [group_size([t]) for t in types]
            parts = []
            runs = part_runs(
                out_sizes, in_size, int4, int8, weight_format, dtype, self.device, ops, sizes
            )
            for run in runs:
                start, out = sum(out_sizes[: run.start]), sum(out_sizes[run])
                parts.append(
                    make_linear(
                        partial(dense, {key: shapes[key] for key in keys[run]}),
                        out,
                        in_size,
                        partial(read, weights.int4, keys[run]) if int4[run.start] else None,
                        partial(read, weights.int8, keys[run]) if int8[run.start] else None,
                        None if biases is None else biases[start : start + out],
                        weight_format,
                        dtype,
                        self.device,
                        ops,
                        group_size(types[run]),
                    )
                )
            return parts[0] if len(parts) == 1 else ConcatLinear(parts)

        # The vocabulary-sized tensors first: the transient copies their conversion holds then
        # come before the layers are held, not on top of them (Qwen2.5-0.5B's Q8_0 output
        # layer: 0.15 GiB of groups beside its packed copy).
        h, d = cfg.hidden_size, cfg.head_dim
        embed = "model.embed_tokens.weight"
        check(embed, (cfg.vocab_size, h))
        grouped = grouped_table(
            cfg.tie_word_embeddings,
            self.device,
            weight_format,
            embed in weights.int4,
            embed in weights.int8,
        )
        self.embed: TokenTable
        if grouped == "int4":
            self.embed = Int4Table(weights.int4[embed], dtype)
        elif grouped == "int8":
            self.embed = Int8Table(weights.int8[embed], dtype)
        else:
            self.embed = DenseTable(tensor(embed, (cfg.vocab_size, h), dtype))
        self.norm = vec("model.norm.weight", h)
        self.lm_head: Linear
        # A tied head on the CPU shares the embedding table instead of holding a second copy
        # (in bf16 it also holds a second copy for its products, counted in nbytes, unless it
        # reads the file's int8 table, then taking the embedding for products of many rows).
        head_is_embed = cfg.tie_word_embeddings and self.device.type == "cpu"
        head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
        q8 = weight_format == "int4" and ops is not None and f"{head}.weight" in weights.int8
        self._head_holds_embed = False  # counted in lm_head.nbytes, held once
        if q8:
            table = self.embed.weight if head_is_embed else None  # type: ignore[attr-defined]
            # The groups are not kept in a local: they would be held through the layers.
            self.lm_head = Int8Linear(
                weights.int8[f"{head}.weight"], None, ops, torch.float32, table
            )
        elif head_is_embed:
            self.lm_head = DenseLinear(self.embed.weight, None)  # type: ignore[attr-defined]
            self._head_holds_embed = True
        else:
            self.lm_head = linear([head], [cfg.vocab_size], h, False)
        q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
        self.layers: list[Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            attn = [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"]
            gate_up = [p + "mlp.gate_proj", p + "mlp.up_proj"]
            layer = Layer(
                attn_norm=vec(p + "input_layernorm.weight", h),
                qkv=linear(attn, [q_out, kv_out, kv_out], h, cfg.attention_bias),
                o=linear([p + "self_attn.o_proj"], [h], q_out, False),
                mlp_norm=vec(p + "post_attention_layernorm.weight", h),
                gate_up=linear(gate_up, [cfg.intermediate_size] * 2, h, False),
                down=linear([p + "mlp.down_proj"], [h], cfg.intermediate_size, False),
            )
            self.layers.append(layer)
        self._qkv_heads = [cfg.num_heads, cfg.num_kv_heads, cfg.num_kv_heads]
        # One-token passes in two C++ calls a layer (core/int4_layer.py) where every
        # projection runs on int4_layer.cpp's packed weights.
        self._decode_layers = self._int4_decode_layers(ops)
        self.rope = Rope(cfg, self.device)

    def _int4_decode_layers(self, ops: ModuleType | None) -> list[Int4DecodeLayer] | None:
        if ops is None:
            return None
        decode = []
        for layer in self.layers:
            linears = (layer.qkv, layer.o, layer.gate_up, layer.down)
            if not all(isinstance(m, PackedInt4Linear) for m in linears):
                return None
            qkv, o, gate_up, down = (m.pack for m in linears)  # type: ignore[union-attr]
            decode.append(
                Int4DecodeLayer(
                    qkv,
                    o,
                    gate_up,
                    down,
                    layer.attn_norm,
                    layer.mlp_norm,
                    self.cfg.rms_norm_eps,
                    layer.qkv.bias,  # type: ignore[union-attr]
                    self._qkv_heads,
                    ops,
                )
            )
        return decode

    def _projections(self) -> list[Linear]:
        return [m for layer in self.layers for m in (layer.qkv, layer.o, layer.gate_up, layer.down)]

    @property
    def nbytes(self) -> int:
        """Bytes of weights held (embedding table included)."""
        linears = self._projections()
        vectors = [v for layer in self.layers for v in (layer.attn_norm, layer.mlp_norm)]
        return (
            sum(m.nbytes for m in linears)
            + sum(v.numel() * v.element_size() for v in [*vectors, self.norm])
            + (0 if self._head_holds_embed else self.embed.nbytes)
            + self.lm_head.nbytes
        )

    def bytes_by_format(self) -> dict[str, int]:
        """Bytes of weights held, by what they are held as ("int4", "int8", "bfloat16", ...),
        largest first; they add up to nbytes."""
        held: dict[str, int] = {}
        for layer in [*self._projections(), self.lm_head]:
            for m in layer.parts if isinstance(layer, ConcatLinear) else [layer]:
                held[m.format] = held.get(m.format, 0) + m.nbytes
        if not self._head_holds_embed:
            held[self.embed.format] = held.get(self.embed.format, 0) + self.embed.nbytes
        # The rest: the norms.
        dense = str(self.dtype).removeprefix("torch.")
        held[dense] = held.get(dense, 0) + self.nbytes - sum(held.values())
        return dict(sorted(held.items(), key=lambda item: -item[1]))

    @property
    def decode_read_bytes(self) -> int:
        """Bytes of weights one decode step reads: every matrix and norm, one embedding row."""
        matrices = sum(m.read_bytes for m in self._projections())
        norms = len(self.layers) * 2 * self.cfg.hidden_size * self.dtype.itemsize
        row = self.embed.row_bytes
        head = self.lm_head.read_bytes + self.norm.numel() * self.norm.element_size()
        return matrices + norms + row + head

    def cache_geometry(self, max_tokens: int) -> CacheGeometry:
        """The shape of a block-sparse cache of `max_tokens` for this model."""
        c = self.cfg
        return CacheGeometry(
            c.num_layers,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            self.dtype,
            self.device,
            max_tokens,
            c.trained_context,
        )

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,
        backend: AttentionBackend,
        all_logits: bool = False,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run tokens `ids` [T] at positions backend.length .. +T; return fp32 logits.

        Logits of the last token only ([1, vocab]) unless `all_logits` ([T, vocab]);
        `on_layer(i)` after each of the first i layers of a pass of several tokens.
        """
        cfg = self.cfg
        n = ids.shape[0]
        x = self.embed(ids).to(self.device)
        backend.begin(n)
        norm = self._rms_norm
        decode = self._decode_layers if n == 1 else None
        try:
            for i, layer in enumerate(self.layers):
                if decode is not None:
                    # Two C++ calls around the attention, which take and give [heads, 1, head_dim].
                    q, k, v = decode[i].qkv(x)
                    x = decode[i].tail(x, backend.attend(i, q, k, v))
                    continue
                qkv = layer.qkv(norm(x, layer.attn_norm, cfg.rms_norm_eps))
                # [heads, n, head_dim] views of q, k and v: three ops, not seven, per layer.
                heads = qkv.view(n, -1, cfg.head_dim).transpose(0, 1)
                q, k, v = heads.split_with_sizes(self._qkv_heads)
                attn = backend.attend(i, q, k, v).transpose(0, 1).reshape(n, -1)
                x = x + layer.o(attn)
                x = x + layer.down(
                    self._silu_mul(layer.gate_up(norm(x, layer.mlp_norm, cfg.rms_norm_eps)))
                )
                if on_layer is not None:
                    on_layer(i + 1)
        except BaseException:
            backend.abort()  # a pass stopped between layers (a cancelled prefill)
            raise
        backend.commit()
        if not all_logits:
            x = x[-1:]
        return self.lm_head(norm(x, self.norm, cfg.rms_norm_eps)).float()
