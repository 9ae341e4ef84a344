"""Correctness checks of an ops implementation against the torch reference, on any device.

Used by the kernel tests (Triton interpreter, CPU) and by `kvchat bench gpu` (on the GPU),
so both check the same thing. Inputs are seeded; every check returns a `CheckResult` with its
error and the tolerance it was held to instead of raising, so a report can list them all.

Reference: the torch functions run on the CPU (kv/attention.py calls the CPU flash kernel) in
fp32 on the *same rounded inputs* the kernel sees (stored blocks gathered into the compute
dtype first, which is what the kernels dequantize to), so the tolerance only has to cover what
the kernel itself rounds: the probabilities cast to the compute dtype before the P.V product,
the output's final rounding and the accumulation order. The quantizing append must match
BlockPool.write on the CPU bit for bit.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvchat.kv.anchors import ANCHOR_TYPES, anchor_dtype, anchor_rows
from kvchat.kv.kernels import TORCH_OPS, AttentionOps, gather_blocks
from kvchat.kv.quant import KV_TYPES, BlockPool
from kvchat.kv.selection import HEAD_SELECT_MODES

# Max |kernel - reference| for attention outputs of O(1) (values are standard normal).
OUT_TOL = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 2.5e-2}
LSE_TOL = 1e-3  # the LSE is computed from the same rounded inputs in fp32 on both sides
SCORE_RTOL = 1e-4  # relative to the largest |score|


@dataclass(frozen=True)
class CheckResult:
    kernel: str
    case: str
    max_abs_err: float
    tolerance: float
    passed: bool

    def as_dict(self) -> dict:
        return asdict(self)


def _result(kernel: str, case: str, err: float, tol: float) -> CheckResult:
    # NaN compares false, so a NaN error fails.
    return CheckResult(kernel, case, err, tol, bool(err <= tol))


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape:
        return float("inf")
    if got.numel() == 0:
        return 0.0
    return (got.float().cpu() - want.float().cpu()).abs().max().item()


def _cpu(*xs: torch.Tensor) -> list[torch.Tensor]:
    """fp32 CPU copies, the reference's inputs."""
    return [x.float().cpu() for x in xs]


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _pools(
    n_kv: int, n_blocks: int, block: int, dim: int, kv_type: str, dtype: torch.dtype, dev, gen
) -> tuple[BlockPool, BlockPool]:
    pools = []
    for _ in range(2):
        pool = BlockPool(n_kv * n_blocks, block, dim, kv_type, dtype, dev)
        values = torch.randn(n_kv * n_blocks, block, dim, generator=gen).to(dev)
        pool.write(torch.arange(n_kv * n_blocks, device=dev), values)
        pools.append(pool)
    return pools[0], pools[1]


def check_sparse_attention(
    ops: AttentionOps,
    device: torch.device | str,
    dtype: torch.dtype,
    kv_type: str,
    group: int,
    t_len: int = 1,
    local_len: int = 45,
    sink_len: int = 32,
    n_sel: int = 3,
    block: int = 32,
    dim: int = 64,
    n_kv: int = 2,
    seed: int = 0,
) -> list[CheckResult]:
    """Attention over {local (causal), sinks, n_sel stored blocks per KV head}: out and LSE."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    n_heads = n_kv * group

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

    q_local, q_far = rand(n_heads, t_len, dim), rand(n_heads, t_len, dim)
    local_k, local_v = rand(n_kv, local_len, dim), rand(n_kv, local_len, dim)
    sink_k, sink_v = rand(n_kv, sink_len, dim), rand(n_kv, sink_len, dim)
    n_blocks = max(n_sel, 1) + 2
    k_pool, v_pool = _pools(n_kv, n_blocks, block, dim, kv_type, dtype, dev, gen)
    # Each head reads its own blocks, in no particular order.
    order = torch.randperm(n_blocks, generator=gen)[:n_sel]
    slots = (torch.arange(n_kv).unsqueeze(1) * n_blocks + order).to(dev)
    out, lse = ops.sparse_attention(
        q_local, q_far, local_k, local_v, sink_k, sink_v, k_pool, v_pool, slots, True
    )
    far_k, far_v = gather_blocks(k_pool, v_pool, slots, dtype)
    want_out, want_lse = TORCH_OPS.sparse_attention(
        *_cpu(q_local, q_far, local_k, local_v),
        *_cpu(torch.cat([sink_k, far_k], dim=1), torch.cat([sink_v, far_v], dim=1)),
        None, None, None, True,
    )  # fmt: skip
    case = (
        f"{_name(dtype)} {kv_type} group={group} T={t_len} local={local_len} sinks={sink_len} "
        f"blocks={n_sel}x{block} D={dim}"
    )
    dtype_ok = out.dtype == dtype and lse.dtype == torch.float32
    return [
        _result(
            "sparse_attention.out", case, _err(out, want_out) if dtype_ok else 1e9, OUT_TOL[dtype]
        ),
        _result("sparse_attention.lse", case, _err(lse, want_lse), LSE_TOL),
    ]


def check_mirrors(
    ops: AttentionOps, device: torch.device | str, dtype: torch.dtype, group: int, seed: int = 1
) -> list[CheckResult]:
    """partial_attention, chunk_attention, decode_attention and merge_partials against the
    reference functions of kv/attention.py and kv/merge.py."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    n_kv, dim, t_len = 2, 64, 7
    n_heads = n_kv * group

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device=dev, dtype=dtype)

    case = f"{_name(dtype)} group={group}"
    tol = OUT_TOL[dtype]
    results = []
    q, k, v = rand(n_heads, t_len, dim), rand(n_kv, t_len, dim), rand(n_kv, t_len, dim)
    out, lse = ops.partial_attention(q, k, v, True)
    want, want_lse = TORCH_OPS.partial_attention(*_cpu(q, k, v), True)
    results.append(_result("partial_attention.causal", case, _err(out, want), tol))
    results.append(_result("partial_attention.lse", case, _err(lse, want_lse), LSE_TOL))
    past = [
        (rand(n_heads, t_len, dim), rand(n_kv, s, dim), rand(n_kv, s, dim)) for s in (19, 0, 33)
    ]
    got = ops.chunk_attention(q, past, k, v)
    want = TORCH_OPS.chunk_attention(*_cpu(q), [tuple(_cpu(*p)) for p in past], *_cpu(k, v))
    results.append(_result("chunk_attention", case, _err(got, want), tol))
    q1 = rand(n_heads, 1, dim)
    parts = [(q1, rand(n_kv, s, dim), rand(n_kv, s, dim)) for s in (40, 0, 9)]
    got, received = ops.decode_attention(parts)
    want, want_received = TORCH_OPS.decode_attention([tuple(_cpu(*p)) for p in parts])
    results.append(_result("decode_attention", case, _err(got, want), tol))
    results.append(_result("decode_attention.received", case, _err(received, want_received), tol))
    outs = [rand(n_heads, t_len, dim) for _ in range(3)]
    lses = [torch.randn(n_heads, t_len, generator=gen).to(dev) for _ in range(3)]
    lses[1][0] = float("-inf")  # a partial with no keys for one row
    got, got_lse = ops.merge_partials(outs, lses)
    want, want_lse = TORCH_OPS.merge_partials(_cpu(*outs), _cpu(*lses))
    results.append(_result("merge_partials", case, _err(got, want), tol))
    results.append(_result("merge_partials.lse", case, _err(got_lse, want_lse), LSE_TOL))
    return results


def check_scoring(
    ops: AttentionOps,
    device: torch.device | str,
    dtype: torch.dtype,
    anchor_type: str,
    mode: str,
    group: int,
    n_blocks: int = 150,
    dim: int = 64,
    seed: int = 2,
) -> CheckResult:
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    n_kv = 2
    q = torch.randn(n_kv * group, dim, generator=gen).to(dev)
    # Stored as a cache of `dtype` keys stores them (key values in the keys' dtype).
    anchors = torch.randn(n_blocks, n_kv, anchor_rows(anchor_type), dim, generator=gen)
    anchors = anchors.to(dev, anchor_dtype(anchor_type, dtype))
    candidates = torch.randperm(n_blocks, generator=gen)[: n_blocks - 7].to(dev)
    got = ops.score_blocks(q, anchors, anchor_type, mode, candidates)
    want = TORCH_OPS.score_blocks(*_cpu(q, anchors), anchor_type, mode, candidates.cpu())
    tol = SCORE_RTOL * max(want.abs().max().item(), 1.0)
    case = f"{_name(anchors.dtype)} {anchor_type} {mode} group={group} blocks={n_blocks - 7}"
    return _result("score_blocks", case, _err(got, want), tol)


def check_append(
    ops: AttentionOps,
    device: torch.device | str,
    dtype: torch.dtype,
    kv_type: str,
    block: int = 32,
    dim: int = 64,
    seed: int = 3,
) -> CheckResult:
    """Quantized append against BlockPool.write: the error is the number of differing bytes."""
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    n = 5
    blocks = torch.randn(n, block, dim, generator=gen)
    blocks[0, :, 5] *= 40  # an outlier channel
    blocks[1, :, 7] += 300  # an offset channel (INT4's minimum far from zero)
    blocks[2] = 0  # an all-zero block (scale floor)
    blocks[3, :, :32] = 1000.3  # a constant group
    blocks[4, :3] = 6.0e4  # groups near the fp16 limit
    blocks = blocks.to(device=dev, dtype=dtype)
    slots = torch.tensor([6, 1, 3, 0, 7])
    want = BlockPool(8, block, dim, kv_type, dtype)
    got = BlockPool(8, block, dim, kv_type, dtype, dev)
    want.storage.zero_()
    got.storage.zero_()
    want.write(slots, blocks.cpu())
    ops.write_blocks(got, slots.to(dev), blocks)
    differing = (got.storage.cpu().view(torch.uint8) != want.storage.view(torch.uint8)).sum()
    case = f"{_name(dtype)} {kv_type} block={block} D={dim}"
    return _result("write_blocks", case, differing.item(), 0)


# |kernel - reference| of a weight product, over the sum of |x| |w| along the row: the weight
# rounded to the compute dtype when the layer unpacks it, the output rounded once.
LINEAR_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
GROUP_FORMATS = ("int4", "int4 per 16", "int8 per 32", "int8 per 16 with minimums")


def check_groups_linear(
    device: torch.device | str,
    dtype: torch.dtype,
    groups_format: str,
    rows: int,
    n: int = 72,
    k: int = 160,
    seed: int = 5,
) -> CheckResult:
    """core/triton_linear.py's layer on `groups_format` groups (GROUP_FORMATS) against the
    product with their exact fp32 weight, in fp64 on the CPU; `rows` below and above
    UNPACK_ROWS take its two paths. n and k leave ragged tiles."""
    from kvchat.core.triton_linear import TritonGroupsLinear
    from kvchat.core.weights import Int4Groups, Int8Groups

    gen = torch.Generator().manual_seed(seed)
    if groups_format.startswith("int4"):
        size = 16 if groups_format == "int4 per 16" else 32
        groups = Int4Groups(
            torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8),
            torch.rand(n, k // size, generator=gen) * 0.1,
            torch.randn(n, k // size, generator=gen) * 0.5,
        )
    else:
        size = 32 if groups_format == "int8 per 32" else 16
        minimum = torch.randn(n, k // size, generator=gen) if size == 16 else None
        groups = Int8Groups(
            torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8),
            torch.rand(n, k // size, generator=gen) * 0.01,
            minimum,
        )
    bias = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    dev = torch.device(device)
    layer = TritonGroupsLinear(groups, bias.to(device=dev, dtype=dtype), dev, dtype)
    got = layer(x.to(dev))
    w = groups.dequantize().double()
    want = torch.nn.functional.linear(x.double(), w, bias.to(dtype).double())
    tol = LINEAR_RTOL[dtype] * (x.double().abs() @ w.abs().t()).max().item()
    case = f"{_name(dtype)} {groups_format} rows={rows} N={n} K={k}"
    return _result("groups_linear", case, _err(got, want), tol)


def run_all(
    ops: AttentionOps, device: torch.device | str, dtypes: list[torch.dtype], large: bool
) -> list[CheckResult]:
    """Every kernel, every kv_type and anchor type, GQA groups 1/3/4/8, ragged lengths, a
    selection of zero blocks. `large` uses model-sized shapes (a GPU); else tiny ones."""
    if large:
        shape = dict(local_len=1000, sink_len=128, n_sel=32, block=128, dim=128, n_kv=8)
        chunk, blocks, dim = 256, 2000, 128
    else:
        shape = dict(local_len=45, sink_len=32, n_sel=3, block=32, dim=64, n_kv=2)
        chunk, blocks, dim = 5, 150, 64
    results: list[CheckResult] = []
    for dtype in dtypes:
        for kv_type in KV_TYPES:
            for group in (1, 3, 4, 8):
                results += check_sparse_attention(ops, device, dtype, kv_type, group, **shape)
            results += check_sparse_attention(ops, device, dtype, kv_type, 4, t_len=chunk, **shape)
            results += check_sparse_attention(
                ops, device, dtype, kv_type, 3, **{**shape, "n_sel": 0}
            )
            results.append(check_append(ops, device, dtype, kv_type, shape["block"], shape["dim"]))
        results += check_mirrors(ops, device, dtype, 4)
        for anchor_type in ANCHOR_TYPES:
            for mode in HEAD_SELECT_MODES:
                results.append(check_scoring(ops, device, dtype, anchor_type, mode, 4, blocks, dim))
        if ops.name == "triton":  # the weight products run through Triton wherever it does
            for groups_format in GROUP_FORMATS:
                for rows in (1, 3, 40):
                    results.append(check_groups_linear(device, dtype, groups_format, rows))
    return results
