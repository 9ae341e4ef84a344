"""`kvchat bench serve --hostile`'s clients against the real routes and engine, with 1 s
deadlines: each is the client it says, and the server does with it what it should."""

from __future__ import annotations

import threading

import pytest

from kvchat.bench.hostile_clients import Hostile, run_hostile
from kvchat.config import load_settings
from kvchat.core.engine import Engine

from ..server.serving import serving


@pytest.fixture(scope="module")
def url():
    engine = Engine.load(load_settings(overrides=["long_context.max_seq_len=8192"]).settings)
    with serving(engine, body_timeout_s=1.0, headers_timeout_s=1.0) as base:
        yield base


@pytest.mark.parametrize("kind", list(Hostile))
def test_each_hostile_client_gets_what_the_server_owes_it(url, kind):
    start = threading.Event()
    start.set()
    run = run_hostile(kind, url, start)
    assert run.as_expected, run
