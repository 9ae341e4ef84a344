"""`kvchat bench tokenize`: how fast a long document is tokenized (Tokenizer.encode_long)."""

from __future__ import annotations

import random
import time
from importlib import resources

from kvchat.core.tokenizer import Tokenizer


def tokenize_benchmark(tokenizer: Tokenizer, n_tokens: int) -> dict[str, float | int]:
    """Time encode_long on about `n_tokens` tokens of prose; only the encoding is timed."""
    text = _benchmark_text(tokenizer, n_tokens)
    started = time.perf_counter()
    tokens = len(tokenizer.encode_long(text))
    seconds = time.perf_counter() - started
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds if seconds else 0.0,
        "chars": len(text),
    }


def _benchmark_text(tokenizer: Tokenizer, n_tokens: int) -> str:
    """The bundled sample's paragraphs in a seeded random order, each under a numbered
    heading, so the text does not repeat one block verbatim (which would flatter the
    tokenizer's word cache less realistically than prose does)."""
    sample = resources.files("kvchat.core").joinpath("data", "sample.txt").read_text("utf-8")
    paragraphs = [p for p in sample.split("\n\n") if p.strip()]
    # Measured with a typical heading and the blank lines that join parts.
    sizes = [len(tokenizer.encode(f"Section 1000.\n\n{p}\n\n")) for p in paragraphs]
    rng = random.Random(0)
    parts: list[str] = []
    total = 0
    while total < n_tokens:
        i = rng.randrange(len(paragraphs))
        parts.append(f"Section {len(parts) + 1}.\n\n{paragraphs[i]}")
        total += sizes[i]
    return "\n\n".join(parts)
