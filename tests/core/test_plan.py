"""The memory planner against hand-computed bytes, and the guards that use it."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvchat.config import LongContextSettings
from kvchat.core import memory
from kvchat.core.model_config import ModelConfig
from kvchat.core.plan import (
    RUNTIME_BYTES,
    TOKEN_ID_BYTES,
    PlanRefusedError,
    plan_memory,
    plan_table,
)

SMOL = ModelConfig(
    architecture="llama",
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    head_dim=64,
    rms_norm_eps=1e-5,
    rope_theta=1e5,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
    name="smol",
)
# Spelled out so the hand-computed numbers do not follow changes of the defaults.
SPARSE = LongContextSettings(
    attention="sparse",
    chunk_size=4096,
    local_windows_len=4096,
    second_select_num=32,
    dense_layer_num=0,
    anchor_type="DYNAMIC",
    anchor_num=1,
)
GIB = 1024**3


def test_dense_kv_bytes():
    p = plan_memory(SMOL, replace(SPARSE, attention="dense"), 4096, 2, 0, 100 * GIB)
    # tokens x (K,V) x layers x KV heads x head_dim x bf16
    assert p.kv_bytes == 4096 * 2 * 30 * 3 * 64 * 2 == 94_371_840
    assert p.anchor_bytes == p.resident_bytes == 0


@pytest.mark.parametrize(
    "kv_type,per_token_head",
    [("FP16", 64 * 2), ("INT8", 64 + 2 * 2), ("INT4", 32 + 2 * 2 * 2)],
)
def test_sparse_kv_bytes_by_kv_type(kv_type, per_token_head):
    p = plan_memory(SMOL, replace(SPARSE, kv_type=kv_type), 4096, 2, 0, 100 * GIB)
    # 32 blocks of 128 tokens; values+scales (+minimums) per token and head
    assert p.kv_bytes == 32 * 128 * 30 * 2 * 3 * per_token_head
    assert p.kv_type == kv_type


def test_anchor_and_resident_bytes():
    p = plan_memory(SMOL, SPARSE, 4096, 2, 0, 100 * GIB)
    assert p.anchor_bytes == 32 * 30 * 3 * 1 * 64 * 4
    # QUEST's min and max keys are stored in the keys' dtype: bf16 here, fp32 for fp32 keys.
    quest = replace(SPARSE, anchor_type="QUEST")
    assert plan_memory(SMOL, quest, 4096, 2, 0, 100 * GIB).anchor_bytes == 32 * 30 * 3 * 2 * 64 * 2
    assert plan_memory(SMOL, quest, 4096, 4, 0, 100 * GIB).anchor_bytes == 32 * 30 * 3 * 2 * 64 * 4
    window = 4096 + 2 * 128 + 4096
    sinks = 30 * 2 * 3 * 128 * 64 * 2
    gather = 2 * 3 * 32 * 128 * 64 * 2  # dense layers gather all 32 blocks; 32 = select too
    assert p.resident_bytes == 30 * 3 * window * (3 * 64 * 2 + 4) + sinks + gather
    assert p.activation_bytes > RUNTIME_BYTES
    # The prompt's token ids grow with the context; the chunk's temporaries do not.
    longer = plan_memory(SMOL, SPARSE, 4096 + 1000, 2, 0, 100 * GIB)
    assert longer.activation_bytes == p.activation_bytes + 1000 * TOKEN_ID_BYTES


def test_runtime_counts_in_the_total_but_is_not_needed_again():
    base = plan_memory(SMOL, SPARSE, 4096, 2, 100_000_000, 100 * GIB)
    p = plan_memory(SMOL, SPARSE, 4096, 2, 100_000_000, 100 * GIB, runtime_bytes=300_000_000)
    assert p.total_bytes == base.total_bytes + 300_000_000
    assert p.needed_bytes == base.needed_bytes  # the process is running already


def test_engine_measures_its_runtime(engine_fp32):
    import psutil

    rss = psutil.Process().memory_info().rss
    assert 50e6 < engine_fp32.runtime_bytes < rss
    assert engine_fp32.plan(4096).runtime_bytes == engine_fp32.runtime_bytes


def test_fits_and_refusal_message():
    p = plan_memory(SMOL, SPARSE, 1 << 20, 2, 100_000_000, 8 * GIB)
    assert not p.fits
    msg = p.refusal()
    assert "1,048,576 tokens" in msg and "GiB" in msg and "INT4" in msg and "max_seq_len" in msg
    assert plan_memory(SMOL, replace(SPARSE, kv_type="INT4"), 1 << 20, 2, 0, 16 * GIB).fits


def test_plan_table_lists_every_size_and_kv_type():
    table = plan_table(SMOL, SPARSE, 2, 100_000_000)
    for n in ("4096", "32768", "65536", "131072", "524288", "1048576"):
        assert f"\n{n:>9} " in table
    assert "FP16" in table and "INT8" in table and "INT4" in table


def test_engine_refuses_a_plan_above_memory(engine_fp32, settings_fp32):
    huge = replace(
        settings_fp32,
        long_context=replace(settings_fp32.long_context, attention="dense", max_seq_len=4_194_304),
    )
    engine = engine_fp32.with_settings(huge)
    with pytest.raises(PlanRefusedError) as e:
        engine.check_fits(4_000_000, 0)  # 4M fp32 tokens: ~170 GiB of KV
    assert "4,000,000 tokens need" in str(e.value) and "usable" in str(e.value)


@pytest.mark.parametrize(
    ("proc_line", "files"),
    [
        (  # cgroup v2: the limit of the process's own group
            "0::/user.slice/kvchat.scope",
            {
                "user.slice/kvchat.scope/memory.max": str(600 << 20),
                "user.slice/kvchat.scope/memory.current": str(700 << 20),
                # 200 MiB of the usage is page cache the kernel can take back first.
                "user.slice/kvchat.scope/memory.stat": f"file 9\ninactive_file {200 << 20}",
            },
        ),
        (  # cgroup v2: a limit on an ancestor applies as well
            "0::/box/kvchat",
            {
                "box/memory.max": str(600 << 20),
                "box/memory.current": str(500 << 20),
                "box/kvchat/memory.max": "max",
                "box/kvchat/memory.current": str(400 << 20),
            },
        ),
        (  # cgroup v1, as a container sees it
            "7:cpuset,memory:/",
            {
                "memory/memory.limit_in_bytes": str(600 << 20),
                "memory/memory.usage_in_bytes": str(500 << 20),
            },
        ),
    ],
    ids=["v2", "v2-ancestor", "v1"],
)
def test_a_cgroup_limit_makes_the_plan_refuse(fake_cgroups, engine_fp32, proc_line, files):
    engine_fp32.check_fits(4096, 16)  # fits the host
    fake_cgroups(proc_line, files)
    assert memory.available_memory() == 100 << 20
    with pytest.raises(PlanRefusedError, match="usable"):
        engine_fp32.check_fits(4096, 16)
    assert "available now: 0.10 GiB" in plan_table(SMOL, SPARSE, 2, 100_000_000)


def test_no_cgroup_limit_leaves_the_host_figure(fake_cgroups):
    fake_cgroups(
        "0::/\n9:memory:/",
        {
            "memory.max": "max",
            "memory.current": "1",
            "memory/memory.limit_in_bytes": str(2**63 - 4096),
            "memory/memory.usage_in_bytes": "1",
        },
    )
    assert memory._cgroup_room() == []  # "max" and v1's 2^63 are no limit
