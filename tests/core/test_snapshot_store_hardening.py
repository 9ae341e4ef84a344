"""The snapshot store against damaged, hostile and unreadable files: headers mutated at random
(with their checksum made right, so the damage reaches the parser) never break a listing, a
lookup or a clear, and never cost the good snapshot next to them; a snapshot that cannot be
read is skipped and kept; one that cannot be deleted is reported; every file is private.
"""

from __future__ import annotations

import copy
import errno
import json
import logging
import os
import random
import stat
import zlib
from pathlib import Path

import pytest
import torch

from kvchat.core import snapshot
from kvchat.core.snapshot import (
    _PREAMBLE,
    FORMAT_VERSION,
    MAGIC,
    SUFFIX,
    SnapshotError,
    SnapshotInfo,
    SnapshotStore,
    snapshot_dir,
)
from kvchat.kv.state import CacheState
from kvchat.tui.cli import main

SETTINGS = {"attention": "sparse", "kv_type": "INT8"}
GOOD = [1, 2, 3]
FUZZED = [7, 8, 9]
DEEP = "\0deep"  # stands for JSON nested far deeper than Python's recursion limit
HOSTILE = [
    None,
    True,
    -1,
    -(2**63),
    2**64 + 7,
    10**30,
    1.5,
    float("inf"),
    float("nan"),
    "x",
    "",
    [],
    {},
    [2**62, 2**62, 2**62],
    {"id": 3},
    [[[[1]]]],
    DEEP,
]


def save(store: SnapshotStore, tokens: list[int], value: float = 1.0) -> SnapshotInfo:
    state = CacheState({"length": len(tokens)}, {"0.k": torch.full((2, 3, 4), value)})
    return store.save(state, tokens, torch.arange(8.0), "m", "Tiny", SETTINGS)


def split(path: Path) -> tuple[dict, bytes]:
    """The header of a snapshot file and everything after the preamble and header."""
    data = path.read_bytes()
    _, _, _, length = _PREAMBLE.unpack_from(data)
    return json.loads(data[_PREAMBLE.size : _PREAMBLE.size + length]), data


def build(header: dict, original: bytes) -> bytes:
    """A file with `header` (checksum right) and the original sections where they were when
    the header still fits before them, else right after it."""
    encoded = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    encoded = encoded.replace(json.dumps(DEEP).encode(), b"[" * 50_000 + b"]" * 50_000)
    _, _, _, length = _PREAMBLE.unpack_from(original)
    start = -(-(_PREAMBLE.size + length) // 64) * 64
    head = _PREAMBLE.pack(MAGIC, FORMAT_VERSION, zlib.crc32(encoded), len(encoded)) + encoded
    return head + b"\0" * max(start - len(head), 0) + original[start:]


def places(value: object) -> list[tuple[dict | list, object]]:
    """Every (container, key) in a header, nested ones included."""
    found: list[tuple[dict | list, object]] = []
    keys = value.keys() if isinstance(value, dict) else range(len(value))
    for key in keys:
        found.append((value, key))
        if isinstance(value[key], dict | list):
            found += places(value[key])
    return found


def mutate(header: dict, rng: random.Random) -> dict:
    header = copy.deepcopy(header)
    for _ in range(rng.randint(1, 3)):
        container, key = rng.choice(places(header))
        kind = rng.choice(["set", "set", "int", "delete", "wrap", "overflow"])
        old = container[key]
        if kind == "set":
            container[key] = copy.deepcopy(rng.choice(HOSTILE))
        elif kind == "int" and isinstance(old, int):
            container[key] = rng.choice([-1, 0, old + 1, old - 1, old * 2**40, 2**64])
        elif kind == "delete" and isinstance(container, dict):
            del container[key]
        elif kind == "wrap":
            container[key] = [old]
        elif kind == "overflow":  # a product that wraps to 0 in 64 bits matches 0 bytes
            sections = header.get("sections")
            if isinstance(sections, list) and sections and isinstance(sections[-1], dict):
                sections[-1].update(shape=[2**32, 2**32, 2**32], nbytes=0)
    return header


def fuzzed_files(template: Path, count: int) -> list[bytes]:
    header, original = split(template)
    files = [build(mutate(header, random.Random(seed)), original) for seed in range(count)]
    # Header lengths beyond what a file holds, and one (sparse) file that does hold it.
    for length in (2**40, 2**64 - 1, (64 << 20) + 1):
        files.append(_PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, length) + original[_PREAMBLE.size :])
    return files


def write(path: Path, data: bytes) -> None:
    path.write_bytes(data)
    _, _, _, length = _PREAMBLE.unpack_from(data)
    if length == (64 << 20) + 1:
        os.truncate(path, _PREAMBLE.size + length + 64)


def test_fuzzed_headers_never_break_the_store_nor_cost_the_good_snapshot(tmp_path, monkeypatch):
    store = SnapshotStore(tmp_path / "snaps", 1 << 30)
    good = save(store, GOOD)
    template = save(SnapshotStore(tmp_path / "template", 1 << 30), FUZZED, 2.0)
    files = fuzzed_files(template.path, 300)
    for i, data in enumerate(files):
        path = store.directory / f"fuzz{i:04d}{SUFFIX}"
        write(path, data)
        listed = {info.id: info for info in store.entries()}
        assert listed[good.id].problem is None
        fuzzed = listed[path.name.removesuffix(SUFFIX)]
        assert isinstance(fuzzed.tokens, int) and isinstance(fuzzed.kv_type, str)
        store.find(FUZZED + [10], "m", SETTINGS)
        found = store.find(GOOD + [4], "m", SETTINGS).snapshot
        assert found is not None and found.info.id == good.id and found.tokens == GOOD
        path.unlink(missing_ok=True)
    assert good.path.exists()
    # A header beyond 64 MiB is refused before it is read.
    write(tmp_path / f"big{SUFFIX}", files[-1])
    [info] = SnapshotStore(tmp_path, 1 << 30).entries()
    assert info.damaged and "more than 67,108,864" in (info.problem or "")

    # All of them at once, through `kvchat cache list` and `kvchat cache clear`.
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    snapshot_dir().mkdir(parents=True)
    for i, data in enumerate(files):
        write(snapshot_dir() / f"fuzz{i:04d}{SUFFIX}", data)
    assert main(["cache", "list"]) == 0
    assert main(["cache", "clear"]) == 0
    assert not list(snapshot_dir().iterdir())


def deny(monkeypatch, path: Path, err: int) -> None:
    """Make opening `path` fail with `err`, as the OS does for a file mode 000 to anyone but
    root (chmod, below) or for a disk that fails a read (EIO, which no test can cause)."""
    real_open = Path.open

    def guarded_open(self: Path, *args, **kwargs):
        if self == path:
            raise OSError(err, os.strerror(err), str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", guarded_open)


@pytest.mark.parametrize("err", [errno.EACCES, errno.EIO], ids=["EACCES", "EIO"])
def test_a_snapshot_that_cannot_be_read_is_skipped_and_kept(tmp_path, monkeypatch, caplog, err):
    store = SnapshotStore(tmp_path, 1 << 30)
    info = save(store, GOOD)
    if err == errno.EACCES:
        info.path.chmod(0)
    if err == errno.EIO or os.geteuid() == 0:  # root reads a file whatever its mode
        deny(monkeypatch, info.path, err)
    with caplog.at_level(logging.WARNING, logger="kvchat.core.snapshot"):
        [listed] = store.entries()
        lookup = store.find(GOOD, "m", SETTINGS)
    assert listed.problem and "cannot be read" in listed.problem and not listed.damaged
    assert lookup.snapshot is None and info.path.exists()
    assert f"snapshot {info.id} cannot be read" in caplog.text

    monkeypatch.undo()
    info.path.chmod(0o600)
    found = store.find(GOOD, "m", SETTINGS).snapshot
    assert found is not None and found.tokens == GOOD


def test_a_snapshot_that_cannot_be_deleted_is_reported_not_raised(tmp_path, monkeypatch):
    store = SnapshotStore(tmp_path / "snaps", 1 << 30)
    info = save(store, GOOD)
    data = bytearray(info.path.read_bytes())
    data[40] ^= 0x40  # inside the header: it fails its checksum
    info.path.write_bytes(bytes(data))
    if os.geteuid() == 0:  # root deletes in a read-only folder: fail as the OS would
        real_unlink = Path.unlink

        def read_only_unlink(self: Path, missing_ok: bool = False) -> None:
            if self.parent == store.directory:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
            real_unlink(self, missing_ok)

        monkeypatch.setattr(Path, "unlink", read_only_unlink)
    store.directory.chmod(0o500)
    try:
        [warning] = store.find(GOOD, "m", SETTINGS).warnings
        assert f"snapshot {info.id} is damaged" in warning and "cannot delete it" in warning
        assert store.clear() == []
        with pytest.raises(SnapshotError, match=f"cannot delete snapshot {info.id}"):
            store.remove(info.id)
        assert info.path.exists()
    finally:
        store.directory.chmod(0o700)


def test_a_token_count_that_disagrees_with_the_cache_makes_the_snapshot_unusable(tmp_path):
    store = SnapshotStore(tmp_path, 1 << 30)
    state = CacheState({"length": 5}, {"0.k": torch.ones(4)})
    info = store.save(state, GOOD, torch.zeros(8), "m", "Tiny", SETTINGS)
    assert info.damaged and "3 tokens in a cache of length 5" in (info.problem or "")
    assert store.find(GOOD, "m", SETTINGS).snapshot is None


def test_the_key_holds_the_format_and_cache_algorithm_versions(tmp_path, monkeypatch):
    store = SnapshotStore(tmp_path, 1 << 30)
    first = save(store, GOOD)
    monkeypatch.setattr(snapshot, "CACHE_ALGORITHM_VERSION", snapshot.CACHE_ALGORITHM_VERSION + 1)
    lookup = store.find(GOOD, "m", SETTINGS)
    assert lookup.snapshot is None and first.path.exists()  # another version's: kept, unused
    [listed] = store.entries()
    assert "cache algorithm 1 (another kvchat version" in (listed.problem or "")
    second = save(store, GOOD)
    assert second.id != first.id and second.problem is None
    monkeypatch.setattr(snapshot, "FORMAT_VERSION", snapshot.FORMAT_VERSION + 1)
    third = save(store, GOOD)
    assert len({first.id, second.id, third.id}) == 3


@pytest.mark.parametrize("umask", [0o022, 0o000], ids=["umask022", "umask000"])
def test_snapshot_files_are_private_whatever_the_umask(tmp_path, monkeypatch, umask):
    modes: dict[str, int] = {}
    real_replace = os.replace

    def replace(src, dst) -> None:  # the temporary file's mode, just before it is renamed
        modes[Path(src).name] = stat.S_IMODE(os.stat(src).st_mode)
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    store = SnapshotStore(tmp_path / "home" / "snapshots", 1 << 30)
    old = os.umask(umask)
    try:
        save(store, GOOD)
    finally:
        os.umask(old)
    [(tmp_name, tmp_mode)] = modes.items()
    assert tmp_name.endswith(".tmp") and tmp_mode == 0o600
    paths = [store.directory, *store.directory.rglob("*")]
    assert len(paths) == 2
    for path in paths:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
