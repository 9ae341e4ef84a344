"""The blocks a question reads: a vote of its queries' exact scores over every stored key.

Anchors bound a block's scores from 128 keys, summed over heads, and on natural prose that
bound ranks the block a question is about no better than its neighbours. The question
itself names it: a few heads of a few layers (duplicate-token and retrieval heads) put most
of their attention on the tokens the question repeats (a name, a key), and none of them
needs to be known in advance. So in a prompt's last pass the last queries of each layer
score every stored key exactly; a block's score is its best key's, each (head, query)
softmaxes these over the blocks, and the layer gives each block the largest share any
(head, query) gives it. The shares add up over the layers, and the blocks with the most
votes so far, each with the block after it (where the answer to a matched phrase is
written), lead the selection of the later layers of the pass and of the whole answer.

The vote costs one pass over the stored keys per prompt; the decode steps after it read the
same number of blocks as without it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kvchat.config import KvType, LongContextSettings

# Blocks whose keys one matmul reads: bounds the scores' memory ([heads x keys x queries]).
# At 1M tokens a layer's vote takes 86 ms with 256 blocks a pass, 102 ms with 64 (Xeon).
VOTE_BLOCKS = 256

KeyReader = Callable[[int, int], torch.Tensor]
# scores [H, n * block, R] -> fp32 [H, n, R]: each block's best key per row.
BlockMax = Callable[[torch.Tensor, int], torch.Tensor]


def torch_block_max(scores: torch.Tensor, block: int) -> torch.Tensor:
    return scores.unflatten(1, (-1, block)).amax(dim=2).float()


def layer_shares(
    q: torch.Tensor,
    read_keys: KeyReader,
    first: int,
    last: int,
    dtype: torch.dtype,
    block_max: BlockMax = torch_block_max,
) -> torch.Tensor:
    """Per block of first..last-1, the largest share one (head, query) gives it.

    q: [n_heads, n_q, D] queries as they read stored keys; read_keys(lo, hi): the keys of
    blocks lo..hi-1, [n_kv, (hi - lo) * block, D]; dtype: of the products (the keys' bf16
    where the CPU multiplies bf16 in hardware, else float32); block_max: the reduction of a
    block's scores (the CPU kernel's where it is built). A block's score for a (head, query)
    is its best key's; each (head, query) softmaxes them over the blocks (a softmax over
    every key costs an exp per key, 2.5x the products). Returns float32 [last - first].
    """
    n_heads, n_q, dim = q.shape
    rows = best = None
    for lo in range(first, last, VOTE_BLOCKS):
        hi = min(lo + VOTE_BLOCKS, last)
        keys = read_keys(lo, hi).to(dtype)
        if rows is None:
            n_kv = keys.shape[0]
            rows = q.to(dtype).reshape(n_kv, n_heads // n_kv * n_q, dim).transpose(1, 2)
            # Allocated once, before the passes: a small result kept from each pass between
            # their large freed buffers would fragment the heap, which then grows by about a
            # pass's scores every pass (250 MB over a 1M-token vote).
            best = torch.empty(n_kv, last - first, rows.shape[2], dtype=torch.float32)
        # Keys by queries: the orientation oneDNN's bf16 matmul runs fastest (AMX: 2x).
        scores = torch.matmul(keys, rows)
        del keys
        best[:, lo - first : hi - first] = block_max(scores, scores.shape[1] // (hi - lo))
        del scores
    if best is None:
        return torch.zeros(0)
    return torch.softmax(best * (1 / math.sqrt(dim)), dim=1).amax(dim=(0, 2))


def pin_count(lc: LongContextSettings) -> int:
    """Blocks to pin: each brings the block after it, and together they take at most the
    budget's half, so the query of each step still chooses the rest."""
    return min(lc.pinned_blocks, lc.second_select_num // 4)


def gathered_blocks(lc: LongContextSettings, n_blocks: int) -> int:
    """Blocks (per KV head) whose keys a vote over `n_blocks` stored blocks gathers at once:
    none where no pins are voted or the keys are read in place (FP16)."""
    if pin_count(lc) == 0 or lc.kv_type == KvType.FP16:
        return 0
    return min(VOTE_BLOCKS, n_blocks)


def pick(votes: torch.Tensor, first: int, count: int, last: int) -> torch.Tensor:
    """The `count` blocks with the most votes (votes[i] is block first + i), each with the
    block after it where that is below `last`: long ids, ascending, unique."""
    if count <= 0 or votes.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    top = votes.topk(min(count, votes.numel())).indices + first
    blocks = torch.cat([top, top + 1])
    return torch.unique(blocks[blocks < last])
