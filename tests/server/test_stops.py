"""Stop strings: bounded in a request, and scanned in time linear in their length."""

from __future__ import annotations

import random

import pytest

from kvchat.config import GenerationSettings
from kvchat.server.requests import MAX_STOP_CHARS, ApiError, completion_request
from kvchat.server.worker import StopScanner


def _longest_begun(held: str, stops: tuple[str, ...]) -> int:
    """The definition: the longest end of `held` that begins a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if held.endswith(s[:n])), default=0)


@pytest.mark.parametrize("seed", range(20))
def test_the_scanner_releases_the_text_before_the_first_stop_and_holds_only_a_beginning(seed):
    rng = random.Random(seed)
    words = ("".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(4))
    stops = tuple(words)[: rng.randint(1, 4)]
    text = "".join(rng.choice("abc") for _ in range(200))
    scanner, released = StopScanner(stops), ""
    at = 0
    while at < len(text) and not scanner.stopped:
        piece = text[at : at + rng.randint(0, 5)]
        at += len(piece)
        released += scanner.push(piece)
        if not scanner.stopped:
            assert len(scanner.held) == _longest_begun(released + scanner.held, stops)
    consumed = text[:at]
    found = [i for i in (consumed.find(s) for s in stops) if i >= 0]
    assert scanner.stopped == bool(found)
    if found:
        assert released == consumed[: min(found)]
    else:
        assert released + scanner.flush() == consumed


def test_a_long_stop_string_split_across_tokens_is_found():
    stop = "a" * (MAX_STOP_CHARS - 1) + "b"
    scanner = StopScanner((stop,))
    released = "".join(scanner.push("a") for _ in range(3 * MAX_STOP_CHARS))
    assert released == "a" * (2 * MAX_STOP_CHARS + 1)  # all but the stop's beginning
    assert scanner.push("bc") == "" and scanner.stopped


def test_a_stop_string_past_the_limit_is_refused():
    defaults = GenerationSettings()
    body = {"model": "m", "prompt": "p", "stop": ["x" * MAX_STOP_CHARS]}
    assert completion_request(body, defaults).sampling.stop == ("x" * MAX_STOP_CHARS,)
    body["stop"] = ["x", "y" * (MAX_STOP_CHARS + 1)]
    with pytest.raises(ApiError, match=f"at most {MAX_STOP_CHARS} characters") as error:
        completion_request(body, defaults)
    assert error.value.status == 400 and error.value.param == "stop"
