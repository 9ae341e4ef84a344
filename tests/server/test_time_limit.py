"""One request holds the single engine for at most the server's time limit. The engine is held
at a step (tests/step_gate.py) while the limit passes: a reply cut by it ends as "length" with
what it had, a prompt still prefilling gets 504, and the next request is served as usual."""

from __future__ import annotations

import queue
from collections.abc import Iterator

import pytest

from kvchat.config import GenerationSettings, load_settings
from kvchat.core.engine import Engine
from kvchat.core.steps import EngineStep
from kvchat.server.worker import Done, EngineWorker, Event, Failed, Job

from ..step_gate import StepGate

MAX_NEW = 200


@pytest.fixture(scope="module")
def engine() -> Engine:
    return Engine.load(load_settings(overrides=["long_context.max_seq_len=4096"]).settings)


@pytest.fixture
def gate(engine) -> Iterator[StepGate]:
    gate = StepGate()
    engine.on_step = gate
    yield gate
    gate.close()
    engine.on_step = None


def _submit(worker: EngineWorker, prompt: list[int]) -> tuple[Job, queue.Queue[Event]]:
    events: queue.Queue[Event] = queue.Queue()
    job = Job(prompt, GenerationSettings(temperature=0.0, max_new_tokens=MAX_NEW), (), events.put)
    worker.submit(job)
    return job, events


def _end(events: queue.Queue[Event]) -> Done | Failed:
    while not isinstance(event := events.get(timeout=600), Done | Failed):
        pass
    return event


def test_the_limit_stops_a_request_that_holds_the_engine(engine, gate):
    worker = EngineWorker(engine, max_waiting=1, time_limit_s=0.5)
    try:
        gate.arm(EngineStep.SAMPLED)  # the engine waits there until the limit has passed
        job, events = _submit(worker, engine.tokenizer.encode("1, 2, 3, 4, 5,"))
        assert job.timed_out.wait(timeout=600)  # only a hang ends this wait
        gate.close()
        end = _end(events)
    finally:
        worker.close()
    # Within the prefill (a slow machine) or at the first token: either way it stopped.
    if isinstance(end, Failed):
        assert end.status == 504 and worker.last["status"] == "timed out"
    else:
        assert end.finish_reason == "length" and end.completion_tokens < MAX_NEW


@pytest.fixture
def worker(engine) -> Iterator[EngineWorker]:
    """A worker whose limit never passes by itself: the tests call what its timer calls."""
    worker = EngineWorker(engine, max_waiting=1, time_limit_s=3600)
    yield worker
    worker.close()


def test_a_reply_past_the_limit_ends_as_length_with_what_it_had(engine, gate, worker):
    gate.arm(EngineStep.SAMPLED, nth=3)
    job, events = _submit(worker, engine.tokenizer.encode("1, 2, 3, 4, 5,"))
    assert gate.held.wait(timeout=600)
    job.time_out()  # what the limit's timer calls
    gate.close()
    done = _end(events)
    assert isinstance(done, Done) and done.finish_reason == "length"
    assert done.completion_tokens == 3 and worker.last["status"] == "length"


def test_a_prompt_past_the_limit_gets_504_and_the_next_is_served(engine, gate, worker):
    gate.arm(EngineStep.PREFILLED)  # the first of its chunks
    long_prompt = engine.tokenizer.encode("The keeper climbed the stairs. " * 400)
    job, events = _submit(worker, long_prompt)
    assert gate.held.wait(timeout=600)
    job.time_out()
    gate.close()
    failed = _end(events)
    assert isinstance(failed, Failed) and failed.status == 504
    assert "the prompt took past the server's limit of 3600 s a request" in failed.message
    assert worker.last["status"] == "timed out"
    _, events = _submit(worker, engine.tokenizer.encode("1, 2,"))
    assert isinstance(_end(events), Done)
