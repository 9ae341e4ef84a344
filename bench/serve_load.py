"""`kvchat bench serve`: many clients at once against `kvchat serve` on loopback.

The server runs in a subprocess, as a user runs it. `clients` threads send a short chat
question each at the same moment, streamed; each records when it was answered, its first
token, the queue positions the stream reported, and its text. Then every question is asked
again, one at a time, and each concurrent answer must equal its one-at-a-time answer (greedy:
the queue must not change what a request gets). The server's RSS is sampled throughout and
set against the plan its statistics report.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import psutil

from kvchat.native.cpu import cpu_name
from kvchat.server.serve import SERVER_KEY_ENV

from .hostile_clients import Hostile, HostileRun, run_hostile
from .loopback_http import ServeBenchError, request, response_json

READY_TIMEOUT_S = 600  # a first start builds the C++ kernels


@dataclass
class ServerProcess:
    """`kvchat serve` in a subprocess; `url` is its /v1 base."""

    process: subprocess.Popen
    url: str

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_server(
    args: Sequence[str], stderr: IO[str], env: dict[str, str] | None = None
) -> ServerProcess:
    """`kvchat serve --port 0 ARGS` in a subprocess, once it accepts requests; its stderr goes
    to the file `stderr`, whose end a failed start quotes."""
    process = subprocess.Popen(
        [sys.executable, "-m", "kvchat.tui.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=stderr,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    ready = threading.Timer(READY_TIMEOUT_S, process.kill)
    ready.start()
    line = process.stdout.readline()  # the one line it prints, once it listens
    ready.cancel()
    if " on http" not in line:
        process.kill()
        process.wait()
        stderr.flush()
        said = Path(stderr.name).read_text(errors="replace").strip().splitlines()[-3:]
        raise ServeBenchError(
            f"kvchat serve did not start (exit {process.returncode}): {' / '.join(said)}"
        )
    return ServerProcess(process, line.split(" on ")[1].split()[0])


@dataclass
class ClientRun:
    """What one client saw."""

    question: str
    status: int = 0
    text: str = ""
    positions: list[int] = field(default_factory=list)
    seconds: float = 0.0
    first_token_s: float | None = None
    completion_tokens: int = 0
    error: str | None = None


def _stream_chat(url: str, question: str, max_tokens: int, start: threading.Event) -> ClientRun:
    run = ClientRun(question)
    body = {
        "model": "bench",
        "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start.wait()
    began = time.perf_counter()
    try:
        response = request(url, "/chat/completions", body)
        run.status = response.status
        pieces = []
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith(": queued, "):
                run.positions.append(int(line.split()[2]))
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                run.error = chunk["error"]["message"]
            for choice in chunk.get("choices", []):
                if text := choice["delta"].get("content"):
                    run.first_token_s = run.first_token_s or time.perf_counter() - began
                    pieces.append(text)
            if chunk.get("usage"):
                run.completion_tokens = chunk["usage"]["completion_tokens"]
        run.text = "".join(pieces)
    except OSError as e:
        run.error = str(e)
    run.seconds = time.perf_counter() - began
    return run


def _whole_chat(url: str, question: str, max_tokens: int) -> str:
    body = {"model": "bench", "messages": [{"role": "user", "content": question}]}
    reply = response_json(request(url, "/chat/completions", {**body, "max_tokens": max_tokens}))
    return reply["choices"][0]["message"]["content"]


def _at_once(
    url: str, questions: list[str], max_tokens: int, hostile: Sequence[Hostile]
) -> tuple[list[ClientRun], float, list[HostileRun]]:
    """Every question streamed at the same moment, and the `hostile` clients with them: what
    each saw, and the seconds until the last normal one was answered."""
    start = threading.Event()
    runs = [ClientRun(q) for q in questions]
    bad: list[HostileRun] = []

    def client(i: int) -> None:
        runs[i] = _stream_chat(url, questions[i], max_tokens, start)

    normal = [threading.Thread(target=client, args=(i,)) for i in range(len(questions))]
    others = [
        threading.Thread(target=lambda kind=kind: bad.append(run_hostile(kind, url, start)))
        for kind in hostile
    ]
    for thread in [*normal, *others]:
        thread.start()
    began = time.perf_counter()
    start.set()
    for thread in normal:
        thread.join()
    wall = time.perf_counter() - began
    for thread in others:
        thread.join()
    return runs, wall, sorted(bad, key=lambda run: list(Hostile).index(run.kind))


class _RssSampler(threading.Thread):
    def __init__(self, pid: int, interval: float = 0.02) -> None:
        super().__init__(daemon=True)
        self.process, self.interval = psutil.Process(pid), interval
        self.peak = 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.peak = max(self.peak, self.process.memory_info().rss)
            except psutil.Error:
                return
            time.sleep(self.interval)


def run_serve_bench(
    server_args: Sequence[str],
    clients: int,
    max_tokens: int,
    log: Callable[[str], None],
    hostile: bool = False,
) -> dict[str, Any]:
    """Start `kvchat serve SERVER_ARGS`, run `clients` concurrent streamed questions, then
    (`hostile`) the same ones again with a client of each hostile kind among them, then every
    question one at a time; the numbers, ready for JSON."""
    log(f"starting kvchat serve {' '.join(server_args)}")
    # The bench sends no key: a key in the environment would make the server ask for one.
    env = {k: v for k, v in os.environ.items() if k != SERVER_KEY_ENV}
    queue = clients + (len(Hostile) if hostile else 0)
    with tempfile.NamedTemporaryFile("w+", prefix="kvchat-serve-", suffix=".log") as err:
        server = start_server([*server_args, "--queue-size", str(queue)], err, env)
    try:
        sampler = _RssSampler(server.process.pid)
        sampler.start()
        questions = [f"What is {i} plus {i}? Answer with the number only." for i in range(clients)]
        log(f"{clients} clients ask at once")
        runs, wall, _ = _at_once(server.url, questions, max_tokens, ())
        log(f"answered in {wall:.2f} s")
        if hostile:
            log(f"again, with hostile clients among them: {', '.join(Hostile)}")
            beside, beside_wall, bad = _at_once(server.url, questions, max_tokens, list(Hostile))
            log(f"answered in {beside_wall:.2f} s")
        log("asking again one at a time")
        alone = [_whole_chat(server.url, q, max_tokens) for q in questions]
        stats = response_json(request(server.url, "/kvchat/stats"))
        sampler.done.set()
        sampler.join()
    finally:
        server.stop()
    result = {
        "benchmark": "serve",
        "clients": clients,
        "max_tokens": max_tokens,
        **_phase(runs, alone, wall),
        "peak_rss_bytes": sampler.peak,
        "plan": stats["plan"],
        "within_plan": sampler.peak <= stats["plan"]["max_seq_len_total_bytes"],
        "server": {k: stats["engine"][k] for k in ("model", "device", "dtype", "attention")},
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "ram_bytes": psutil.virtual_memory().total,
        },
    }
    if hostile:
        with_them = _phase(beside, alone, beside_wall)
        p50, p50_beside = result["latency_seconds"]["p50"], with_them["latency_seconds"]["p50"]
        result["hostile"] = {
            "clients": [dataclasses.asdict(run) for run in bad],
            "as_expected": sum(run.as_expected for run in bad),
            "normal": with_them,
            "p50_ratio": round(p50_beside / p50, 3) if p50 and p50_beside else None,
        }
    return result


def _phase(runs: list[ClientRun], alone: list[str], wall: float) -> dict[str, Any]:
    """What the clients of one concurrent round got, against their answers asked alone."""
    ok = [r for r in runs if r.status == 200 and r.error is None]
    latencies = sorted(r.seconds for r in ok)
    firsts = sorted(r.first_token_s for r in ok if r.first_token_s is not None)
    tokens = sum(r.completion_tokens for r in ok)

    def pct(values: list[float], q: float) -> float | None:
        return round(values[min(len(values) - 1, int(q * len(values)))], 3) if values else None

    return {
        "completed": len(ok),
        "failed": [
            {"question": r.question, "status": r.status, "error": r.error}
            for r in runs
            if r not in ok
        ],
        "equal_to_one_at_a_time": sum(r.text == a for r, a in zip(runs, alone, strict=True)),
        "unequal": [
            {"question": r.question, "at_once": r.text, "alone": a}
            for r, a in zip(runs, alone, strict=True)
            if r.text != a
        ],
        "queue_positions_reported": sum(bool(r.positions) for r in runs),
        "largest_position": max((max(r.positions) for r in runs if r.positions), default=None),
        "wall_seconds": round(wall, 3),
        "latency_seconds": {
            "p50": pct(latencies, 0.5),
            "p95": pct(latencies, 0.95),
            "max": pct(latencies, 1.0),
            "mean": round(statistics.fmean(latencies), 3) if latencies else None,
        },
        "first_token_seconds": {"p50": pct(firsts, 0.5), "max": pct(firsts, 1.0)},
        "completion_tokens": tokens,
        "completion_tok_s": round(tokens / wall, 2) if wall else None,
    }


def summary(result: dict[str, Any]) -> list[str]:
    """The result in a few lines, for the log."""
    lat = result["latency_seconds"]
    return [
        f"{result['completed']}/{result['clients']} answered, "
        f"{result['equal_to_one_at_a_time']} equal to their answer asked alone, "
        f"{result['queue_positions_reported']} saw their queue position "
        f"(largest {result['largest_position']})",
        f"latency p50 {lat['p50']} s, p95 {lat['p95']} s, max {lat['max']} s; "
        f"{result['completion_tok_s']} tok/s over {result['wall_seconds']} s",
        f"peak RSS {result['peak_rss_bytes'] / 2**30:.2f} GiB; plan "
        f"{result['plan']['max_seq_len_total_bytes'] / 2**30:.2f} GiB at max_seq_len "
        f"{result['plan']['max_seq_len']:,}",
        *_hostile_summary(result.get("hostile")),
    ]


def _hostile_summary(hostile: dict[str, Any] | None) -> list[str]:
    if hostile is None:
        return []
    normal, lat = hostile["normal"], hostile["normal"]["latency_seconds"]
    return [
        *(
            f"hostile {run['kind']}: {run['outcome']} after {run['seconds']} s "
            f"({'as expected' if run['as_expected'] else 'expected ' + run['expected']})"
            for run in hostile["clients"]
        ),
        f"beside them: {normal['completed']}/{normal['completed'] + len(normal['failed'])} "
        f"answered, {normal['equal_to_one_at_a_time']} equal alone, latency p50 {lat['p50']} s "
        f"({hostile['p50_ratio']}x), max {lat['max']} s",
    ]
