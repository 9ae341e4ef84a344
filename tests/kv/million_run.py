"""Run a tiny random model through a 1M-token prefill + 16 decode tokens; print JSON.

Runs in its own process (see test_million.py) so its peak RSS is its own.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from dataclasses import replace
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).parent))
from conftest import TINY, small_settings, sparse_cache, tiny_model  # noqa: E402

from kvchat.core.plan import plan_memory  # noqa: E402

TOKENS = 1 << 20
DECODE = 16


def main() -> None:
    torch.set_num_threads(2)
    cfg = replace(
        TINY,
        num_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_heads=2,
        num_kv_heads=1,
        max_position_embeddings=8192,
    )
    model = tiny_model(cfg, dtype=torch.bfloat16)
    settings = small_settings(
        chunk_size=2048,
        max_seq_len=TOKENS + DECODE,
        block_size=128,
        local_windows_len=512,
        second_select_num=8,
        dense_layer_num=0,
        kv_type="INT8",
    )
    plan = plan_memory(
        cfg, settings, TOKENS + DECODE, 2, model.nbytes, psutil.virtual_memory().available
    )
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    cache = sparse_cache(model, settings, position_mode="extrapolate")
    gen = torch.Generator().manual_seed(0)
    started = time.perf_counter()
    for _ in range(0, TOKENS, cache.max_chunk):
        ids = torch.randint(0, cfg.vocab_size, (cache.max_chunk,), generator=gen)
        logits = model.forward(ids, cache)
    prefill_s = time.perf_counter() - started
    token = logits[-1].argmax().view(1)
    for _ in range(DECODE):
        token = model.forward(token, cache)[-1].argmax().view(1)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    stats = cache.stats()
    print(
        json.dumps(
            {
                "tokens": stats.tokens,
                "blocks_in_dram": stats.blocks_in_dram,
                "selected": list(stats.layers[1].selected),
                "finite": bool(torch.isfinite(logits).all()),
                "rss_growth": peak - base,
                "plan_cache_bytes": plan.cache_bytes + plan.activation_bytes,
                "prefill_s": prefill_s,
            }
        )
    )


if __name__ == "__main__":
    main()
