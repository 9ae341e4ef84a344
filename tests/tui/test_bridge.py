"""The worker-side helpers: batching, throttling and the step wrapper (no model needed)."""

from __future__ import annotations

import threading

from textual.message import Message

from kvchat.core.cancel import Cancelled
from kvchat.core.documents import DocumentError
from kvchat.tui import bridge
from kvchat.tui.commands import Command, UnknownCommand, parse_command
from kvchat.tui.messages import Progress, ReplyPiece, StepFinished


def test_token_batcher_posts_at_most_every_interval_and_flushes_the_rest() -> None:
    posted: list[Message] = []
    batcher = bridge.TokenBatcher(posted.append, interval=10.0)
    for piece in ["a", "b", "c"]:
        batcher.add(piece)
    assert posted == []
    batcher.flush()
    assert [m.text for m in posted if isinstance(m, ReplyPiece)] == ["abc"]
    batcher.flush()
    assert len(posted) == 1  # nothing pending: nothing posted


def test_progress_is_throttled_but_the_end_always_reported() -> None:
    posted: list[Message] = []
    report = bridge.progress_reporter(posted.append, "prefill", interval=10.0)
    for done in range(1, 101):
        report(done, 100)
    assert [(m.done, m.total) for m in posted if isinstance(m, Progress)] == [(1, 100), (100, 100)]


def _finished(body) -> StepFinished:
    posted: list[Message] = []
    bridge.run_step("document", posted.append, threading.Event(), body)
    [message] = posted
    assert isinstance(message, StepFinished)
    return message


def test_run_step_reports_every_outcome_once() -> None:
    assert _finished(lambda: "done").detail == "done"

    def cancelled() -> str:
        raise Cancelled("prefill cancelled after 3 of 9 tokens")

    stopped = _finished(cancelled)
    assert stopped.stopped and "3 of 9" in stopped.detail

    def refused() -> str:
        raise DocumentError("x.bin: looks like a binary file")

    assert _finished(refused).error == "x.bin: looks like a binary file"

    def bug() -> str:
        raise KeyError("oops")

    assert "unexpected KeyError" in (_finished(bug).error or "")


def test_head_skips_blank_lines_and_cuts_long_ones() -> None:
    text = "\n\nfirst\n\n" + "x" * 500 + "\nthird\nfourth\nfifth\nsixth\n"
    head = bridge._head(text).splitlines()
    assert head[0] == "first" and head[1].endswith("…") and len(head[1]) == 161
    assert len(head) == 5 and "sixth" not in head


def test_slash_commands_parse() -> None:
    assert parse_command("Where is it?") is None
    assert parse_command("/load  ~/a b.txt ") == Command("load", "~/a b.txt")
    assert parse_command("/clear") == Command("clear", "")
    try:
        parse_command("/nope")
    except UnknownCommand as e:
        assert "/nope" in str(e)
    else:
        raise AssertionError("an unknown command must be refused")


def test_batching_posts_at_most_once_an_interval() -> None:
    posted: list[Message] = []
    now = [0.0]
    batcher = bridge.TokenBatcher(posted.append, interval=0.25, clock=lambda: now[0])
    for _ in range(22):  # a token every 1/16 s (exact in binary, as the sums are)
        now[0] += 0.0625
        batcher.add("t")
    batcher.flush()
    # A post every fourth token, at 0.25 s, 0.5 s, ...; the flush posts the rest.
    assert [len(m.text) for m in posted] == [4, 4, 4, 4, 4, 2]
