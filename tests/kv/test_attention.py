"""The torch attention reference: key sets read in place (a slice of the local window buffer,
whose head stride is not its rows' size) give the same decode output as contiguous copies, and
one softmax over the union of the sets."""

from __future__ import annotations

import pytest
import torch

from kvchat.kv.attention import decode_attention


@pytest.mark.parametrize("n_kv,group", [(1, 4), (2, 1), (3, 3), (2, 8)])
def test_decode_over_a_window_slice_equals_a_contiguous_copy(n_kv: int, group: int) -> None:
    torch.manual_seed(n_kv * 10 + group)
    dim, capacity, start, length = 32, 90, 7, 61
    # Buffers as the sparse cache keeps its window: [n_kv, capacity, D], sliced to the tokens
    # in use.
    keys = torch.randn(n_kv, capacity, dim)[:, start : start + length]
    values = torch.randn(n_kv, capacity, dim)[:, start : start + length]
    far_k, far_v = torch.randn(2, n_kv, 40, dim).unbind(0)
    q = torch.randn(n_kv * group, 1, dim)
    q_far = torch.randn(n_kv * group, 1, dim)
    assert n_kv == 1 or not keys.is_contiguous()

    out, received = decode_attention([(q, keys, values), (q_far, far_k, far_v)])
    want, want_received = decode_attention(
        [(q, keys.contiguous(), values.contiguous()), (q_far, far_k, far_v)]
    )
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(received, want_received, atol=1e-7, rtol=1e-5)

    # And both equal one softmax over the union, written out per query head.
    scale = dim**-0.5
    for h in range(n_kv * group):
        kv = h // group
        scores = torch.cat([keys[kv] @ q[h, 0], far_k[kv] @ q_far[h, 0]]) * scale
        probs = torch.softmax(scores, dim=0)
        expected = probs @ torch.cat([values[kv], far_v[kv]])
        torch.testing.assert_close(out[h, 0], expected, atol=1e-5, rtol=1e-4)
