"""The passkey retrieval test (Mohtashami & Jaggi 2023, as used by InfLLM): a five-digit key
hidden at a chosen depth in repeated filler, sized to a target number of tokens."""

from __future__ import annotations

import random
import re

from kvchat.core.tokenizer import Tokenizer

# Asking for the number alone matters for small models: SmolLM2-135M answers "What is the pass
# key?" with a made-up definition of a pass key, and this phrasing with the number (measured
# 6/6 at 3K tokens, 0/6 without the second sentence).
PASSKEY_QUESTION = "What is the pass key? Answer with the number only."

_INTRO = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
_FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)


def _needle(passkey: int) -> str:
    return f"The pass key is {passkey}. Remember it. {passkey} is the pass key."


def random_passkey(rng: random.Random) -> int:
    return rng.randint(10_000, 99_999)


def make_passkey_document(tokenizer: Tokenizer, n_tokens: int, depth: float, passkey: int) -> str:
    """The intro, then filler sentences with the needle between two of them, so that about
    `depth` of the document's other tokens come before it (0: right after the intro, 1: at
    the end); `n_tokens` long, give or take one filler sentence.

    The filler is measured once per sentence and counted, not tokenized in a loop: sentences
    joined by spaces tokenize to the sum of their parts (each ends with '.', and ' The' starts
    a new pre-token), so this stays fast at 1M tokens.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be between 0 and 1, not {depth}")
    needle = _needle(passkey)
    intro_tokens = len(tokenizer.encode(_INTRO))
    needle_tokens = len(tokenizer.encode(" " + needle))
    if n_tokens < intro_tokens + needle_tokens:
        raise ValueError(
            f"a passkey document needs at least {intro_tokens + needle_tokens} tokens, "
            f"not {n_tokens}"
        )
    sentence_tokens = [len(tokenizer.encode(" " + s)) for s in _FILLER]
    rounds, left = divmod(n_tokens - intro_tokens - needle_tokens, sum(sentence_tokens))
    count = rounds * len(_FILLER)
    for tokens in sentence_tokens:  # part of one more round, while it fits
        if tokens > left:
            break
        left -= tokens
        count += 1
    per_sentence = sum(sentence_tokens) / len(_FILLER)
    before = round((depth * (n_tokens - needle_tokens) - intro_tokens) / per_sentence)
    sentences = [_FILLER[i % len(_FILLER)] for i in range(count)]
    sentences.insert(min(max(before, 0), count), needle)
    return " ".join([_INTRO, *sentences])


def answer_is_correct(answer: str, passkey: int) -> bool:
    """Whether `answer` states the key as a whole number (not inside a longer one)."""
    return re.search(rf"(?<!\d){passkey}(?!\d)", answer) is not None
