"""Changing settings on a loaded engine: live values reach the built cache, cache-shaping
values make it stale until it is rebuilt, on the real SmolLM2 with a real sparse cache."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvchat.config import Settings, replace_key
from kvchat.core.engine import ApplyResult, Engine, setting_effect
from kvchat.core.plan import PlanRefusedError
from kvchat.kv.sparse import SparseBackend

# Small blocks and window so a ~300-token context has stored blocks to select from.
SMALL = {
    "long_context.chunk_size": 128,
    "long_context.max_seq_len": 4096,
    "long_context.block_size": 32,
    "long_context.local_windows_len": 128,
    "long_context.second_select_num": 4,
    "generation.max_new_tokens": 4,
}
TEXT = "The lighthouse keeper wrote the weather in his log every hour. " * 24


def _settings(base: Settings, **changes: object) -> Settings:
    for key, value in {**SMALL, **changes}.items():
        base = replace_key(base, key, value)
    return base


@pytest.fixture
def engine(engine_fp32: Engine) -> Engine:
    """An engine of its own (apply_settings changes it) over the shared weights."""
    return engine_fp32.with_settings(_settings(engine_fp32.settings))


def _prefilled(engine: Engine) -> list[int]:
    ids = engine.tokenizer.encode(TEXT)
    engine.prefill(ids)
    return ids


def test_each_key_has_one_effect() -> None:
    assert setting_effect("long_context.second_select_num") == "live"
    assert setting_effect("generation.temperature") == "live"
    assert setting_effect("keys.stop") == "live"
    assert setting_effect("long_context.block_size") == "cache"
    assert setting_effect("long_context.kv_type") == "cache"
    assert setting_effect("long_context.threads_num") == "reload"
    assert setting_effect("model.dtype") == "reload"


def test_live_values_reach_the_built_cache(engine: Engine) -> None:
    ids = _prefilled(engine)
    cache = engine.session.cache
    assert isinstance(cache, SparseBackend)
    slots = cache.device_cache.slots_per_layer

    new = _settings(
        engine.settings,
        **{"long_context.second_select_num": 2, "generation.max_new_tokens": 3},
    )
    result = engine.apply_settings(replace(new, ui=replace(new.ui, theme="light")))

    assert result == ApplyResult(
        live=("generation.max_new_tokens", "long_context.second_select_num", "ui.theme"),
        cache=(),
        reload=(),
    )
    assert engine.session.cache is cache and engine.session.tokens == ids
    assert not engine.session.stale
    assert cache.lc.second_select_num == 2 and cache.device_cache.slots_per_layer == slots // 2
    assert len(list(engine.generate())) == 3
    selected = [len(layer.selected) for layer in cache.stats().layers if not layer.dense]
    assert selected and max(selected) <= 2


def test_a_cache_shaping_change_is_rebuilt_like_a_fresh_prefill(engine: Engine) -> None:
    ids = _prefilled(engine)
    new = _settings(engine.settings, **{"long_context.kv_type": "INT8"})
    result = engine.apply_settings(new)
    assert result == ApplyResult(live=(), cache=("long_context.kv_type",), reload=())
    assert engine.session.stale and engine.session.tokens == ids

    progress: list[tuple[int, int]] = []
    assert engine.session.rebuild(lambda done, total: progress.append((done, total))) == len(ids)
    assert not engine.session.stale and engine.session.tokens == ids
    assert engine.stats().cache.kv_dtype == "INT8" and progress[-1] == (len(ids), len(ids))

    fresh = engine.with_settings(engine.settings)
    assert torch.equal(fresh.prefill(ids), engine.session.logits)


def test_the_next_question_rebuilds_a_stale_cache(engine: Engine) -> None:
    _prefilled(engine)
    engine.apply_settings(_settings(engine.settings, **{"long_context.block_size": 64}))
    reply = "".join(engine.session.ask("Who wrote the log?"))
    assert reply and not engine.session.stale
    assert engine.stats().cache.block_size == 64


def test_a_rebuild_that_no_longer_fits_changes_nothing(engine: Engine) -> None:
    ids = _prefilled(engine)
    cache = engine.session.cache
    engine.apply_settings(
        _settings(
            engine.settings,
            **{"long_context.max_seq_len": 256, "long_context.chunk_size": 128},
        )
    )
    with pytest.raises(PlanRefusedError, match="long_context.max_seq_len is 256"):
        engine.session.rebuild()
    assert engine.session.cache is cache and engine.session.tokens == ids


def test_model_values_and_threads_num_wait_for_a_model_reload(engine: Engine) -> None:
    before = engine.settings
    threads = before.long_context.threads_num + 1
    new = replace_key(
        _settings(before, **{"long_context.threads_num": threads}), "model.dtype", "bfloat16"
    )
    result = engine.apply_settings(new)
    assert result == ApplyResult(live=(), cache=(), reload=("long_context.threads_num",))
    assert engine.settings.long_context.threads_num == before.long_context.threads_num
    assert engine.settings.model == before.model
