"""What the app shows of an engine on a server: the throughput measured here, and the
engine's own statistics where the server reports them (kvchat serve's GET /v1/kvchat/stats)."""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass
from typing import Any, TypeVar

from kvchat.config import AttentionMode, PositionMode
from kvchat.core.engine import EngineStats, Rates
from kvchat.core.memory import GpuMemory
from kvchat.core.terminal_text import terminal_safe
from kvchat.kv.backend import CacheStats, LayerStats

from .http import OpenAIServer, ServerError

STATS_PATH = "/kvchat/stats"
T = TypeVar("T")


@dataclass(frozen=True)
class ServerStats(Rates):
    """`engine` is None for a server that does not report its engine: the panels say so."""

    url: str
    model: str
    context_tokens: int | None  # the last reply's prompt and reply (None: no usage reported)
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    time_to_first_token: float | None
    engine: EngineStats | None = None


def reported(stats: EngineStats | ServerStats) -> EngineStats | None:
    """The engine's own statistics: this process's, or what a server reports (None: nothing)."""
    return stats.engine if isinstance(stats, ServerStats) else stats


def engine_stats_from_json(body: dict[str, Any]) -> EngineStats:
    """EngineStats from kvchat serve's JSON (dataclasses.asdict of it); fields a newer server
    adds are left out, a missing one or one of the wrong type is a ValueError, and text is
    made terminal-safe: the panels show it."""
    cache = dict(body["cache"])
    cache["layers"] = tuple(
        _build(LayerStats, {**layer, "selected": _ints(layer["selected"])})
        for layer in cache.get("layers", ())
    )
    cache["position_mode"] = PositionMode(cache["position_mode"])
    gpu = body.get("gpu")
    fields = {
        **body,
        "attention": AttentionMode(body["attention"]),
        "position_mode": PositionMode(body["position_mode"]),
        "cache": _build(CacheStats, cache),
        "gpu": None if gpu is None else _build(GpuMemory, gpu),
    }
    return _build(EngineStats, fields)


def _build(cls: type[T], values: dict[str, Any]) -> T:
    fields = {f.name: f.type for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    try:
        return cls(**{k: _checked(fields[k], k, v) for k, v in values.items() if k in fields})
    except TypeError as e:
        raise ValueError(f"{cls.__name__}: {e}") from None


def _checked(kind: Any, name: str, value: Any) -> Any:
    """`value` as the field `name` of type `kind` (its annotation's text) holds it: numbers and
    booleans of their own type, text terminal-safe, None where the field allows it; the
    nested values are built by the caller."""
    if value is None and str(kind).endswith("| None"):
        return None
    kind = str(kind).removesuffix(" | None")
    if kind == "int" and (not isinstance(value, int) or isinstance(value, bool)):
        raise ValueError(f"{name}: {type(value).__name__} where an integer belongs")
    if kind == "float":
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise ValueError(f"{name}: {type(value).__name__} where a number belongs")
        return float(value)
    if kind == "bool" and not isinstance(value, bool):
        raise ValueError(f"{name}: {type(value).__name__} where true or false belongs")
    if kind == "str":
        if not isinstance(value, str):
            raise ValueError(f"{name}: {type(value).__name__} where text belongs")
        return terminal_safe(value)
    return value


def _ints(values: Any) -> tuple[int, ...]:
    if not isinstance(values, list):
        raise ValueError("selected: not a list of integers")
    return tuple(_checked("int", "selected", v) for v in values)


class StatsPoller:
    """The server's latest engine statistics, fetched in the background at most every
    `interval` seconds when asked for, so the UI thread never waits on the network."""

    def __init__(self, server: OpenAIServer, interval: float) -> None:
        self.server, self.interval = server, interval
        self.latest: EngineStats | None = None
        self._fetching = False
        self._last = float("-inf")
        self._lock = threading.Lock()

    def poke(self) -> EngineStats | None:
        """The latest statistics; a fetch starts when they are older than the interval."""
        with self._lock:
            due = not self._fetching and time.monotonic() - self._last >= self.interval
            if due:
                self._fetching = True
        if due:
            threading.Thread(target=self._fetch, daemon=True).start()
        return self.latest

    def fetch(self) -> EngineStats:
        """The statistics now (ServerError when the server does not report them)."""
        body = self.server.get(STATS_PATH)
        try:
            return engine_stats_from_json(body["engine"])
        except (KeyError, TypeError, ValueError) as e:
            url = f"{self.server.url}{STATS_PATH}"
            raise ServerError(f"{url}: unreadable statistics ({e})") from None

    def _fetch(self) -> None:
        try:
            self.latest = self.fetch()
        except ServerError:
            pass  # the last statistics stay; the next poke tries again
        finally:
            with self._lock:
                self._fetching, self._last = False, time.monotonic()
