"""Prose haystacks: the sources, and documents sized and probed with the real SmolLM2 tokenizer."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from kvchat.bench import prose
from kvchat.bench.prose import Haystack, Needle, ProseMissingError, load_prose
from kvchat.core.documents import DocumentError
from kvchat.core.model_files import resolve_model_path
from kvchat.core.tokenizer import Tokenizer, load_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    with pytest.MonkeyPatch.context() as mp:  # keep the tokenizer cache out of the user's home
        mp.setenv("KVCHAT_HOME", str(tmp_path_factory.mktemp("kvchat_home")))
        return load_tokenizer(resolve_model_path("smollm2-135m"))


@pytest.mark.parametrize("source", prose.SOURCES)
def test_sources_are_running_text(source: str) -> None:
    text = load_prose(source)
    assert text.name == source
    assert len(text.paragraphs) >= 250
    assert len(set(text.paragraphs)) == len(text.paragraphs)
    for paragraph in text.paragraphs:
        assert "\n" not in paragraph and len(paragraph.split()) >= 8
    assert text.sha256 == load_prose(source).sha256  # the same text every time


def test_python_docs_leave_out_code_and_headings() -> None:
    paragraphs = load_prose(prose.PYTHON_DOCS).paragraphs
    assert not any(p.startswith(("=", "*****")) or "::=" in p for p in paragraphs)


def test_a_users_file(tmp_path: Path) -> None:
    book = tmp_path / "book.txt"
    book.write_text(
        "Chapter one\n=========\n\nIt was a bright cold day in April, and the clocks were "
        "striking thirteen.\nThe hallway smelt of boiled cabbage.\n\n    indented code = 1\n\n"
        "Short line.\n"
    )
    text = load_prose(str(book))
    assert text.name == "book.txt"
    assert text.paragraphs == (
        "It was a bright cold day in April, and the clocks were striking thirteen. "
        "The hallway smelt of boiled cabbage.",
    )
    (tmp_path / "empty.txt").write_text("Too short.\n")
    with pytest.raises(DocumentError, match="no paragraph"):
        load_prose(str(tmp_path / "empty.txt"))
    with pytest.raises(DocumentError, match="no such file"):
        load_prose(str(tmp_path / "missing.txt"))


def test_missing_news_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prose, "_NEWS_PACKAGE", "kvchat_no_such_package")
    with pytest.raises(ProseMissingError, match="pip install --no-deps gensim==4.4.0"):
        load_prose(prose.NEWS)


@pytest.mark.parametrize("n_tokens", [2_000, 16_000, 120_000])
def test_size_and_depths(tok: Tokenizer, n_tokens: int) -> None:
    haystack = Haystack(load_prose(prose.NEWS), tok)
    needles = [
        Needle(f"One of the special magic numbers for key-{i} is: {i}000001.", d)
        for i, d in enumerate([0.0, 0.1, 0.5, 0.9, 1.0])
    ]
    doc = haystack.document(n_tokens, needles, random.Random(n_tokens))
    total = len(tok.encode_long(doc))
    # whole paragraphs: up to one article (a few hundred tokens) short; the count from the
    # paragraphs' own lengths is off by well under 1%
    assert n_tokens - 1_500 <= total <= n_tokens * 1.005
    for needle in needles:
        at = doc.index(needle.sentence)
        assert doc.count(needle.sentence) == 1
        assert at == 0 or doc[at - 1] in " \n"  # between sentences
        assert abs(len(tok.encode(doc[:at])) / total - needle.depth) <= 0.02
    # the same seed, the same document; another seed, another
    assert haystack.document(n_tokens, needles, random.Random(n_tokens)) == doc
    assert haystack.document(n_tokens, needles, random.Random(n_tokens + 1)) != doc


def test_bad_depth(tok: Tokenizer) -> None:
    haystack = Haystack(load_prose(prose.NEWS), tok)
    with pytest.raises(ValueError, match="depth"):
        haystack.document(1000, [Needle("A needle.", 1.5)], random.Random(0))
