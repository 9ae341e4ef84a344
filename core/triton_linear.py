"""The file's int4 and int8 groups on a GPU, through Triton.

A layer holds what core/weights.py reads from the GGUF, unchanged but for the layout: int4
values two to a byte (input 2j in the low nibble, 2j + 1 in the high one), int8 values as
they are, and fp32 scales and minimums, one per group of inputs (32, or Q6_K's 16). Its
weight is q * scale + minimum, exact in fp32, as on the CPU.

Few rows (a decode step's) run through `_product_kernel`, which reads the integers and
multiplies them by the inputs in fp32, so the step reads 0.6 (int4) or 1.1 (int8) bytes a
weight instead of a bf16 matrix's 2. More rows (a prefill chunk) unpack the weight into the
compute dtype for the call (`_unpack_kernel`) and run the library's matrix product, whose
speed on many rows the unpacking costs little against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .weights import Int4Groups, Int8Groups, tensor_bytes

# Rows from which unpacking the weight and a dense product replace the integer product.
UNPACK_ROWS = 16
_BLOCK_N = 32  # outputs a program computes
_BLOCK_K = 64  # inputs a step of its loop reads: whole groups of 32 or 16


@triton.jit
def _halves(q_ptr, s_qn, n, k2, mask, BITS: tl.constexpr):
    """The values of inputs 2 k2 and 2 k2 + 1 of rows n, in fp32 (k2: pair indices)."""
    if BITS == 4:
        byte = tl.load(q_ptr + n * s_qn + k2, mask=mask, other=0).to(tl.int32)
        return (byte & 15).to(tl.float32), (byte >> 4).to(tl.float32)
    even = tl.load(q_ptr + n * s_qn + 2 * k2, mask=mask, other=0).to(tl.float32)
    odd = tl.load(q_ptr + n * s_qn + 2 * k2 + 1, mask=mask, other=0).to(tl.float32)
    return even, odd


@triton.jit
def _weights(
    q_ptr,
    scale_ptr,
    min_ptr,
    s_qn,
    s_sn,
    n,
    k2,
    mask,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MIN: tl.constexpr,
):
    """q * scale + minimum at inputs 2 k2 and 2 k2 + 1 of rows n (a group holds both)."""
    even, odd = _halves(q_ptr, s_qn, n, k2, mask, BITS)
    group = (2 * k2) // GROUP
    scale = tl.load(scale_ptr + n * s_sn + group, mask=mask, other=0.0)
    even, odd = even * scale, odd * scale
    if HAS_MIN:
        minimum = tl.load(min_ptr + n * s_sn + group, mask=mask, other=0.0)
        even, odd = even + minimum, odd + minimum
    return even, odd


@triton.jit
def _product_kernel(
    x_ptr,
    q_ptr,
    scale_ptr,
    min_ptr,
    y_ptr,
    N,
    K,
    s_xm,
    s_qn,
    s_sn,
    s_ym,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MIN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """y[m, n] = sum over k of x[m, k] * w[n, k], w dequantized in fp32 as it is read."""
    m = tl.program_id(1)
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    pairs = tl.arange(0, BLOCK_K // 2)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k2 = k0 // 2 + pairs
        in_k = 2 * k2 < K
        x_even = tl.load(x_ptr + m * s_xm + 2 * k2, mask=in_k, other=0.0).to(tl.float32)
        x_odd = tl.load(x_ptr + m * s_xm + 2 * k2 + 1, mask=in_k, other=0.0).to(tl.float32)
        mask = (n[:, None] < N) & in_k[None, :]
        even, odd = _weights(
            q_ptr,
            scale_ptr,
            min_ptr,
            s_qn,
            s_sn,
            n[:, None],
            k2[None, :],
            mask,
            BITS,
            GROUP,
            HAS_MIN,
        )
        acc += tl.sum(even * x_even[None, :] + odd * x_odd[None, :], axis=1)
    tl.store(y_ptr + m * s_ym + n, acc.to(y_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _unpack_kernel(
    q_ptr,
    scale_ptr,
    min_ptr,
    w_ptr,
    N,
    K,
    s_qn,
    s_sn,
    s_wn,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MIN: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """w[n, k] = q * scale + minimum, rounded once to w's dtype."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k2 = tl.program_id(1) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
    mask = (n[:, None] < N) & (2 * k2[None, :] < K)
    even, odd = _weights(
        q_ptr,
        scale_ptr,
        min_ptr,
        s_qn,
        s_sn,
        n[:, None],
        k2[None, :],
        mask,
        BITS,
        GROUP,
        HAS_MIN,
    )
    out = w_ptr + n[:, None] * s_wn + 2 * k2[None, :]
    tl.store(out, even.to(w_ptr.dtype.element_ty), mask=mask)
    tl.store(out + 1, odd.to(w_ptr.dtype.element_ty), mask=mask)


class TritonGroupsLinear:
    """y = x @ W.T + b on a GGUF's int4 or int8 groups held on the GPU (see the module)."""

    def __init__(
        self,
        groups: Int4Groups | Int8Groups,
        bias: torch.Tensor | None,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        q = groups.q.to(device)
        n, k = q.shape
        if isinstance(groups, Int4Groups):
            self.bits, self.group = 4, k // groups.scale.shape[1]
            self.q = (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()
        else:
            self.bits, self.group = 8, groups.group_size
            self.q = q.contiguous()
        self.scale = groups.scale.to(device=device, dtype=torch.float32).contiguous()
        minimum = groups.minimum
        self.minimum = (
            None if minimum is None else minimum.to(device=device, dtype=torch.float32).contiguous()
        )
        self.bias, self.dtype = bias, dtype
        self.out_features, self.in_features = n, k
        self.format = "int4" if self.bits == 4 else "int8"
        self.nbytes = self.read_bytes = tensor_bytes(self.q, self.scale, self.minimum, bias)

    def _common(self) -> tuple:
        # The scale stands in for a missing minimum: HAS_MIN keeps the kernel from reading it.
        minimum = self.scale if self.minimum is None else self.minimum
        return (self.q, self.scale, minimum)

    def _constants(self) -> dict:
        return dict(
            BITS=self.bits,
            GROUP=self.group,
            HAS_MIN=self.minimum is not None,
            BLOCK_N=_BLOCK_N,
            BLOCK_K=_BLOCK_K,
        )

    def unpacked(self) -> torch.Tensor:
        """The weight [N, K] in the compute dtype."""
        n, k = self.out_features, self.in_features
        w = torch.empty(n, k, dtype=self.dtype, device=self.q.device)
        grid = (triton.cdiv(n, _BLOCK_N), triton.cdiv(k, _BLOCK_K))
        _unpack_kernel[grid](
            *self._common(),
            w,
            n,
            k,
            self.q.stride(0),
            self.scale.stride(0),
            w.stride(0),
            **self._constants(),
        )
        return w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] >= UNPACK_ROWS:
            y = F.linear(rows, self.unpacked(), self.bias)
        else:
            rows = rows.contiguous()
            y = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype, device=x.device)
            grid = (triton.cdiv(self.out_features, _BLOCK_N), rows.shape[0])
            _product_kernel[grid](
                rows,
                *self._common(),
                y,
                self.out_features,
                self.in_features,
                rows.stride(0),
                self.q.stride(0),
                self.scale.stride(0),
                y.stride(0),
                **self._constants(),
            )
            y = y if self.bias is None else y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)
