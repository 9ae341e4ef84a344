"""The app's document-loading step with KV snapshots, on the real SmolLM2: the second load of
a document comes from its snapshot and says how much time that saved; a damaged snapshot is
reported as a warning notice and the document is prefilled as usual; the save shows its
progress and Esc during it skips the snapshot."""

from __future__ import annotations

import threading
from dataclasses import replace
from importlib import resources

from textual.message import Message

from kvchat.tui import bridge
from kvchat.tui.messages import SAVE_PHASE, Notice, Progress


def small_engine_and_document(engine_fp32, settings_fp32, tmp_path):
    """An engine saving snapshots of prefills from 64 tokens into tmp_path, and a ~300-token
    document file."""
    lc = replace(
        settings_fp32.long_context,
        chunk_size=64,
        max_seq_len=4096,
        block_size=32,
        local_windows_len=128,
        second_select_num=2,
    )
    cache = replace(settings_fp32.cache, snapshots=True, snapshot_min_tokens=64)
    engine = engine_fp32.with_settings(replace(settings_fp32, long_context=lc, cache=cache))
    engine.snapshot_dir = tmp_path / "snapshots"
    text = resources.files("kvchat.core").joinpath("data/sample.txt").read_text()
    doc = tmp_path / "harrow.txt"
    doc.write_text(text[:1200])
    return engine, doc


def test_loading_a_document_again_uses_its_snapshot_and_says_so(
    engine_fp32, settings_fp32, tmp_path
):
    engine, doc = small_engine_and_document(engine_fp32, settings_fp32, tmp_path)

    posted: list[Message] = []
    first = bridge.load_document(engine, [doc], posted.append, threading.Event())
    assert first.startswith("harrow.txt is ready: ") and "tokens prefilled" in first
    assert "saved as snapshot" in first
    [snapshot] = engine.snapshot_dir.glob("*.kvsnap")
    assert snapshot.stem in first

    again = bridge.load_document(engine, [doc], posted.append, threading.Event())
    assert f"tokens from snapshot {snapshot.stem} in " in again
    assert "(prefill would take ~" in again and "prefilled" not in again
    assert not [m for m in posted if isinstance(m, Notice)]

    data = bytearray(snapshot.read_bytes())
    data[-100] ^= 0xFF
    snapshot.write_bytes(bytes(data))
    damaged = bridge.load_document(engine, [doc], posted.append, threading.Event())
    assert "tokens prefilled" in damaged
    [notice] = [m for m in posted if isinstance(m, Notice)]
    assert notice.severity == "warning" and notice.title == "snapshot"
    assert f"snapshot {snapshot.stem} is damaged" in notice.text


def test_the_save_shows_its_progress_and_esc_during_it_keeps_the_document_alone(
    engine_fp32, settings_fp32, tmp_path
):
    engine, doc = small_engine_and_document(engine_fp32, settings_fp32, tmp_path)

    posted: list[Message] = []
    bridge.load_document(engine, [doc], posted.append, threading.Event())
    saves = [m for m in posted if isinstance(m, Progress) and m.phase == SAVE_PHASE]
    [snapshot] = engine.snapshot_dir.glob("*.kvsnap")
    assert saves and saves[-1].done == saves[-1].total == snapshot.stat().st_size >> 20
    snapshot.unlink()

    # Esc as soon as the save reports: the document stays loaded, no snapshot is left.
    cancel, posted = threading.Event(), []

    def post(message: Message) -> None:
        posted.append(message)
        if isinstance(message, Progress) and message.phase == SAVE_PHASE:
            cancel.set()

    ready = bridge.load_document(engine, [doc], post, cancel)
    assert "tokens prefilled" in ready and "saved as snapshot" not in ready
    [notice] = [m for m in posted if isinstance(m, Notice)]
    assert notice.text == "snapshot not saved: stopped before it was written whole"
    assert list(engine.snapshot_dir.iterdir()) == []  # neither a snapshot nor a temp file
    session = engine.session
    assert session.tokens == session.conversation.document_prefix_ids(engine.tokenizer)
