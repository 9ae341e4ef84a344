"""A decode token's pass through a layer's int4 projections in two C++ calls (CPU, bf16).

Through torch's int4 kernel a decode step on the CPU makes four calls a layer, each with its
Python, its dispatch and its own fork and join of the threads, with the norms, the SiLU and the
residual adds as separate calls between them. `Int4DecodeLayer` holds the layer's GGUF 4-bit
groups in the layout of core/csrc/int4_layer.cpp and runs the layer around its attention
in two C++ calls: `qkv` (RMSNorm, then q, k and v) and `tail` (the output projection and residual,
RMSNorm, the MLP and its residual), on the same packed weights as the layer's
`PackedInt4Linear`s (core/linear.py), which run prefill chunks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from .weights import GROUP_SIZE, Int4Groups


@dataclass(frozen=True)
class Int4Pack:
    """A weight [N, K] in int4_layer.cpp's layout. Tile t holds rows 16 t .. 16 t + 15; its
    group g is 4 chunks of 64 bytes, and byte 4 r + j of chunk c holds, for row r, input
    32 g + 8 c + j in its low nibble and 32 g + 8 c + 4 + j in its high one: a chunk's low
    (high) nibbles are 16 rows' 4 adjacent inputs, one row to a 32-bit lane, which one
    vpdpbusd multiplies by those 4 (broadcast) int8 inputs. scale and minimum are the file's
    values, [N / 16, K / 32, 16] ([N / 16, K / 16, 16] for Q2_K's and Q3_K's per 16): fp16
    (Q4_0, Q4_1) or, where fp16 does not hold them, fp32 (the K-quants' d * sc and dmin * m)."""

    packed: torch.Tensor  # uint8 [N / 16, 8 K]
    scale: torch.Tensor
    minimum: torch.Tensor

    @property
    def out_features(self) -> int:
        return 16 * self.packed.shape[0]

    @property
    def parts(self) -> list[torch.Tensor]:
        return [self.packed, self.scale, self.minimum]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts)


def narrowed_scales(
    scale: torch.Tensor, minimum: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Int4 groups' scales and minimums in fp16 where fp16 holds both exactly (Q4_0, Q4_1),
    else as they are (fp32: the K-quants' d * sc and dmin * m)."""
    half_scale, half_minimum = scale.half(), minimum.half()
    if torch.equal(half_scale.float(), scale) and torch.equal(half_minimum.float(), minimum):
        return half_scale, half_minimum
    return scale, minimum


def pack_int4(groups: Int4Groups) -> Int4Pack | None:
    """`groups` in int4_layer.cpp's layout, or None where it does not apply (N not a multiple
    of 16). Scales and minimums stay fp16 where fp16 holds them exactly, else fp32."""
    q, scale, minimum = groups.q, groups.scale, groups.minimum
    n, k = q.shape
    if n % 16 or k % GROUP_SIZE:
        return None
    scale, minimum = narrowed_scales(scale, minimum)
    tiles, n_groups = n // 16, k // GROUP_SIZE
    # [tile, row, group, chunk, low/high, j] -> [tile, group, chunk, row, j, low/high]
    q = q.view(tiles, 16, n_groups, 4, 2, 4).permute(0, 2, 3, 1, 5, 4)
    packed = (q[..., 0] | (q[..., 1] << 4)).reshape(tiles, n_groups * 256).contiguous()

    def per_tile(t: torch.Tensor) -> torch.Tensor:
        return t.view(tiles, 16, t.shape[1]).transpose(1, 2).contiguous()

    return Int4Pack(packed, per_tile(scale), per_tile(minimum))


class Int4DecodeLayer:
    """One layer's projections for one token, int4_layer.cpp's Int4Layer: `qkv(x)` gives q, k
    and v ([heads, 1, head_dim] each) and `tail(x, attn)` the layer's output [1, hidden], from
    bf16 x [1, hidden] and the attention's output (any shape of n_heads * head_dim values)."""

    def __init__(
        self,
        qkv: Int4Pack,
        o: Int4Pack,
        gate_up: Int4Pack,
        down: Int4Pack,
        attn_norm: torch.Tensor,
        mlp_norm: torch.Tensor,
        eps: float,
        qkv_bias: torch.Tensor | None,
        qkv_heads: list[int],
        ops: ModuleType,
    ) -> None:
        layer = ops.Int4Layer(
            qkv.parts,
            qkv_bias,
            attn_norm,
            o.parts,
            mlp_norm,
            gate_up.parts,
            down.parts,
            eps,
            qkv_heads,
        )
        # The C++ methods themselves: a Python method around each would add its frame to
        # every call of a decode step (60 of them).
        self.qkv: Callable[[torch.Tensor], list[torch.Tensor]] = layer.qkv
        self.tail: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = layer.tail
