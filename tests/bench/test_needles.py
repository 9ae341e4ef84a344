"""RULER's needle tasks: keys, values, questions and scoring."""

from __future__ import annotations

import random
import re
import uuid

import pytest

from kvchat.bench.needles import Task, TaskSpec, ValueKind, found, make_problem


@pytest.mark.parametrize("kind", list(ValueKind))
@pytest.mark.parametrize("task", list(Task))
def test_problems(task: Task, kind: ValueKind) -> None:
    spec = TaskSpec(task, kind)
    problem = make_problem(spec, 0.3, random.Random(f"{task}{kind}"))
    noun = "numbers" if kind is ValueKind.NUMBER else "uuids"
    pattern = re.compile(rf"One of the special magic {noun} for ([a-z]+-[a-z]+) is: (\S+)\.")
    pairs = [pattern.fullmatch(n.sentence).groups() for n in problem.needles]  # type: ignore[union-attr]
    keys = {key for key, _ in pairs}
    assert problem.needles[0].depth == 0.3
    assert all(0.0 <= n.depth <= 1.0 for n in problem.needles)
    assert len({value for _, value in pairs}) == len(pairs)  # every value its own
    for _, value in pairs:
        if kind is ValueKind.NUMBER:
            assert re.fullmatch(r"[1-9]\d{6}", value)
        else:
            assert str(uuid.UUID(value)) == value
    expected = {
        Task.SINGLE: (1, 1, 1),
        Task.MULTIKEY: (4, 4, 1),
        Task.MULTIVALUE: (4, 1, 4),
        Task.MULTIQUERY: (4, 4, 4),
    }[task]
    assert (len(problem.needles), len(keys), len(problem.expected)) == expected
    # the asked needles state the expected values, and the question names their keys
    assert [s.split(" is: ")[1].rstrip(".") for s in problem.asked] == problem.expected
    for sentence in problem.asked:
        assert sentence.split(" for ")[1].split(" is:")[0] in problem.question
    if task is Task.MULTIKEY:  # the distractors' keys are not asked
        assert sum(key in problem.question for key in keys) == 1
    assert problem.question.startswith("What are all" if spec.asks_several else "What is the")
    # the same seed gives the same problem
    again = make_problem(spec, 0.3, random.Random(f"{task}{kind}"))
    assert again == problem


def test_room_for_the_answer() -> None:
    assert TaskSpec(Task.SINGLE).max_new_tokens < TaskSpec(Task.MULTIVALUE).max_new_tokens
    assert (
        TaskSpec(Task.SINGLE).max_new_tokens < TaskSpec(Task.SINGLE, ValueKind.UUID).max_new_tokens
    )


def test_found() -> None:
    assert found("The number is 1234567.", "1234567")
    assert not found("The number is 12345678.", "1234567")  # inside a longer number
    assert not found("The number is 123456.", "1234567")
    value = "1b4e28ba-2fa1-41d2-883f-0016d3cca427"
    assert found(f"It is {value.upper()}", value)
    assert not found("It is 1b4e28ba-2fa1", value)
