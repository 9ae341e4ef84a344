"""KV snapshots: saved from a real SmolLM2 session, loaded in a new process with identical
logits (FP16, INT8, INT4 block stores); damaged, foreign and mismatched snapshots are ignored
with a warning and a normal prefill; a writer killed mid-save leaves nothing under a real name.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from importlib import resources
from pathlib import Path

import pytest
import torch

from kvchat.core.engine import Engine
from kvchat.core.gguf_header import read_gguf_header
from kvchat.core.snapshot import (
    SUFFIX,
    SnapshotError,
    SnapshotStore,
    cap_bytes,
    model_identity,
    snapshot_dir,
)
from kvchat.kv.state import CacheState
from kvchat.tui.cli import main

from .snapshot_child import settings_for
from .test_hf_loader import save_model

CHILD = Path(__file__).with_name("snapshot_child.py")
QUESTION = "When was the lighthouse built?"
# Two of the ~8 candidate blocks per query: selection is really at work, as with the defaults.
BUDGET = "long_context.second_select_num=2"
KV_CASES = {
    "FP16": [BUDGET, "long_context.kv_type=FP16", "long_context.position_mode=native"],
    "INT8": [BUDGET, "long_context.kv_type=INT8", "long_context.position_mode=extrapolate"],
    "INT4": [BUDGET, "long_context.kv_type=INT4", "long_context.position_mode=native"],
}


@pytest.fixture(scope="module")
def document_ids(engine_fp32):
    text = resources.files("kvchat.core").joinpath("data/sample.txt").read_text()
    return engine_fp32.tokenizer.encode(text[:1200])


def engine_for(engine_fp32, overrides, folder: Path) -> Engine:
    engine = engine_fp32.with_settings(settings_for(overrides))
    engine.snapshot_dir = folder
    return engine


def open_document(engine: Engine, document_ids):
    session = engine.new_session()
    session.conversation.document_ids = document_ids
    prefix = session.conversation.document_prefix_ids(engine.tokenizer)
    return session, prefix, session.prefill_document(prefix)


@pytest.fixture(scope="module")
def originals(engine_fp32, document_ids, tmp_path_factory):
    """Per kv_type: a session that prefills the document (saving a snapshot), then asks; and
    the same question asked in a new process that loads the snapshot."""
    cases, tasks = {}, []
    for kv, overrides in KV_CASES.items():
        folder = tmp_path_factory.mktemp(f"snapshots-{kv}")
        engine = engine_for(engine_fp32, overrides, folder)
        session, prefix, report = open_document(engine, document_ids)
        assert report.restored is None and report.saved is not None
        assert report.prefilled == len(prefix)
        document_logits = session.logits.clone()
        prompt = session.conversation.prompt_ids(engine.tokenizer, QUESTION)
        session.sync(prompt)
        logits = session.logits.clone()
        cases[kv] = {
            "saved": report.saved,
            "folder": folder,
            "prefix": prefix,
            "prompt": prompt,
            "document_logits": document_logits,
            "logits": logits,
            "answer": list(session.generate()),
        }
        out = folder.parent / f"{kv}.pt"
        tasks.append(
            {
                "overrides": overrides,
                "snapshot_dir": str(folder),
                "document_ids": document_ids,
                "question": QUESTION,
                "out": str(out),
            }
        )
        cases[kv]["out"] = out
    spec = tmp_path_factory.mktemp("child") / "tasks.json"
    spec.write_text(json.dumps(tasks))
    result = subprocess.run(
        [sys.executable, str(CHILD), "ask", str(spec)], capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for case in cases.values():
        case["child"] = torch.load(case["out"])
    return cases


@pytest.mark.parametrize("kv", KV_CASES)
def test_a_snapshot_loaded_in_a_new_process_gives_identical_logits(originals, kv):
    case = originals[kv]
    child = case["child"]
    assert child["warnings"] == []
    assert child["restored"] == case["saved"].id
    assert child["document_prefilled"] == 0  # the whole document came from the snapshot
    assert child["prompt_prefilled"] == len(case["prompt"]) - len(case["prefix"])
    assert torch.equal(child["logits"], case["logits"])
    assert child["answer"] == case["answer"]


def test_the_snapshot_holds_what_the_header_says(originals, smollm_path):
    info = originals["INT4"]["saved"]
    header = info.header
    assert header["tokens"] == len(originals["INT4"]["prefix"]) == info.tokens
    assert header["settings"]["kv_type"] == "INT4"
    assert header["settings"]["block_size"] == 32
    assert header["settings"]["position_mode"] == "native"
    assert header["model"]["id"] == model_identity(smollm_path)
    sections = {s["name"]: s for s in header["sections"]}
    assert all(s["offset"] % 64 == 0 for s in sections.values())
    # INT4 rows: 64 dims -> 32 packed bytes + 2 groups x (scale, minimum) fp16, per token.
    rows = sections["cache.0.k_pool"]
    assert rows["dtype"] == "uint8" and rows["shape"][2] == 32 * (32 + 8)
    assert sections["tokens"]["shape"] == [info.tokens]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x40
    path.write_bytes(bytes(data))


def _damage_data(path: Path, info) -> None:
    section = next(s for s in info.header["sections"] if s["name"] == "cache.3.v_pool")
    _flip(path, section["offset"] + section["nbytes"] // 2)


def _damage_header(path: Path, info) -> None:
    _flip(path, 40)


def _truncate(path: Path, info) -> None:
    with path.open("r+b") as f:
        f.truncate(info.size_bytes - 1000)


DAMAGE = {
    "flipped data byte": (_damage_data, "section cache.3.v_pool fails its checksum"),
    "flipped header byte": (_damage_header, "the header fails its checksum"),
    "truncated": (_truncate, "truncated"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_snapshot_is_deleted_with_a_warning_and_the_prefill_runs(
    engine_fp32, document_ids, originals, tmp_path, damage
):
    case = originals["FP16"]
    saved = case["saved"]
    path = tmp_path / saved.path.name
    shutil.copy(saved.path, path)
    spoil, reason = DAMAGE[damage]
    spoil(path, saved)
    engine = engine_for(engine_fp32, KV_CASES["FP16"], tmp_path)
    session, prefix, report = open_document(engine, document_ids)
    assert report.restored is None
    assert len(report.warnings) == 1
    assert f"snapshot {saved.id} is damaged" in report.warnings[0]
    assert reason in report.warnings[0] and "deleted it" in report.warnings[0]
    assert report.prefilled == len(prefix)
    assert torch.equal(session.logits, case["document_logits"])
    # The normal prefill saved a good snapshot under the same name again.
    assert report.saved is not None and report.saved.id == saved.id
    assert SnapshotStore(tmp_path, 1 << 30).entries()[0].problem is None


def test_a_snapshot_made_with_other_cache_settings_is_kept_but_not_used(
    engine_fp32, document_ids, originals, tmp_path
):
    fp16 = originals["FP16"]["saved"]
    shutil.copy(fp16.path, tmp_path / fp16.path.name)
    int8 = [BUDGET, "long_context.kv_type=INT8", "long_context.position_mode=native"]
    off = engine_for(engine_fp32, [*int8, "cache.snapshots=false"], tmp_path)
    _, _, plain = open_document(off, document_ids)
    reference = off.session.logits.clone()
    assert plain.warnings == () and plain.saved is None

    engine = engine_for(engine_fp32, int8, tmp_path)
    session, prefix, report = open_document(engine, document_ids)
    assert report.restored is None and report.prefilled == len(prefix)
    assert report.warnings == (
        f"snapshot {fp16.id} of these {len(prefix):,} tokens was made with other cache "
        "settings (kv_type FP16, now INT8); ignored",
    )
    assert torch.equal(session.logits, reference)
    assert (tmp_path / fp16.path.name).exists()


def _renamed_copy(source: Path, target: Path) -> Path:
    """The GGUF with one letter of its general.name changed: another model file."""
    data = bytearray(source.read_bytes())
    at = data.index(b"general.name")
    at = data.index(b"Smollm2", at)
    data[at] = ord("X")
    target.write_bytes(bytes(data))
    return target


def test_a_snapshot_from_another_model_is_kept_but_not_used(
    engine_fp32, smollm_path, document_ids, originals, tmp_path
):
    other_file = _renamed_copy(smollm_path, tmp_path / "other.gguf")
    folder = tmp_path / "snapshots"
    # The engine reads its identity from its source file; these weights are SmolLM2's, which
    # is all the snapshot needs, and the identity check is what is under test.
    base = engine_for(engine_fp32, KV_CASES["FP16"], folder)
    other = Engine(
        base.settings, base.model, base.tokenizer, other_file, base.threads, base.weight_format
    )
    other.snapshot_dir = folder
    assert other.model_id != base.model_id
    _, prefix, made = open_document(other, document_ids)
    assert made.saved is not None

    session, prefix, report = open_document(base, document_ids)
    assert report.restored is None and report.prefilled == len(prefix)
    [warning] = report.warnings
    assert f"snapshot {made.saved.id} of these {len(prefix):,} tokens" in warning
    assert "was made with another model (Smollm2 135M" in warning
    assert f"id {other.model_id[:12]}); ignored" in warning
    assert torch.equal(session.logits, originals["FP16"]["document_logits"])
    assert made.saved.path.exists()


def test_model_identity_reads_metadata_tensor_table_and_weight_samples(smollm_path, tmp_path):
    ours = model_identity(smollm_path)
    copy = tmp_path / "copy.gguf"
    shutil.copy(smollm_path, copy)
    assert model_identity(copy) == ours  # the content, not the path
    assert model_identity(_renamed_copy(smollm_path, tmp_path / "renamed.gguf")) != ours
    sampled = bytearray(copy.read_bytes())
    end = read_gguf_header(copy).end
    sampled[end + (len(sampled) - end) * 5 // 16 + 7] ^= 1  # inside the fifth weight sample
    (tmp_path / "tuned.gguf").write_bytes(bytes(sampled))
    assert model_identity(tmp_path / "tuned.gguf") != ours

    folder = tmp_path / "hf"
    save_model(folder)
    hf = model_identity(folder)
    assert hf == model_identity(folder)
    config = json.loads((folder / "config.json").read_text())
    config["rope_theta"] = 20000.0
    (folder / "config.json").write_text(json.dumps(config))
    assert model_identity(folder) != hf


def _tiny_state(value: float, length: int = 1, n: int = 64 * 1024) -> CacheState:
    return CacheState({"length": length}, {"x": torch.full((n,), value)})


def test_lookup_takes_the_longest_prefix_and_eviction_the_least_recently_used(tmp_path):
    size = SnapshotStore(tmp_path / "probe", 1 << 30).save(
        _tiny_state(0.0), [9], torch.zeros(4), "m", "m", {}
    )
    store = SnapshotStore(tmp_path / "snaps", int(2.5 * size.size_bytes))
    short = store.save(_tiny_state(1.0), [1], torch.zeros(4), "m", "m", {})
    longer = store.save(_tiny_state(2.0, 2), [1, 2], torch.zeros(4), "m", "m", {})
    found = store.find([1, 2, 3], "m", {})
    assert found.snapshot is not None and found.snapshot.info.id == longer.id
    assert found.snapshot.tokens == [1, 2]
    assert torch.equal(found.snapshot.state.tensors["x"], _tiny_state(2.0).tensors["x"])
    assert store.find([1, 2, 3], "m", {}, longer_than=2).snapshot is None
    foreign = store.find([1, 2, 3], "other", {})
    assert foreign.snapshot is None and len(foreign.warnings) == 2
    assert all("was made with another model" in w for w in foreign.warnings)

    # `longer` was just used, so the next save evicts `short` to stay under the cap.
    third = store.save(_tiny_state(3.0), [3], torch.zeros(4), "m", "m", {})
    assert {i.id for i in store.entries()} == {longer.id, third.id}
    assert not short.path.exists() and store.total_bytes() <= store.max_bytes

    too_big = _tiny_state(4.0, n=1 << 20)
    with pytest.raises(SnapshotError, match=r"more than the snapshots may take: .*KiB \(cache"):
        store.save(too_big, [4], torch.zeros(4), "m", "m", {})
    assert {i.id for i in store.entries()} == {longer.id, third.id}
    assert not list(store.directory.glob(".*"))


def test_a_writer_killed_mid_save_leaves_no_snapshot(tmp_path):
    folder = tmp_path / "snapshots"
    spec = tmp_path / "write.json"
    task = {"snapshot_dir": str(folder), "n_bytes": 256 << 20, "kill_at": 64 << 20}
    spec.write_text(json.dumps(task))
    writer = subprocess.run(
        [sys.executable, str(CHILD), "write", str(spec)], stdout=subprocess.DEVNULL, timeout=300
    )
    assert writer.returncode == -signal.SIGKILL
    partial = list(folder.glob(f".*{SUFFIX}.*.tmp"))
    # Killed in the middle: the temp file is all there is.
    assert len(partial) == 1 and partial[0].stat().st_size > 0
    assert not list(folder.glob(f"*{SUFFIX}"))
    store = SnapshotStore(folder, 1 << 40)
    assert store.entries() == []
    lookup = store.find([1, 2, 3], "model", {"kv_type": "FP16"})
    assert lookup.snapshot is None and lookup.warnings == ()
    store.clear()
    assert not list(folder.iterdir())


def test_cache_command_lists_removes_and_clears(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))
    store = SnapshotStore(snapshot_dir(), 1 << 30)
    settings = {"attention": "sparse", "kv_type": "INT8"}
    first = store.save(
        _tiny_state(1.0, 1200), list(range(1200)), torch.zeros(4), "m", "Tiny", settings
    )
    store.save(_tiny_state(2.0), [5], torch.zeros(4), "m", "Tiny", settings)

    assert main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split() == ["ID", "TOKENS", "MODEL", "KV", "SIZE", "LAST", "USED"]
    row = next(line for line in lines if line.startswith(first.id))
    assert "1,200" in row and "Tiny" in row and "INT8" in row and "KiB" in row
    assert "2 snapshots" in lines[-1] and "(half of the disk space they could use;" in lines[-1]

    assert main(["cache", "rm", first.id[:6]]) == 0
    assert f"removed {first.id}" in capsys.readouterr().out
    assert main(["cache", "rm", first.id]) == 2
    assert f"no snapshot with an id starting with '{first.id}'" in capsys.readouterr().err
    assert main(["cache", "clear"]) == 0
    assert "removed 1 snapshot (" in capsys.readouterr().out
    assert main(["cache", "list"]) == 0
    assert "0 snapshots" in capsys.readouterr().out


def test_the_default_cap_is_half_the_disk_space_the_snapshots_could_use(tmp_path):
    store = SnapshotStore(tmp_path / "snapshots", None)  # the folder does not exist yet
    free = shutil.disk_usage(tmp_path).free
    assert abs(store.cap() - free // 2) < 64 << 20  # other writers move the free space a little
    saved = store.save(_tiny_state(1.0), [1], torch.zeros(4), "m", "m", {})
    # What the snapshots take counts as theirs: saving does not shrink their cap.
    assert abs(store.cap() - (saved.size_bytes + shutil.disk_usage(tmp_path).free) // 2) < 64 << 20
    assert "half of the disk space they could use" in store.describe_cap()
    assert SnapshotStore(tmp_path, cap_bytes(20.0)).cap() == 20 << 30
    assert cap_bytes(0.0) is None
