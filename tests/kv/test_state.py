"""Loading a saved cache state: what kv/state.py checks before it copies anything."""

from __future__ import annotations

import pytest
import torch

from kvchat.kv.state import CacheState, StateMismatchError


def test_a_state_of_another_shape_is_refused_before_anything_is_copied():
    dest = {"a": torch.zeros(4), "b": torch.zeros(3)}
    state = CacheState({}, {"a": torch.ones(4), "b": torch.ones(5)})
    with pytest.raises(StateMismatchError, match="'b' is float32\\[5\\]"):
        state.restore(dest)
    assert not dest["a"].any()
