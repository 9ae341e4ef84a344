"""The server's queue with the engine held at a step: one reply running, one waiting, the next
refused. The real routes and engine worker on a loopback port in this process, so the test
holds the engine between two tokens (tests/step_gate.py) instead of hoping that a long reply
is still running when the other requests arrive."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2 as httpx
import pytest

from kvchat.config import load_settings
from kvchat.core.engine import Engine
from kvchat.core.steps import EngineStep

from ..step_gate import StepGate
from .serving import post_a_body_that_stops, serving

BODY = {"model": "m", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 8, "stream": True}


@pytest.fixture
def held() -> Iterator[tuple[str, StepGate]]:
    """A server whose engine waits at the steps its gate is armed for; (its URL, the gate)."""
    engine = Engine.load(load_settings(overrides=["long_context.max_seq_len=4096"]).settings)
    gate = StepGate()
    engine.on_step = gate
    with serving(engine) as url:
        try:
            yield url, gate
        finally:
            gate.close()  # a held engine lets the server stop


def test_a_full_queue_is_refused_with_503_and_positions_are_reported(held) -> None:
    url, gate = held
    gate.arm(EngineStep.SAMPLED)  # the first reply's first token
    with httpx.Client(timeout=600) as a, httpx.Client(timeout=600) as b, httpx.Client() as c:
        with a.stream("POST", f"{url}/completions", json=BODY) as running:
            assert gate.held.wait(timeout=600)  # only a hang ends this wait
            with b.stream("POST", f"{url}/completions", json=BODY) as waiting:
                assert next(waiting.iter_lines()) == ": queued, 1 ahead"
                refused = c.post(f"{url}/completions", json={**BODY, "stream": False})
                assert refused.status_code == 503
                assert refused.json()["error"]["code"] == "queue_full"
                # Refused before its body is read: one that never comes is not waited for.
                assert post_a_body_that_stops(url).startswith("HTTP/1.1 503")
            gate.release()
            lines = list(running.iter_lines())
    data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]" and len(data) > 2
    # The waiting request left with its client; the server serves the next one.
    with httpx.Client(timeout=600) as d:
        again = d.post(f"{url}/completions", json={**BODY, "max_tokens": 2, "stream": False})
    assert again.status_code == 200 and again.json()["choices"][0]["text"]
