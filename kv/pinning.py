"""The blocks a question reads: a vote of its queries' exact attention over every stored key.

Anchors bound a block's scores from 128 keys, summed over heads, and on natural prose that
bound ranks the block a question is about no better than its neighbours. The question
itself names it: a few heads of a few layers (duplicate-token and retrieval heads) put most
of their attention on the tokens the question repeats (a name, a key), and none of them
needs to be known in advance. So once per prompt, before the answer's first token, the
prompt's last queries attend exactly to every stored key of every layer; each layer gives
each block the largest share of attention any of its (head, query) pairs gives it, the
shares are summed over layers, and the top blocks, each with the block after it (where the
answer to a matched phrase is written), are read by every layer while the answer decodes.

The vote costs one pass over the stored keys per prompt; the decode steps after it read the
same number of blocks as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

# Blocks whose keys one matmul reads: bounds the scores' memory ([heads x queries x keys]).
_CHUNK_BLOCKS = 256

KeyReader = Callable[[int, int], torch.Tensor]


def layer_shares(q: torch.Tensor, read_keys: KeyReader, first: int, last: int) -> torch.Tensor:
    """Per block of first..last-1, the largest share of attention one (head, query) gives it.

    q: [n_heads, n_q, D] queries as they read stored keys; read_keys(lo, hi): the keys of
    blocks lo..hi-1, [n_kv, (hi - lo) * block, D]. Each (head, query) softmaxes over the keys
    of all these blocks; returns float32 [last - first].
    """
    n_heads, n_q, dim = q.shape
    parts = []
    for lo in range(first, last, _CHUNK_BLOCKS):
        hi = min(lo + _CHUNK_BLOCKS, last)
        keys = read_keys(lo, hi).float()
        n_kv = keys.shape[0]
        rows = q.float().reshape(n_kv, n_heads // n_kv * n_q, dim)
        scores = torch.matmul(rows, keys.transpose(1, 2)) * (1 / math.sqrt(dim))
        # log of each block's attention mass, before the softmax's normalisation
        parts.append(torch.logsumexp(scores.unflatten(-1, (hi - lo, -1)), dim=-1))
    mass = torch.cat(parts, dim=-1)
    shares = torch.exp(mass - torch.logsumexp(mass, dim=-1, keepdim=True))
    return shares.flatten(0, 1).amax(dim=0)


def pick(votes: torch.Tensor, first: int, count: int, last: int) -> torch.Tensor:
    """The `count` blocks with the most votes (votes[i] is block first + i), each with the
    block after it where that is below `last`: long ids, ascending, unique."""
    if count <= 0 or votes.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    top = votes.topk(min(count, votes.numel())).indices + first
    blocks = torch.cat([top, top + 1])
    return torch.unique(blocks[blocks < last])
