"""A snapshot's blocks are mapped into the restored cache instead of copied: the same reply as
the session that saved it, and the file unchanged by everything the restored cache writes."""

from __future__ import annotations

import hashlib
import sys

import numpy as np
import pytest

from kvchat.config import GenerationSettings, load_settings
from kvchat.core.engine import Engine, Session
from kvchat.core.snapshot import PrefillReport

from ..kv.test_host_pages import mapped_from
from .million_run import KV_HEADS, VOCAB, write_model

TOKENS = 1 << 16
PARAMS = GenerationSettings(temperature=0.0, max_new_tokens=24)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
@pytest.mark.parametrize("kv_type", ["INT8", "INT4"])
def test_a_restored_cache_maps_the_snapshot_and_never_writes_it(kv_type, tmp_path):
    write_model(tmp_path / "tiny.gguf")
    settings = load_settings(overrides=[f"long_context.kv_type={kv_type}"]).settings
    engine = Engine.load(settings, str(tmp_path / "tiny.gguf"))
    engine.snapshot_dir = tmp_path / "snapshots"
    gen = np.random.default_rng(0)
    document = gen.integers(3, VOCAB, TOKENS).tolist()
    prompt = document + gen.integers(3, VOCAB, 40).tolist()

    def answer() -> tuple[list[int], PrefillReport, Session]:
        session = engine.new_session()
        report = session.prefill_document(document)
        session.prefill_prompt(prompt, PARAMS)
        return list(session.generate(PARAMS)), report, session

    reply, cold, session = answer()
    assert cold.saved is not None
    path = cold.saved.path
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    del session
    warm_reply, warm, session = answer()
    assert warm.restored is not None and warm.prefilled == 0
    assert warm_reply == reply
    pools = [p.storage for st in session.cache.layers for p in (st.k_pool, st.v_pool)]
    stored = sum(pool[0].numel() for pool in pools) * KV_HEADS * (TOKENS // 128)
    assert sum(mapped_from(path, pool) for pool in pools) > 0.9 * stored
    # The restored cache went on writing (the question, the reply): the file is as saved, and
    # a third session still loads it and answers the same.
    assert hashlib.sha256(path.read_bytes()).hexdigest() == digest
    del session
    third, again, _ = answer()
    assert again.restored is not None and not again.warnings and third == reply
