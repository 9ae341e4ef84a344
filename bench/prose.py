"""Natural English prose for needle-in-a-haystack documents, read offline.

Two sources come with an installation, and a user's own text can stand in for them:
- `news` (the default): the Lee corpus (Lee, Pincombe & Welsh 2005), 300 news articles of the
  Australian Broadcasting Corporation (~80K tokens) as gensim ships them for its tests
  (`pip install --no-deps gensim==4.4.0`; kvchat reads the file and never imports gensim).
  General-interest prose by journalists, like the essays RULER hides its needles in.
- `python-docs`: the prose of the Python language reference that every CPython carries
  (`pydoc_data.topics`, ~50K tokens, code and grammar left out). Nothing to install, but a
  hard haystack for RULER's needle: the text itself talks of "special" methods and attributes.
- any UTF-8 file (a book, a contract), cut at blank lines.

A haystack longer than its source cycles through the paragraphs, each pass in its own seeded
order, so that no two neighbouring paragraphs repeat a sequence.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.core.documents import DocumentError, read_document

from .installed import installed_file

if TYPE_CHECKING:
    from kvchat.core.tokenizer import Tokenizer

NEWS = "news"
PYTHON_DOCS = "python-docs"
SOURCES = (NEWS, PYTHON_DOCS)
_NEWS_PACKAGE = "gensim"
_NEWS_FILE = ("test", "test_data", "lee_background.cor")
_NEWS_INSTALL = "pip install --no-deps gensim==4.4.0"
_PARAGRAPH_BREAK = re.compile(r"\n\s*\n")
_UNDERLINE = re.compile(r"[*=~^\-]+")
_MIN_WORDS = 8
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")
_SEPARATOR = "\n\n"


@dataclass(frozen=True)
class Prose:
    """Paragraphs of one source, with what names it in a benchmark's JSON."""

    name: str
    paragraphs: tuple[str, ...]

    @property
    def sha256(self) -> str:
        return hashlib.sha256(_SEPARATOR.join(self.paragraphs).encode()).hexdigest()


class ProseMissingError(RuntimeError):
    """A prose source is not installed; the message says how to install it."""


def load_prose(source: str) -> Prose:
    """A named source (`SOURCES`) or the paragraphs of a text file at that path."""
    if source == NEWS:
        return news()
    if source == PYTHON_DOCS:
        return python_docs()
    return file_prose(source)


def news() -> Prose:
    """The Lee corpus's articles, one paragraph each, from gensim's installed test data."""
    path = installed_file(_NEWS_PACKAGE, *_NEWS_FILE)
    if path is None:
        raise ProseMissingError(
            f"the news haystack is gensim's copy of the Lee corpus: {_NEWS_INSTALL} "
            f"(or choose --haystack {PYTHON_DOCS}, or a text file)"
        )
    # One article per line.
    return Prose(NEWS, _paragraphs(path.read_text(encoding="utf-8").splitlines()))


def python_docs() -> Prose:
    """The prose paragraphs of the Python language reference shipped with this interpreter."""
    from pydoc_data.topics import topics

    return Prose(PYTHON_DOCS, _paragraphs(topics[name] for name in sorted(topics)))


def file_prose(path: str | Path) -> Prose:
    """The paragraphs of a UTF-8 text file (DocumentError for what is not text)."""
    document = read_document(path)
    paragraphs = _paragraphs([document.text])
    if not paragraphs:
        raise DocumentError(f"{document.path}: no paragraph of {_MIN_WORDS} words or more")
    return Prose(document.name, paragraphs)


def _paragraphs(texts: Iterable[str]) -> tuple[str, ...]:
    """Unique paragraphs of running text, each on one line: indented blocks (code, grammar),
    underlined headings and fragments under _MIN_WORDS words are dropped."""
    seen: dict[str, None] = {}
    for text in texts:
        for block in _PARAGRAPH_BREAK.split(text.replace("\r\n", "\n")):
            lines = [line for line in block.split("\n") if line.strip()]
            if not lines or any(line[:1].isspace() for line in lines):
                continue
            if _UNDERLINE.fullmatch(lines[-1].strip()):
                continue
            paragraph = " ".join(line.strip() for line in lines)
            if len(paragraph.split()) >= _MIN_WORDS:
                seen.setdefault(paragraph)
    return tuple(seen)


@dataclass(frozen=True)
class Needle:
    """A sentence to hide at `depth` (0: before the first paragraph, 1: after the last)."""

    sentence: str
    depth: float


class Haystack:
    """Documents of a given token length cut from one prose source, needles inserted."""

    def __init__(self, prose: Prose, tokenizer: Tokenizer) -> None:
        self.prose = prose
        self.tokenizer = tokenizer
        # Paragraphs are measured once; a document's length is the sum of its parts (plus
        # one token per separator), checked against the real count in the benchmark's JSON.
        self._tokens = [len(tokenizer.encode(p)) for p in prose.paragraphs]
        self._separator = len(tokenizer.encode(_SEPARATOR))

    def document(self, n_tokens: int, needles: list[Needle], rng: random.Random) -> str:
        """Up to about `n_tokens` tokens of prose (whole paragraphs, at least one) with every
        needle placed between two sentences, about `depth` of the way in."""
        if n_tokens < 1:
            raise ValueError(f"a document needs at least one token, not {n_tokens}")
        needle_tokens = sum(len(self.tokenizer.encode(" " + n.sentence)) for n in needles)
        budget = max(n_tokens - needle_tokens, 1)
        order = self._order(rng)
        chosen: list[int] = []
        ends: list[int] = []  # tokens up to the end of each chosen paragraph
        total = 0
        while True:  # whole paragraphs, as many as fit (at least one)
            index = next(order)
            grown = total + self._tokens[index] + (self._separator if chosen else 0)
            if chosen and grown > budget:
                break
            total = grown
            chosen.append(index)
            ends.append(total)
        paragraphs = [self.prose.paragraphs[i] for i in chosen]
        # Deepest first: an insertion never moves the places of the needles still to come.
        for needle in sorted(needles, key=lambda n: n.depth, reverse=True):
            if not 0.0 <= needle.depth <= 1.0:
                raise ValueError(f"depth must be between 0 and 1, not {needle.depth}")
            target = needle.depth * total
            at = next((i for i, end in enumerate(ends) if end >= target), len(ends) - 1)
            start = ends[at - 1] + self._separator if at else 0
            paragraphs[at] = self._insert(paragraphs[at], needle.sentence, target - start)
        return _SEPARATOR.join(paragraphs)

    def _insert(self, paragraph: str, sentence: str, offset: float) -> str:
        """`sentence` between the paragraph's sentences, at the boundary nearest `offset`
        tokens into it."""
        parts = _SENTENCE_END.split(paragraph)
        ends = [0]
        for part in parts:
            ends.append(ends[-1] + len(self.tokenizer.encode(" " + part)))
        cut = min(range(len(ends)), key=lambda i: abs(ends[i] - offset))
        return " ".join([*parts[:cut], sentence, *parts[cut:]])

    def _order(self, rng: random.Random) -> Iterator[int]:
        """Paragraph indices from a seeded start, each pass through the source shuffled."""
        n = len(self.prose.paragraphs)
        while True:
            indices = list(range(n))
            rng.shuffle(indices)
            yield from indices
