"""The engine thread: requests are served one at a time, in order, from a bounded queue.

One Engine and its one Session serve every request, so a request whose prompt starts with
tokens the cache holds (the same document, an earlier turn) prefills only the rest
(Session.sync; a matching snapshot on disk when the cache holds less). A job reports what
happens to it through `emit`, called on this thread: its place in the queue, prefill
progress, text, and the end. Setting its `cancel` event (the client went away) stops the
engine within a prefill chunk or a decoded token.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvchat.config import GenerationSettings
from kvchat.core.cancel import Cancelled
from kvchat.core.engine import Engine
from kvchat.core.errors import USER_ERRORS
from kvchat.core.turns import ReplyEnd

_log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Queued:
    ahead: int  # requests before this one, the running one included


@dataclass(frozen=True)
class Progress:
    processed: int  # prompt tokens prefilled so far
    total: int  # prompt tokens to prefill (those not cached)
    cached: int  # prompt tokens the cache already held


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Done:
    finish_reason: str  # "stop" (end of turn or a stop string) or "length"
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass(frozen=True)
class Failed:
    status: int
    message: str


Event = Queued | Progress | Text | Done | Failed


@dataclass(eq=False)
class Job:
    prompt: list[int]
    params: GenerationSettings
    stop: tuple[str, ...]
    emit: Callable[[Event], None]
    cancel: threading.Event = field(default_factory=threading.Event)
    timed_out: threading.Event = field(default_factory=threading.Event)

    def time_out(self) -> None:
        """Stop the engine on this job, as a cancel does, for running past the time limit."""
        self.timed_out.set()
        self.cancel.set()


class QueueFullError(Exception):
    pass


class StopScanner:
    """Text released as it is generated, holding back only what may begin a stop string: the
    text before the first stop string is all a client sees. Each push costs time linear in
    the text and the stop strings' lengths: at most the longest stop's length less one
    character is held, and the held text's longest end that begins a stop is found by
    Knuth-Morris-Pratt matching."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self._failures = [_failure(stop) for stop in stops]
        self.held = ""
        self.stopped = False

    def push(self, text: str) -> str:
        if not self.stops:
            return text
        self.held += text
        found = [i for i in (self.held.find(s) for s in self.stops) if i >= 0]
        if found:
            self.stopped = True
            out, self.held = self.held[: min(found)], ""
            return out
        pairs = zip(self.stops, self._failures, strict=True)
        keep = max(_begun(self.held, stop, failure) for stop, failure in pairs)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(out) :]
        return out

    def flush(self) -> str:
        out, self.held = self.held, ""
        return out


def _failure(stop: str) -> list[int]:
    """KMP's table: for each prefix stop[:i + 1], the length of its longest proper prefix that
    is also its end."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return table


def _begun(held: str, stop: str, failure: list[int]) -> int:
    """The length of the longest end of `held` that is a proper beginning of `stop` (which
    `held` does not contain): only its last len(stop) - 1 characters can be one."""
    k = 0
    for ch in held[max(len(held) - len(stop) + 1, 0) :]:
        while k and (k == len(stop) or stop[k] != ch):
            k = failure[k - 1]
        if stop[k] == ch:
            k += 1
    return k


class EngineWorker:
    """The thread that owns the engine. `submit` queues a job (QueueFullError past
    `max_waiting`); the thread runs jobs in order until `close`, each for at most
    `time_limit_s` from the start of its turn (None: no limit)."""

    def __init__(self, engine: Engine, max_waiting: int, time_limit_s: float | None = None) -> None:
        self.engine = engine
        # Every client shares the one cache: no request's length switches it back and forth.
        engine.session.keep_extrapolating = True
        self.max_waiting = max_waiting
        self.time_limit_s = time_limit_s
        self._waiting: deque[Job] = deque()
        self._running: Job | None = None
        self._lock = threading.Condition()
        self._closed = False
        self.served = 0
        self.last: dict[str, Any] | None = None  # how the last request ended, for the stats
        self._thread = threading.Thread(target=self._run, name="kvchat-engine", daemon=True)
        self._thread.start()

    def check_room(self) -> None:
        """QueueFullError when a job submitted now would be refused: a request is turned away
        with it before its body is read and its prompt tokenized."""
        with self._lock:
            self._check_room()

    def submit(self, job: Job) -> None:
        with self._lock:
            self._check_room()
            self._waiting.append(job)
            job.emit(Queued(len(self._waiting) - 1 + (self._running is not None)))
            self._lock.notify()

    def _check_room(self) -> None:
        if len(self._waiting) >= self.max_waiting:
            raise QueueFullError(
                f"the server is busy: {len(self._waiting)} requests are waiting "
                f"(at most {self.max_waiting}); try again shortly"
            )

    def queue_state(self) -> dict[str, int | bool]:
        with self._lock:
            return {
                "running": self._running is not None,
                "waiting": len(self._waiting),
                "max_waiting": self.max_waiting,
                "served": self.served,
            }

    def cancel_all(self) -> None:
        """Cancel the running and waiting requests: each reply ends with an error event."""
        with self._lock:
            for job in (*self._waiting, *filter(None, [self._running])):
                job.cancel.set()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for job in (*self._waiting, *filter(None, [self._running])):
                job.cancel.set()
            self._lock.notify()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._waiting and not self._closed:
                    self._lock.wait()
                if self._closed:
                    return
                job = self._running = self._waiting.popleft()
                for ahead, waiting in enumerate(self._waiting, 1):
                    waiting.emit(Queued(ahead))
            try:
                self._serve(job)
            finally:
                with self._lock:
                    self._running = None
                    self.served += 1

    def _serve(self, job: Job) -> None:
        started = time.monotonic()
        outcome: dict[str, Any] = {"prompt_tokens": len(job.prompt), "completion_tokens": 0}
        # The engine stops at its cancel event: the client's, or the time limit's. A reply cut
        # by the limit ends as "length"; a prompt still prefilling, with 504.
        timer = threading.Timer(self.time_limit_s or 0, job.time_out)
        if self.time_limit_s is not None:
            timer.start()
        try:
            end, outcome["status"] = self._end(job, outcome)
        finally:
            timer.cancel()
        outcome["seconds"] = round(time.monotonic() - started, 3)
        # Before the end is sent: a client that reads the statistics then sees its request.
        self.last = outcome
        job.emit(end)

    def _end(self, job: Job, outcome: dict[str, Any]) -> tuple[Done | Failed, str]:
        """How the job ends, and its status in the statistics."""
        try:
            if job.cancel.is_set():
                raise Cancelled("the client left before its turn")
            done = self._generate(job, outcome)
            return done, done.finish_reason
        except Cancelled:
            if job.timed_out.is_set():
                limit = f"{self.time_limit_s:g} s a request"
                return Failed(504, f"the prompt took past the server's limit of {limit}"), (
                    "timed out"
                )
            # Ends the reply of a client still there (the server is stopping); nobody reads
            # it after a disconnect.
            return Failed(503, "the request was cancelled: the server is stopping"), "cancelled"
        except USER_ERRORS as e:
            return Failed(400, str(e)), "refused"
        except Exception as e:  # the request fails; the server goes on serving
            _log.exception("request failed")
            return Failed(500, f"the engine failed: {type(e).__name__}: {e}"), "failed"

    def _generate(self, job: Job, outcome: dict[str, Any]) -> Done:
        session, params, ids = self.engine.session, job.params, job.prompt

        def progress(processed: int, total: int) -> None:
            job.emit(Progress(processed, total, len(ids) - total))

        scanner = StopScanner(job.stop)
        n = 0
        session.prefill_prompt(ids, params, progress, job.cancel)
        for _, text in session.stream_reply(params, job.cancel):
            n += 1
            outcome["completion_tokens"] = n
            if text := scanner.push(text):
                job.emit(Text(text))
            if scanner.stopped:
                break
        if job.cancel.is_set() and not job.timed_out.is_set():
            raise Cancelled("cancelled")
        if rest := scanner.flush():
            job.emit(Text(rest))
        ended = scanner.stopped or session.reply_end is ReplyEnd.END_OF_TURN
        cached = len(ids) - session.last_prefill.prefilled
        return Done("stop" if ended else "length", len(ids), n, cached)
