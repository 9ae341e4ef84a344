"""This machine's prefill rate, measured once per model, compute path and cache shape and kept
in prefill-rates.json in the cache folder, for `kvchat plan PATH` to estimate a document's
prefill time without prefilling it.

The rate is a context's first chunks' (the second chunk timed, after the first has warmed the
kernels and the cache): the fastest part of a prefill, since every later chunk also attends to
more selected blocks and scores more anchors. An estimate from it is a lower bound.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import date
from pathlib import Path
from typing import TYPE_CHECKING

from kvchat.config.home import Place, create_private_file, folder_for, private_folder

from .conversation import Conversation

if TYPE_CHECKING:
    from .engine import Engine

RATES_FILE = "prefill-rates.json"


@dataclass(frozen=True)
class PrefillRate:
    tokens_per_s: float
    tokens: int  # how many tokens were timed
    measured: str  # the day, ISO format
    cached: bool = False  # read from the rates file rather than measured now

    def seconds(self, n_tokens: int) -> float:
        return n_tokens / self.tokens_per_s


def rates_path() -> Path:
    return folder_for(Place.CACHE) / RATES_FILE


def prefill_rate(engine: Engine, sample: Sequence[int]) -> PrefillRate:
    """The rate for `engine` as it is set: from the rates file, else measured on two chunks of
    `sample` (repeated when shorter) and recorded. Starts a new session on the engine."""
    key = _key(engine)
    rates = _read(rates_path())
    if isinstance(found := rates.get(key), dict):
        with contextlib.suppress(KeyError, TypeError, ValueError):
            tok_s, tokens = float(found["tokens_per_s"]), int(found["tokens"])
            if tok_s > 0 and tokens > 0:
                return PrefillRate(tok_s, tokens, str(found["measured"]), cached=True)
    rate = _measure(engine, sample)
    rates[key] = {k: v for k, v in asdict(rate).items() if k != "cached"}
    _write(rates_path(), rates)
    return rate


def _key(engine: Engine) -> str:
    """What the rate depends on: the model, how it computes, the cache's shape."""
    lc = engine.settings.long_context
    parts = [
        engine.model_id,
        engine.compute_summary(),
        *(str(v) for v in (lc.attention, lc.kv_type, lc.anchor_type, lc.chunk_size)),
        *(str(v) for v in (lc.block_size, lc.local_windows_len, lc.second_select_num)),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _measure(engine: Engine, sample: Sequence[int]) -> PrefillRate:
    chunk = engine.settings.long_context.chunk_size
    if not sample:
        raise ValueError("no tokens to measure the prefill rate on")
    ids = list(sample) * (-(-2 * chunk // len(sample)))
    session = engine.new_session(Conversation())
    session.extend(ids[:chunk])  # warms the kernels, the weights' pages and the cache
    started = time.perf_counter()
    session.extend(ids[chunk : 2 * chunk])
    seconds = time.perf_counter() - started
    engine.new_session()
    return PrefillRate(chunk / seconds, chunk, date.today().isoformat())


def _read(path: Path) -> dict[str, object]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # none yet, or unreadable: measured again and rewritten
    return data if isinstance(data, dict) else {}


def _write(path: Path, rates: dict[str, object]) -> None:
    private_folder(path.parent)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        create_private_file(tmp)
        tmp.write_text(json.dumps(rates, indent=1))
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a rate that cannot be kept is measured again next time
