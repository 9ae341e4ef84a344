"""A build lock left by a killed kernel build is cleared; a live build's lock is not."""

from __future__ import annotations

import os
import time

from kvchat.native import STALE_LOCK_S, clear_stale_lock


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
