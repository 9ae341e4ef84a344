"""The bytes a model's weights hold once loaded, by format, from the file's tensor types and
shapes alone (no tensor is read): the layers core/model.py's Transformer builds, each sized
by core/linear.py's `planned_bytes` for the kind `linear_kind` picks. The engine checks it
against the memory available before a load, and `kvchat plan` prints it."""

from __future__ import annotations

from types import ModuleType

import torch

from .embedding import grouped_table, grouped_table_bytes
from .gguf_loader import group_size, int4_scale_itemsize, int8_has_minimum
from .linear import LinearKind, linear_kind, part_runs, planned_bytes
from .weights import ModelWeights


def planned_weights(
    weights: ModelWeights,
    weight_format: str,
    dtype: torch.dtype,
    device: torch.device,
    ops: ModuleType | None,
) -> dict[str, int]:
    """Bytes by format ("int4", "int8", the dtype's name), largest first, as
    Transformer.bytes_by_format will give them."""
    cfg, item = weights.config, dtype.itemsize
    dense = str(dtype).removeprefix("torch.")
    held: dict[str, int] = {}

    def add(kind: str | None, n: int) -> None:
        held[kind or dense] = held.get(kind or dense, 0) + n

    def linear(names: list[str], out_sizes: list[int], in_size: int, bias: bool) -> None:
        keys = [f"{name}.weight" for name in names]
        int4 = [key in weights.int4 for key in keys]
        int8 = [key in weights.int8 for key in keys]
        all_types = [weights.file_types.get(key, "") for key in keys]
        sizes = [group_size([t]) for t in all_types]
        runs = part_runs(out_sizes, in_size, int4, int8, weight_format, dtype, device, ops, sizes)
        for run in runs:  # as Transformer builds them
            out, types = sum(out_sizes[run]), all_types[run]
            group = group_size(types)
            kind = linear_kind(
                out,
                in_size,
                int4[run.start],
                int8[run.start],
                weight_format,
                dtype,
                device,
                ops,
                group,
            )
            size = planned_bytes(
                kind,
                out,
                in_size,
                dtype,
                device,
                bias,
                group,
                int4_scale_itemsize(types),
                int8_has_minimum(types),
            )
            add(kind.format, size)

    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    q_out, kv_out = cfg.num_heads * d, cfg.num_kv_heads * d
    add(None, (2 * cfg.num_layers + 1) * h * item)  # the norms
    embed = "model.embed_tokens.weight"
    types = [weights.file_types.get(embed, "")]
    grouped = grouped_table(
        cfg.tie_word_embeddings, device, weight_format, embed in weights.int4, embed in weights.int8
    )
    if grouped is None:
        add(None, cfg.vocab_size * h * item)
    else:
        size = grouped_table_bytes(
            grouped == "int4",
            cfg.vocab_size,
            h,
            group_size(types),
            int4_scale_itemsize(types),
            int8_has_minimum(types),
        )
        add(grouped, size)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        linear(
            [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj"],
            [q_out, kv_out, kv_out],
            h,
            cfg.attention_bias,
        )
        linear([p + "self_attn.o_proj"], [h], q_out, False)
        linear([p + "mlp.gate_proj", p + "mlp.up_proj"], [inter, inter], h, False)
        linear([p + "mlp.down_proj"], [h], inter, False)
    head = "model.embed_tokens" if cfg.tie_word_embeddings else "lm_head"
    head_is_embed = cfg.tie_word_embeddings and device.type == "cpu"
    q8 = weight_format == "int4" and ops is not None and f"{head}.weight" in weights.int8
    if q8:  # the file's int8 table; a tied one takes the embedding for many rows
        types = [weights.file_types.get(f"{head}.weight", "")]
        size = planned_bytes(
            LinearKind.INT8,
            cfg.vocab_size,
            h,
            dtype,
            device,
            False,
            group_size(types),
            minimum=int8_has_minimum(types),
        )
        add("int8", size)
    elif head_is_embed:  # the table is held once; the head adds its copy for products
        size = planned_bytes(LinearKind.DENSE, cfg.vocab_size, h, dtype, device, False)
        add(None, size - cfg.vocab_size * h * item)
    else:
        linear([head], [cfg.vocab_size], h, False)
    return dict(sorted(held.items(), key=lambda entry: -entry[1]))
