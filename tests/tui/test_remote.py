"""The app as a client of an OpenAI-compatible server (`kvchat --server URL`): a plain server
that reports nothing of its engine (tests/tui/openai_server.py, real HTTP on loopback) for
the UI side, and the real `kvchat serve` with SmolLM2 for the answers and the panels."""

from __future__ import annotations

import os
from pathlib import Path

import openai
import pytest

from kvchat.bench.serve_load import start_server
from kvchat.client.http import OpenAIServer
from kvchat.core.sources import read_sources
from kvchat.tui.app import KvchatApp
from kvchat.tui.cli import main
from kvchat.tui.remote_steps import RemoteSteps

from .conftest import messages, notifications, send, wait_for, wait_idle
from .openai_server import EchoServer, reply_to, serving

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("home")]

SAMPLE_REPO = Path(__file__).parents[1] / "fixtures" / "sample-repo"
QUESTION = "Who is the head keeper in src/keeper.py?"
KEY = "client-test-key"
# float32: in bfloat16 an answer can depend on where the cache split its prompt (the app's
# prefills the document first), and this test compares answers across such splits.
SERVE_OVERRIDES = ["model.dtype=float32", "long_context.max_seq_len=4096"]


def remote_app(settings, url: str, key: str | None, **kwargs) -> KvchatApp:
    return KvchatApp(settings, steps=RemoteSteps(OpenAIServer(url, key)), **kwargs)


def panel(app: KvchatApp, name: str) -> str:
    return str(app.query_one(f"#{name} .panel-body").render())


def status(app: KvchatApp) -> str:
    return str(app.query_one("#status").render())


async def test_a_plain_server_answers_the_chat_and_the_panels_say_not_reported(
    settings, tmp_path: Path
) -> None:
    doc = tmp_path / "notes.txt"
    doc.write_text("The meeting is on Tuesday at the blue house.\n")
    with serving(EchoServer(api_key=KEY)) as server:
        app = remote_app(settings, server.url, KEY, paths=[doc])
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_for(pilot, lambda: app.document is not None and not app.busy)
            await wait_idle(pilot, app)
            # The document went to the server once, alone, to be prefilled before a question.
            warm = server.requests[0].body
            assert warm["model"] == "echo-1" and warm["max_tokens"] == 1
            assert warm["messages"] == [{"role": "user", "content": f"{doc.read_text()}\n\n"}]
            assert app.document.tokens == 9  # the server's usage, not a count made here

            await send(pilot, app, "When is the meeting?")
            await send(pilot, app, "Where?")
            replies = [m.source for m in messages(app, "assistant")]
            assert replies == [reply_to("When is the meeting?"), reply_to("Where?")]
            last = server.requests[-1].body
            assert last["max_tokens"] == settings.generation.max_new_tokens
            assert last["stream"] is True and last["seed"] == settings.generation.seed
            # The whole conversation, the document opening its first user message.
            assert last["messages"] == [
                {"role": "user", "content": f"{doc.read_text()}\n\nWhen is the meeting?"},
                {"role": "assistant", "content": reply_to("When is the meeting?")},
                {"role": "user", "content": "Where?"},
            ]
            app.show_stats(app.engine.stats())
            assert panel(app, "dram") == panel(app, "device") == "not reported by the server"
            assert "decode" in panel(app, "throughput") and "(3 tok)" in panel(app, "throughput")
            assert f"echo-1 on {server.url} │ context" in status(app)

            await pilot.press("ctrl+r")  # regenerate: the same question, its reply replaced
            await wait_idle(pilot, app)
            assert server.requests[-1].body["messages"] == last["messages"]
            assert [m.source for m in messages(app, "assistant")] == replies

            app.action_export(str(tmp_path / "chat.md"))
            exported = (tmp_path / "chat.md").read_text()
            assert "- model: echo-1" in exported and "Where?" in exported
            assert "- document: notes.txt (45 bytes, 9 tokens), " in exported

            # A saved conversation resumes on the server: its document read again, its turns.
            app.resume(app.conversation_id)
            await wait_idle(pilot, app)
            await send(pilot, app, "Again?")
            assert server.requests[-1].body["messages"] == [
                *last["messages"],
                {"role": "assistant", "content": reply_to("Where?")},
                {"role": "user", "content": "Again?"},
            ]

            # A reply the server cut at max_tokens says so.
            assert not any("cut short" in n for n in notifications(app))
            await send(pilot, app, "Say it in many more words than eight, please")
            assert messages(app, "assistant")[-1].source == "You asked: Say it in many more words"
            assert any("generation.max_new_tokens (8)" in n for n in notifications(app))

            await send(pilot, app, "/model echo-2")
            assert app.engine.model == "echo-2"
            await send(pilot, app, "Hello?")
            assert server.requests[-1].body["model"] == "echo-2"
            assert server.requests[-1].body["messages"] == [{"role": "user", "content": "Hello?"}]


async def test_esc_stops_a_reply_the_server_is_still_preparing(settings) -> None:
    with serving(EchoServer(hold_replies=True)) as server:
        app = remote_app(settings, server.url, None)
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_idle(pilot, app)
            prompt = app.query_one("#prompt")
            prompt.text = "Still there?"  # type: ignore[attr-defined]
            await pilot.press("enter")
            await wait_for(pilot, lambda: len(server.requests) == 1)
            await pilot.press("escape")
            await wait_idle(pilot, app)  # while the server still holds the reply
            assert not server.released.is_set() and not server.requests[0].finished
            await wait_for(pilot, lambda: server.requests[0].cancelled)
            # No answer began: the question stays, marked unanswered, out of the conversation.
            assert messages(app, "assistant") == []
            assert "*[no answer]*" in messages(app, "user")[0].source
            assert app.engine.session.messages == []


async def test_a_wrong_key_a_refusal_and_no_server_are_told_and_leave_the_app_usable(
    settings, tmp_path: Path
) -> None:
    long_doc = tmp_path / "long.txt"
    long_doc.write_text("word " * 6000)
    short_doc = tmp_path / "short.txt"
    short_doc.write_text("Ada keeps the light.\n")
    with serving(EchoServer(api_key=KEY, usage=False)) as server:
        app = remote_app(settings, server.url, "wrong")
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_idle(pilot, app)
            assert app.engine is None and app.state == "model failed to load"
            assert any("401 Incorrect API key provided" in n for n in notifications(app))

        app = remote_app(settings, server.url, KEY)
        async with app.run_test(size=(140, 45)) as pilot:
            await wait_idle(pilot, app)
            await send(pilot, app, f"/load {long_doc}")
            assert any("maximum context length is 5000" in n for n in notifications(app))
            assert app.document is None and not app.engine.session.has_document
            await send(pilot, app, "Still fine?")
            assert [m.source for m in messages(app, "assistant")] == [reply_to("Still fine?")]
            # This server sends no usage: what it did not count is not made up.
            app.show_stats(app.engine.stats())
            assert "prefill  tokens not reported" in panel(app, "throughput")
            assert "(4 tok)" in panel(app, "throughput")  # the pieces, counted here
            assert "context not reported" in status(app)
            await send(pilot, app, f"/load {short_doc}")
            [card] = messages(app, "document")
            assert "**short.txt** — 21 B\n" in card.source

    app = remote_app(settings, server.url, KEY)  # the server is gone now
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_idle(pilot, app)
        assert any("cannot reach the server" in n for n in notifications(app))


def test_the_cli_refuses_a_bad_server_url_and_a_key_without_a_server(capsys) -> None:
    assert main(["--server", "ftp://host/v1"]) == 2
    assert "not a server URL" in capsys.readouterr().err
    assert main(["--api-key", "k"]) == 2
    assert "--api-key, --api-key-file and --server-timeout are for --server" in (
        capsys.readouterr().err
    )


def test_a_key_never_crosses_the_network_unencrypted(capsys, tmp_path, monkeypatch) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("k\n")
    for key in (["--api-key", "k"], ["--api-key-file", str(key_file)]):
        assert main(["--server", "http://192.0.2.1:8000/v1", *key]) == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert "the API key would cross the network unencrypted" in line
    monkeypatch.setenv("KVCHAT_API_KEY", "k")
    assert main(["--server", "http://example.com/v1"]) == 2
    assert "unencrypted" in capsys.readouterr().err
    # Over TLS, or to this machine, it goes.
    for url in ["https://example.com/v1", "http://127.0.0.1:8000/v1", "http://[::1]:8000"]:
        assert OpenAIServer(url, "k").api_key == "k"
    assert OpenAIServer("http://192.0.2.1:8000/v1").api_key is None  # no key, nothing to leak


@pytest.fixture(scope="module")
def kvchat_serve(tmp_path_factory, new_home):
    tmp = tmp_path_factory.mktemp("serve")
    args = ["--api-key", KEY]
    for override in SERVE_OVERRIDES:
        args += ["--set", override]
    with (tmp / "server.log").open("w") as log:
        served = start_server(args, log, os.environ | {"KVCHAT_HOME": new_home(tmp / "home")})
    yield served.url
    served.stop()


async def test_the_app_on_kvchat_serve_answers_as_the_server_does_and_shows_its_cache(
    settings, kvchat_serve: str
) -> None:
    doc = read_sources([SAMPLE_REPO])
    client = openai.OpenAI(base_url=kvchat_serve, api_key=KEY, max_retries=0, timeout=120)
    first = [{"role": "user", "content": f"{doc.text}\n\n{QUESTION}"}]
    app = remote_app(settings, kvchat_serve, KEY, paths=[SAMPLE_REPO])
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_for(pilot, lambda: app.document is not None and not app.busy, timeout=120)
        await wait_idle(pilot, app)
        await send(pilot, app, QUESTION)
        shown = messages(app, "assistant")[0].source
        # The server read the document for its card; the question prefilled only itself.
        assert app.document.tokens > 300
        # (The usage's prompt tokens less its cached ones, as the throughput panel counts.)
        last = client.get("/kvchat/stats", cast_to=object)["last_request"]
        assert last["prompt_tokens"] > app.document.tokens
        assert 0 < app.engine.stats().prefill_tokens < 40
        await send(pilot, app, "And who keeps the lamp?")
        assert 0 < app.engine.stats().prefill_tokens < 40  # the new turn only
        last = client.get("/kvchat/stats", cast_to=object)["last_request"]

        # The panels show the server's engine.
        await wait_for(pilot, lambda: app.engine.stats().engine is not None)
        app.show_stats(app.engine.stats())
        assert "KV " in panel(app, "dram") and "process" in panel(app, "dram")
        assert "not reported" not in panel(app, "device")
        assert f"on {kvchat_serve}" in status(app) and "kv " in status(app)
        server_context = app.engine.stats().engine.context_tokens
        assert server_context >= last["prompt_tokens"]

    # The server's own answer to the same messages, asked after the app's turns.
    max_tokens = settings.generation.max_new_tokens
    expected = client.chat.completions.create(model="m", messages=first, max_tokens=max_tokens)
    assert shown == expected.choices[0].message.content
