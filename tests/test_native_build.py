"""A build lock left by a killed kernel build is cleared; a live build's lock is not. A build
is named for its sources and the headers beside them."""

from __future__ import annotations

import os
import time

from kvchat.native import STALE_LOCK_S, build_name, clear_stale_lock


def test_a_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    lock = tmp_path / "lock"
    assert not clear_stale_lock(tmp_path)  # no lock: nothing to do

    lock.touch()
    assert not clear_stale_lock(tmp_path)  # a build in progress
    assert lock.exists()

    old = time.time() - STALE_LOCK_S - 5
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path)
    assert not lock.exists()


def test_a_header_beside_the_sources_names_a_new_build(tmp_path):
    source, header = tmp_path / "ops.cpp", tmp_path / "ops.h"
    source.write_text('#include "ops.h"\n')
    header.write_text("int f();\n")
    first = build_name("kvchat_test", [source])
    assert build_name("kvchat_test", [source]) == first
    header.write_text("int f(int);\n")
    assert build_name("kvchat_test", [source]) != first
