"""Needles in natural prose, after RULER's recipes (Hsieh et al. 2024).

A needle is the sentence "One of the special magic numbers for <key> is: <value>." with a
two-word key and a 7-digit number (or a UUID) as value. The tasks:
- single: one needle; the question asks for its value;
- multikey: the needle among `distractors` needles of other keys; only the asked key's counts;
- multivalue: one key with `values` needles (values) at spread depths; all must be returned;
- multiquery: `values` keys with one needle each; one question asks for all of them.
The cell's depth places the asked needle; the others take seeded depths of their own.
"""

from __future__ import annotations

import random
import re
import uuid
from dataclasses import dataclass
from enum import StrEnum

from .prose import Needle


class Task(StrEnum):
    SINGLE = "single"
    MULTIKEY = "multikey"
    MULTIVALUE = "multivalue"
    MULTIQUERY = "multiquery"


class ValueKind(StrEnum):
    NUMBER = "number"
    UUID = "uuid"


_ADJECTIVES = (
    "amber", "ancient", "bitter", "brave", "bright", "calm", "clever", "crimson", "curious",
    "daring", "dusty", "eager", "elegant", "fancy", "fierce", "gentle", "giant", "golden",
    "hollow", "humble", "icy", "jolly", "lively", "lucky", "misty", "modern", "noble", "odd",
    "pale", "polite", "quiet", "rapid", "rusty", "silent", "silver", "sleepy", "steady",
    "tender", "vivid", "wild",
)  # fmt: skip
_NOUNS = (
    "anchor", "apple", "badger", "barrel", "beacon", "bridge", "candle", "canyon", "castle",
    "cedar", "comet", "desert", "falcon", "feather", "garden", "glacier", "harbor", "helmet",
    "island", "jacket", "kettle", "lantern", "meadow", "mirror", "needle", "orchard", "parrot",
    "pebble", "pillow", "quarry", "river", "saddle", "spider", "temple", "thunder", "tunnel",
    "violin", "walnut", "willow", "zephyr",
)  # fmt: skip


@dataclass(frozen=True)
class TaskSpec:
    task: Task
    kind: ValueKind = ValueKind.NUMBER
    distractors: int = 3  # multikey: needles with other keys
    values: int = 4  # multivalue: values of the one key; multiquery: keys asked

    @property
    def max_new_tokens(self) -> int:
        """Room for the answer's lead-in and every value asked for."""
        per_value = 32 if self.kind is ValueKind.UUID else 12
        return 24 + per_value * (self.values if self.asks_several else 1)

    @property
    def asks_several(self) -> bool:
        return self.task in (Task.MULTIVALUE, Task.MULTIQUERY)


@dataclass(frozen=True)
class Problem:
    """One cell's needles and question; `expected` are the values the answer must hold, and
    `asked` the needle sentences that state them."""

    needles: list[Needle]
    question: str
    expected: list[str]
    asked: list[str]

    def value_offsets(self, document: str) -> list[int]:
        """Where each expected value begins in `document`, inside the sentence that states it.
        A block boundary may split a sentence; the answer copies the value, so its block is
        the one the model must read."""
        return [
            document.index(sentence) + sentence.rindex(value)
            for sentence, value in zip(self.asked, self.expected, strict=True)
        ]


def needle_sentence(key: str, value: str, kind: ValueKind) -> str:
    noun = "numbers" if kind is ValueKind.NUMBER else "uuids"
    return f"One of the special magic {noun} for {key} is: {value}."


def make_problem(spec: TaskSpec, depth: float, rng: random.Random) -> Problem:
    """The needles and question of one cell, all drawn from `rng`."""
    noun = "number" if spec.kind is ValueKind.NUMBER else "uuid"
    n_keys = {
        Task.SINGLE: 1,
        Task.MULTIKEY: 1 + spec.distractors,
        Task.MULTIVALUE: 1,
        Task.MULTIQUERY: spec.values,
    }[spec.task]
    keys = _keys(n_keys, rng)
    per_key = spec.values if spec.task is Task.MULTIVALUE else 1
    values = _values(len(keys) * per_key, spec.kind, rng)
    pairs = [(key, values[i * per_key + j]) for i, key in enumerate(keys) for j in range(per_key)]
    # The first needle, the one asked for, sits at the cell's depth; the others spread.
    depths = [depth] + [rng.random() for _ in pairs[1:]]
    needles = [
        Needle(needle_sentence(key, value, spec.kind), d)
        for (key, value), d in zip(pairs, depths, strict=True)
    ]
    if spec.task is Task.MULTIKEY:
        asked, expected, stating = [keys[0]], [pairs[0][1]], needles[:1]
    else:
        asked, expected, stating = keys, [value for _, value in pairs], needles
    if spec.asks_several:
        names = asked[0] if len(asked) == 1 else ", ".join(asked[:-1]) + f" and {asked[-1]}"
        question = (
            f"What are all the special magic {noun}s for {names} mentioned in the provided text?"
        )
    else:
        question = (
            f"What is the special magic {noun} for {asked[0]} mentioned in the provided text?"
        )
    return Problem(needles, question, expected, [n.sentence for n in stating])


def found(answer: str, value: str) -> bool:
    """Whether the answer states `value` whole (a number not inside a longer one)."""
    if value.isdigit():
        return re.search(rf"(?<!\d){value}(?!\d)", answer) is not None
    return value.lower() in answer.lower()


def _keys(n: int, rng: random.Random) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        key = f"{rng.choice(_ADJECTIVES)}-{rng.choice(_NOUNS)}"
        if key not in keys:
            keys.append(key)
    return keys


def _values(n: int, kind: ValueKind, rng: random.Random) -> list[str]:
    values: list[str] = []
    while len(values) < n:
        if kind is ValueKind.NUMBER:
            value = str(rng.randint(1_000_000, 9_999_999))
        else:
            value = str(uuid.UUID(int=rng.getrandbits(128), version=4))
        if value not in values:
            values.append(value)
    return values
