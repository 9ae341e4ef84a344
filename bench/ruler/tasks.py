"""RULER's thirteen tasks (Hsieh et al. 2024), generated here after its recipes.

Each task's generator follows RULER's own (its `synthetic.yaml` settings, templates, answer
prefixes and data) with kvchat's tokenizer: RULER's scripts are command-line programs tied to
its tokenizers and to nltk, so they are read, not run. What differs: sentences are split by a
rule instead of nltk's punkt, and a haystack longer than the essays continues with HotpotQA's
paragraphs instead of repeating.

A sample's input is cut in two where kvchat's chat cuts it: the `document` (RULER's input up
to the question: its instruction and context), then the `question` as the user's turn, and the
`answer_prefix` that RULER puts at the start of the reply.
"""

from __future__ import annotations

import math
import random
import re
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from . import data


class RulerTask(StrEnum):
    NIAH_SINGLE_1 = "niah_single_1"
    NIAH_SINGLE_2 = "niah_single_2"
    NIAH_SINGLE_3 = "niah_single_3"
    NIAH_MULTIKEY_1 = "niah_multikey_1"
    NIAH_MULTIKEY_2 = "niah_multikey_2"
    NIAH_MULTIKEY_3 = "niah_multikey_3"
    NIAH_MULTIVALUE = "niah_multivalue"
    NIAH_MULTIQUERY = "niah_multiquery"
    VT = "vt"
    CWE = "cwe"
    FWE = "fwe"
    QA_1 = "qa_1"
    QA_2 = "qa_2"


class Haystack(StrEnum):
    """What RULER hides needles in."""

    ESSAY = "essay"  # Paul Graham's essays (then HotpotQA's paragraphs)
    REPEAT = "repeat"  # one filler line, repeated
    NEEDLE = "needle"  # needles of other keys


class Kind(StrEnum):
    """What a needle's keys and values are; the value's also names them in the question."""

    WORDS = "words"
    NUMBERS = "numbers"
    UUIDS = "uuids"


class Metric(StrEnum):
    """RULER's scores of one answer against its references."""

    ALL = "string_match_all"  # the share of the references the answer holds
    PART = "string_match_part"  # 1 when the answer holds any reference


def score(metric: Metric, answer: str, references: tuple[str, ...]) -> float:
    """RULER's per-sample score in [0, 1]: references matched case-insensitively anywhere in
    the answer (after RULER's clean-up of control characters)."""
    text = re.sub(r"[\x00-\x1f]", "\n", answer.strip()).strip().lower()
    hits = [ref.lower() in text for ref in references]
    return sum(hits) / len(hits) if metric is Metric.ALL else float(any(hits))


@dataclass(frozen=True)
class Sample:
    document: str
    question: str
    answer_prefix: str
    references: tuple[str, ...]
    evidence: tuple[int, ...]  # offsets in the document of what the answer is read from


Build = Callable[[int, random.Random], Sample]  # (haystack units, rng) -> sample


@dataclass(frozen=True)
class Recipe:
    metric: Metric
    max_new_tokens: int
    build: Callable[[int], Build]  # the target length -> the task's builder


# --- needles -------------------------------------------------------------------------------

_NEEDLE = "One of the special magic {v} for {key} is: {value}."
_NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_DEPTHS = [round(100 * i / 39) for i in range(40)]  # RULER: np.linspace(0, 100, 40), rounded
_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


def _random_value(kind: Kind, rng: random.Random) -> str:
    if kind is Kind.NUMBERS:
        return str(rng.randint(1_000_000, 9_999_999))
    if kind is Kind.UUIDS:
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    return f"{rng.choice(data.words('adjective'))}-{rng.choice(data.words('noun'))}"


def _haystack_words(n: int) -> list[str]:
    """The essays' first `n` words; past their end, HotpotQA's paragraphs go on."""
    words = list(data.essay_words()[:n])
    if len(words) < n:
        for document in data.hotpotqa().documents:
            words += document.split()
            if len(words) >= n:
                break
    return words[:n]


def _niah(
    haystack: Haystack,
    key_kind: Kind,
    value_kind: Kind,
    keys: int = 1,
    values: int = 1,
    queries: int = 1,
) -> Callable[[int], Build]:
    keys = max(keys, queries)
    several = queries * values > 1
    v = value_kind.value if several else value_kind.value[:-1]  # "numbers" or "number"
    intro = (
        f"Some special magic {v} are hidden within the following text. Make sure to memorize "
        f"it. I will quiz you about the {v} afterwards."
        if several
        else f"A special magic {v} is hidden within the following text. Make sure to memorize "
        f"it. I will quiz you about the {v} afterwards."
    )

    def build(n: int, rng: random.Random) -> Sample:
        pairs: list[tuple[str, list[str]]] = []
        needles: list[str] = []
        for _ in range(keys):
            key = _random_value(key_kind, rng)
            own = [_random_value(value_kind, rng) for _ in range(values)]
            pairs.append((key, own))
            needles += [_NEEDLE.format(v=value_kind.value, key=key, value=value) for value in own]
        rng.shuffle(needles)
        asked = [pairs[i] for i in rng.sample(range(keys), queries)]  # before the haystack's draws
        if haystack is Haystack.ESSAY:
            sentences = _SENTENCE_END.split(" ".join(_haystack_words(n)).strip())
            at = sorted(int(len(sentences) * d / 100) for d in rng.sample(_DEPTHS, len(needles)))
            pieces = []
            for needle, start, end in zip(needles, [0, *at[:-1]], at, strict=True):
                pieces += [" ".join(sentences[start:end]), needle]
            context = " ".join(p for p in [*pieces, " ".join(sentences[at[-1] :])] if p)
        else:
            lines = (
                [_NOISE] * n
                if haystack is Haystack.REPEAT
                else [
                    _NEEDLE.format(
                        v=value_kind.value,
                        key=_random_value(key_kind, rng),
                        value=_random_value(value_kind, rng),
                    )
                    for _ in range(n)
                ]
            )
            for index, needle in zip(
                sorted(rng.sample(range(n + 1), len(needles)), reverse=True), needles, strict=True
            ):
                lines.insert(index, needle)
            context = "\n".join(lines)
        names = [key for key, _ in asked]
        query = ", ".join(names[:-1]) + ", and " + names[-1] if len(names) > 1 else names[0]
        answers = [value for _, own in asked for value in own]
        document = f"{intro}\n{context}"
        # Where each asked value begins: the answer copies it, so its block is the one to read.
        evidence = []
        for key, own in asked:
            for value in own:
                sentence = _NEEDLE.format(v=value_kind.value, key=key, value=value)
                evidence.append(document.index(sentence) + sentence.rindex(value))
        if several:
            question = (
                f"What are all the special magic {v} for {query} mentioned in the provided text?"
            )
            prefix = f"The special magic {v} for {query} mentioned in the provided text are"
        else:
            question = f"What is the special magic {v} for {query} mentioned in the provided text?"
            prefix = f"The special magic {v} for {query} mentioned in the provided text is"
        return Sample(document, question, prefix, tuple(answers), tuple(evidence))

    return lambda length: build


# --- variable tracking ---------------------------------------------------------------------

_VT_INTRO = "Memorize and track the chain(s) of variable assignment hidden in the following text."
_VT_HOPS = 4


def _vt_parts(n: int, rng: random.Random, letters: int) -> tuple[str, str, list[str], list[str]]:
    """RULER's one chain of `_VT_HOPS` hops in `n` noise lines: (context, the value, the
    chain's variables, the chain's statements)."""
    names: list[str] = []
    while len(names) < _VT_HOPS + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}"] + [
        f"VAR {names[j + 1]} = VAR {names[j]} " for j in range(_VT_HOPS)
    ]
    sentences = [_NOISE + "\n"] * n
    for offset, (at, statement) in enumerate(
        zip(sorted(rng.sample(range(n), len(chain))), chain, strict=True)
    ):
        sentences.insert(at + offset, statement)
    context = " ".join(sentences).replace(". \n", ".\n")
    return context, value, names, chain


def _vt_question(value: str) -> str:
    return f"Question: Find all variables that are assigned the value {value} in the text above."


def _vt_prefix(value: str) -> str:
    # "assgined" is RULER's own spelling.
    return (
        f"Answer: According to the chain(s) of variable assignment in the text above, "
        f"{_VT_HOPS + 1} variables are assgined the value {value}, they are: "
    )


def _vt(length: int) -> Build:
    def build(n: int, rng: random.Random) -> Sample:
        # RULER's one-shot example: a short chain of three-letter names in ~20 noise lines.
        shot, shot_value, shot_names, _ = _vt_parts(20, rng, letters=3)
        example = (
            f"{_VT_INTRO}\n\n{shot}\n{_vt_question(shot_value)} {_vt_prefix(shot_value)}"
            f"{' '.join(shot_names)}\n\n"
        )
        context, value, names, chain = _vt_parts(max(n, _VT_HOPS + 1), rng, letters=5)
        document = f"{example}{_VT_INTRO}\n\n{context}"
        start = len(example)
        evidence = tuple(document.index(statement, start) for statement in chain)
        return Sample(document, _vt_question(value), _vt_prefix(value), tuple(names), evidence)

    return build


# --- common and frequent words -------------------------------------------------------------

_CWE_INTRO = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often."
)
_CWE_QUESTION = "Question: What are the 10 most common words in the above list?"
_CWE_PREFIX = "Answer: The top 10 words that appear most often in the list are:"
_CWE_COMMON = 10


def _cwe_pool() -> list[str]:
    pool = sorted(set(data.words("noun") + data.words("adjective") + data.words("verb")))
    random.Random(42).shuffle(pool)  # RULER's order of the pool
    return pool


def _numbered(words: list[str]) -> str:
    return " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))


def _cwe_list(pool: list[str], n: int, common: int, rare: int, rng: random.Random):
    chosen = rng.sample(pool, min(n, len(pool)))
    top, rest = chosen[:_CWE_COMMON], chosen[_CWE_COMMON:]
    listed = top * common + rest * rare
    rng.shuffle(listed)
    return _numbered(listed), top


def _cwe(length: int) -> Build:
    pool = _cwe_pool()
    # RULER: 30 and 3 repeats from 4K tokens up, 6 and 1 below.
    common, rare, shot = (30, 3, (40, 10, 3)) if length >= 4096 else (6, 1, (20, 3, 1))

    def build(n: int, rng: random.Random) -> Sample:
        shot_list, shot_top = _cwe_list(pool, shot[0], shot[1], shot[2], rng)
        example = f"{_CWE_INTRO}\n{shot_list}\n{_CWE_QUESTION} {_CWE_PREFIX} {_numbered(shot_top)}"
        listed, top = _cwe_list(pool, max(n, _CWE_COMMON + 1), common, rare, rng)
        document = f"{example}\n{_CWE_INTRO}\n{listed}"
        return Sample(document, _CWE_QUESTION, _CWE_PREFIX, tuple(top), ())

    return build


_FWE_INTRO = (
    "Read the following coded text and track the frequency of each coded word. Find the three "
    "most frequently appeared coded words."
)
_FWE_QUESTION = (
    "Question: Do not provide any explanation. Please ignore the dots '....'. What are the "
    "three most frequently appeared words in the above coded text?"
)
_FWE_PREFIX = (
    "Answer: According to the coded text above, the three most frequently appeared words are:"
)
_FWE_ALPHA = 2.0
_FWE_ZETA = math.pi**2 / 6  # the Riemann zeta function at _FWE_ALPHA


def _fwe(length: int) -> Build:
    vocabulary_size = max(length // 50, 4)  # RULER: max_seq_length // 50

    def build(n: int, rng: random.Random) -> Sample:
        vocabulary: list[str] = []
        seen: set[str] = set()
        while len(vocabulary) < vocabulary_size:
            word = "".join(rng.choices(string.ascii_lowercase, k=6))
            if word not in seen:
                seen.add(word)
                vocabulary.append(word)
        vocabulary.sort()
        rng.shuffle(vocabulary)
        vocabulary[0] = "..."  # the most frequent "word" is noise
        counts = [int(n * k**-_FWE_ALPHA / _FWE_ZETA) for k in range(1, vocabulary_size + 1)]
        text = [word for word, count in zip(vocabulary, counts, strict=True) for _ in range(count)]
        rng.shuffle(text)
        document = f"{_FWE_INTRO} {' '.join(text)}"
        return Sample(document, _FWE_QUESTION, _FWE_PREFIX, tuple(vocabulary[1:4]), ())

    return build


# --- question answering --------------------------------------------------------------------

_QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not "
    "output any other words."
)


def _qa(qa_set: Callable[[], data.QaSet]) -> Callable[[int], Build]:
    def build(n: int, rng: random.Random) -> Sample:
        qas = qa_set()
        item = qas.questions[rng.randrange(len(qas.questions))]
        own = list(item.context)
        if n - len(own) > len(item.more):
            taken = set(own) | set(item.more)
            extra: list[int] = []
            while len(extra) < n - len(own) - len(item.more):
                index = rng.randrange(len(qas.documents))
                if index not in taken:
                    taken.add(index)
                    extra.append(index)
            chosen = own + list(item.more) + extra
        else:
            chosen = own + rng.sample(item.more, max(n - len(own), 0))
        rng.shuffle(chosen)
        parts = [f"Document {i + 1}:\n{qas.documents[d]}" for i, d in enumerate(chosen)]
        document = f"{_QA_INSTRUCTION}\n\nThe following are given documents.\n\n" + "\n\n".join(
            parts
        )
        evidence = []
        for gold in item.gold:
            start = document.index(parts[chosen.index(gold)])
            found = [document.find(a, start) for a in item.answers]
            inside = [f for f in found if 0 <= f < start + len(parts[chosen.index(gold)])]
            evidence.append(min(inside) if inside else start)
        question = f"{_QA_INSTRUCTION}\n\nQuestion: {item.query}"
        return Sample(document, question, "Answer:", item.answers, tuple(evidence))

    return lambda length: build


ESSAY, REPEAT, NEEDLE = Haystack.ESSAY, Haystack.REPEAT, Haystack.NEEDLE
WORDS, NUMBERS, UUIDS = Kind.WORDS, Kind.NUMBERS, Kind.UUIDS
RECIPES: dict[RulerTask, Recipe] = {
    RulerTask.NIAH_SINGLE_1: Recipe(Metric.ALL, 128, _niah(REPEAT, WORDS, NUMBERS)),
    RulerTask.NIAH_SINGLE_2: Recipe(Metric.ALL, 128, _niah(ESSAY, WORDS, NUMBERS)),
    RulerTask.NIAH_SINGLE_3: Recipe(Metric.ALL, 128, _niah(ESSAY, WORDS, UUIDS)),
    RulerTask.NIAH_MULTIKEY_1: Recipe(Metric.ALL, 128, _niah(ESSAY, WORDS, NUMBERS, keys=4)),
    RulerTask.NIAH_MULTIKEY_2: Recipe(Metric.ALL, 128, _niah(NEEDLE, WORDS, NUMBERS)),
    RulerTask.NIAH_MULTIKEY_3: Recipe(Metric.ALL, 128, _niah(NEEDLE, UUIDS, UUIDS)),
    RulerTask.NIAH_MULTIVALUE: Recipe(Metric.ALL, 128, _niah(ESSAY, WORDS, NUMBERS, values=4)),
    RulerTask.NIAH_MULTIQUERY: Recipe(Metric.ALL, 128, _niah(ESSAY, WORDS, NUMBERS, queries=4)),
    RulerTask.VT: Recipe(Metric.ALL, 30, _vt),
    RulerTask.CWE: Recipe(Metric.ALL, 120, _cwe),
    RulerTask.FWE: Recipe(Metric.ALL, 50, _fwe),
    RulerTask.QA_1: Recipe(Metric.PART, 32, _qa(data.squad)),
    RulerTask.QA_2: Recipe(Metric.PART, 32, _qa(data.hotpotqa)),
}


def smallest_sample(task: RulerTask, length: int, seed: str) -> Sample:
    """The task's sample for `seed` with a haystack of one unit: its question and answer
    prefix are those of every size (each recipe draws them before the haystack), so the
    prompt's length around the document can be measured before the document is sized."""
    return RECIPES[task].build(length)(1, random.Random(seed))


def make_sample(
    task: RulerTask, length: int, budget: int, count: Callable[[str], int], seed: str
) -> Sample:
    """The task's sample for `seed` whose document has the most haystack units that keep it
    within `budget` tokens (as RULER sizes its inputs); `length` is the whole input's target,
    which some recipes scale with."""
    build = RECIPES[task].build(length)

    def sample(n: int) -> Sample:
        return build(n, random.Random(seed))

    return sample(_fit(lambda n: count(sample(n).document), budget))


def _fit(tokens: Callable[[int], int], budget: int) -> int:
    """The largest unit count whose document stays within `budget` tokens, found by scaling
    from a small measurement (a handful of tokenizations, not one per unit)."""
    small = 8
    at_small = tokens(small)
    per_unit = max((tokens(2 * small) - at_small) / small, 1e-3)
    fixed = at_small - small * per_unit
    low, high = 1, None  # low fits (a document of one unit is the least there is)
    n = max(int((budget - fixed) / per_unit), 1)
    for _ in range(16):
        used = tokens(n)
        if used <= budget:
            low = max(low, n)
            if used >= budget * 0.995:
                return n
        else:
            high = n if high is None else min(high, n)
        guess = int(n * budget * 0.997 / max(used, 1))
        upper = high - 1 if high is not None else max(guess, low + 1)
        n = min(max(guess, low + 1), upper)
        if n <= low:
            return low
    return low
