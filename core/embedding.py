"""The token table: the rows of a chunk's ids, as the decoder's first step.

A tied table is also the output layer's weight, so it stays a matrix in the compute dtype.
An untied one is only looked up: on the CPU with the file's integer groups it keeps them
(a 7B Q4_K_M file's 152K x 3584 table: 0.39 GiB instead of 1.02 GiB in bf16) and unpacks the
rows of each lookup, to the same values the matrix would hold (q * scale + minimum in fp32,
rounded to the dtype once).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from .int4_layer import narrowed_scales
from .weights import Int4Groups, Int8Groups, tensor_bytes


class TokenTable(Protocol):
    format: str  # what the table is held as: "int4", "int8", or the dtype ("bfloat16")
    nbytes: int
    row_bytes: int  # read by one token's lookup

    def __call__(self, ids: torch.Tensor) -> torch.Tensor: ...


class DenseTable:
    """The table as a matrix [vocab, hidden] (`weight`, which a tied output layer shares)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self.format = str(weight.dtype).removeprefix("torch.")
        self.nbytes = weight.numel() * weight.element_size()
        self.row_bytes = weight.shape[1] * weight.element_size()

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class Int4Table:
    """The table as the file's 4-bit groups, two values a byte, scales and minimums in fp16
    where fp16 holds them (Q4_0, Q4_1), else fp32 (the K-quants)."""

    format = "int4"

    def __init__(self, groups: Int4Groups, dtype: torch.dtype) -> None:
        q = groups.q
        self.group = groups.group_size
        self.packed = q[:, 0::2] | (q[:, 1::2] << 4)
        self.scale, self.minimum = narrowed_scales(groups.scale, groups.minimum)
        self.dtype = dtype
        self.nbytes = tensor_bytes(self.packed, self.scale, self.minimum)
        self.row_bytes = self.nbytes // q.shape[0]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        packed = self.packed[ids]
        q = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(len(ids), -1, self.group)
        scale, minimum = self.scale[ids].float(), self.minimum[ids].float()
        rows = q.float() * scale[..., None] + minimum[..., None]
        return rows.view(len(ids), -1).to(self.dtype)


class Int8Table:
    """The table as the file's int8 groups (a scale per 32 or 16, minimums where it has
    them)."""

    format = "int8"

    def __init__(self, groups: Int8Groups, dtype: torch.dtype) -> None:
        self.groups, self.dtype = groups, dtype
        held = [groups.q, groups.scale, groups.minimum]
        self.nbytes = tensor_bytes(*held)
        self.row_bytes = self.nbytes // groups.q.shape[0]

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        g = self.groups
        rows = Int8Groups(g.q[ids], g.scale[ids], None if g.minimum is None else g.minimum[ids])
        return rows.dequantize().to(self.dtype)


def grouped_table(
    tied: bool, device: torch.device, weight_format: str, int4: bool, int8: bool
) -> str | None:
    """ "int4" or "int8" where the table keeps the file's groups (`int4`, `int8`: it has them):
    an untied table on the CPU with the integer layers; None where it is a matrix."""
    if tied or device.type != "cpu" or weight_format != "int4":
        return None
    return "int4" if int4 else "int8" if int8 else None


def grouped_table_bytes(
    int4: bool, vocab: int, hidden: int, group_size: int, scale_itemsize: int, minimum: bool
) -> int:
    """The bytes Int4Table (`int4`) or Int8Table holds, from the shapes alone: as
    core/linear.py's planned_bytes for the layers."""
    groups = vocab * (hidden // group_size)
    if int4:
        return vocab * hidden // 2 + 2 * groups * scale_itemsize
    return vocab * hidden + groups * 4 * (2 if minimum else 1)
