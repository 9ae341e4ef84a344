"""`kvchat serve` as a client meets it: the real server in a subprocess on a loopback port, the
real SmolLM2 behind it, driven by the official `openai` client and by raw HTTP."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import openai
import pytest

from kvchat.bench.serve_load import ServerProcess, start_server
from kvchat.config import load_settings
from kvchat.core.conversation import Conversation
from kvchat.core.engine import Engine

SAMPLE_REPO = Path(__file__).parents[1] / "fixtures" / "sample-repo"
KEY = "test-key-123"
MAX_NEW = 24
OVERRIDES = [f"generation.max_new_tokens={MAX_NEW}", "long_context.max_seq_len=4096"]
QUESTION = "Who is the head keeper in src/keeper.py?"


class Server:
    def __init__(self, served: ServerProcess) -> None:
        self.served, self.url = served, served.url

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url, api_key=key, max_retries=0, timeout=120)

    def http(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        return httpx.Client(headers=headers, timeout=120)

    def stats(self) -> dict:
        with self.http() as http:
            return http.get(f"{self.url}/kvchat/stats").raise_for_status().json()


def _serving(tmp: Path, home: str, *options: str) -> Iterator[Server]:
    (tmp / "key").write_text(KEY + "\n")
    args = ["--api-key-file", str(tmp / "key"), "--queue-size", "1", *options]
    for override in OVERRIDES:
        args += ["--set", override]
    with (tmp / "server.log").open("w") as log:
        served = start_server(args, log, os.environ | {"KVCHAT_HOME": home})
    yield Server(served)
    served.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, new_home) -> Iterator[Server]:
    """A server of the sample repository."""
    tmp = tmp_path_factory.mktemp("serve")
    yield from _serving(tmp, new_home(tmp / "home"), "--document", str(SAMPLE_REPO))


@pytest.fixture(scope="module")
def plain(tmp_path_factory, new_home) -> Iterator[Server]:
    """A server without a document: raw completions."""
    tmp = tmp_path_factory.mktemp("plain")
    yield from _serving(tmp, new_home(tmp / "home"))


@pytest.fixture(scope="module")
def expected() -> tuple[str, int, int]:
    """The engine's own greedy answer to QUESTION over the sample repo, as `kvchat ask` gives
    it: (text, prompt tokens, document prefix tokens)."""
    engine = Engine.load(load_settings(overrides=OVERRIDES).settings)
    doc = engine.read_document(SAMPLE_REPO)
    conversation = Conversation(document_ids=engine.encode_document(doc), document_name=doc.name)
    session = engine.new_session(conversation)
    prefix = conversation.document_prefix_ids(engine.tokenizer)
    session.prefill_document(prefix)
    prompt = conversation.prompt_ids(engine.tokenizer, QUESTION)
    return "".join(session.ask(QUESTION)), len(prompt), len(prefix)


def test_chat_answers_equal_the_engines_own_greedy_answer(server, expected):
    text, n_prompt, n_prefix = expected
    client = server.client()
    messages = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(model="smollm2-135m", messages=messages)
    assert whole.choices[0].message.content == text
    assert whole.usage.prompt_tokens == n_prompt
    # The document was prefilled at start: only the question is new.
    assert whole.usage.prompt_tokens_details.cached_tokens >= n_prefix

    stream = client.chat.completions.create(
        model="smollm2-135m",
        messages=messages,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert "".join(pieces) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.choices[
        0
    ].finish_reason
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (
        n_prompt,
        whole.usage.completion_tokens,
    )
    # The same prompt again: the cache held all of it, and the logits after it.
    assert usage.prompt_tokens_details.cached_tokens == n_prompt


def test_a_follow_up_turn_prefills_only_its_new_tokens(server, expected):
    text, n_prompt, _ = expected
    client = server.client()
    first = [{"role": "user", "content": QUESTION}]
    reply = client.chat.completions.create(model="m", messages=first)
    follow = [
        *first,
        {"role": "assistant", "content": reply.choices[0].message.content},
        {"role": "user", "content": "And who keeps the lamp?"},
    ]
    second = client.chat.completions.create(model="m", messages=follow)
    new = second.usage.prompt_tokens - second.usage.prompt_tokens_details.cached_tokens
    assert second.usage.prompt_tokens > n_prompt
    assert new < 40  # the reply and the new question, not the document again
    last = server.stats()["last_request"]
    assert last["status"] in ("stop", "length")
    assert last["prompt_tokens"] == second.usage.prompt_tokens


def test_completions_stream_and_whole_agree(plain):
    client = plain.client()
    prompt = "The lighthouse keeper climbed the stairs and"
    whole = client.completions.create(model="m", prompt=prompt, max_tokens=12)
    assert whole.usage.completion_tokens == 12 and whole.choices[0].finish_reason == "length"
    streamed = client.completions.create(model="m", prompt=prompt, max_tokens=12, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text


def test_stop_strings_end_the_reply_before_them(plain):
    client = plain.client()
    prompt = "1, 2, 3, 4, 5,"
    whole = client.completions.create(model="m", prompt=prompt, max_tokens=20)
    text = whole.choices[0].text
    assert " 8," in text  # the model counts on
    stopped = client.completions.create(model="m", prompt=prompt, max_tokens=20, stop=[" 8,"])
    assert stopped.choices[0].text == text[: text.index(" 8,")]
    assert stopped.choices[0].finish_reason == "stop"


def test_max_tokens_past_the_servers_own_gets_the_servers(plain):
    # generation.max_new_tokens is the most one request gets: others wait meanwhile.
    prompt = "1, 2, 3, 4, 5,"
    whole = plain.client().completions.create(model="m", prompt=prompt, max_tokens=100_000)
    assert whole.usage.completion_tokens == MAX_NEW
    assert whole.choices[0].finish_reason == "length"


def test_a_client_that_disconnects_stops_the_generation(plain):
    served = plain.stats()["queue"]["served"]
    body = {"model": "m", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 3000, "stream": True}
    with plain.http() as http:
        with http.stream("POST", f"{plain.url}/completions", json=body) as response:
            assert response.status_code == 200
            texts = 0
            for line in response.iter_lines():
                texts += line.startswith("data: ")
                if texts == 5:
                    break  # leaving the block closes the connection
    # The engine notices the closed connection at its next token; the deadline only ends a
    # test that would hang.
    deadline = time.monotonic() + 600
    while (stats := plain.stats())["queue"]["served"] == served:
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)
    last = stats["last_request"]
    assert last["status"] == "cancelled"
    assert 5 <= last["completion_tokens"] < 3000  # stopped before max_tokens


ASK = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (b"{not json", None),
        ([1, 2], None),
        ({"model": "m"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"messages": ASK, "temperature": "hot"}, "temperature"),
        ({"messages": ASK, "max_tokens": 0}, "max_tokens"),
        ({"messages": ASK, "n": 2}, "n"),
        ({"messages": ASK, "stop": [""]}, "stop"),
    ],
)
def test_bad_requests_get_400_in_the_openai_shape(server, body, param):
    with server.http() as http:
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        response = http.post(f"{server.url}/chat/completions", content=content)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    assert error["param"] == param


def test_a_prompt_over_the_plan_gets_400_with_its_numbers(plain):
    with pytest.raises(openai.BadRequestError) as raised:
        plain.client().completions.create(model="m", prompt="word " * 5000, max_tokens=8)
    error = raised.value.body
    assert error["code"] == "context_length_exceeded"
    assert "max_seq_len is 4096" in error["message"]


def test_unknown_routes_and_methods_answer_in_the_openai_shape(server):
    with server.http() as http:
        missing = http.get(f"{server.url}/embeddings")
        wrong = http.get(f"{server.url}/chat/completions")
    assert missing.status_code == 404 and "error" in missing.json()
    assert wrong.status_code == 405 and "error" in wrong.json()


def test_the_api_key_is_enforced(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    with httpx.Client() as http:
        assert http.get(f"{server.url}/models").status_code == 401
        assert http.get(server.url.removesuffix("/v1") + "/health").json() == {"status": "ok"}
    assert [m.id for m in server.client().models.list()] == ["smollm2-135m"]


def test_the_key_stays_out_of_the_process_list(server):
    cmdline = Path(f"/proc/{server.served.process.pid}/cmdline").read_bytes()
    assert b"--api-key-file" in cmdline and KEY.encode() not in cmdline


def _serve(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvchat.tui.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.endswith("_KEY")}
        | {"KVCHAT_HOME": str(tmp_path), **env},
    )


def test_listening_beyond_loopback_needs_the_servers_own_key(tmp_path):
    # The client's key in the environment is not the server's.
    done = _serve(tmp_path, "--host", "0.0.0.0", KVCHAT_API_KEY="a-key-for-another-server")
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "$KVCHAT_SERVER_KEY" in done.stderr


@pytest.mark.parametrize("content", [None, "\n"])
def test_a_key_file_that_holds_no_key_is_one_clear_error(tmp_path, content):
    key = tmp_path / "key"
    if content is not None:
        key.write_text(content)
    done = _serve(tmp_path, "--api-key-file", str(key))
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert done.stderr.startswith(f"kvchat: error: --api-key-file {key}: "), done.stderr


def test_the_server_stops_promptly_and_quietly_while_a_reply_streams(tmp_path, new_home):
    log_path = tmp_path / "server.log"
    with log_path.open("w") as log:
        served = start_server(
            ["--set", "long_context.max_seq_len=4096"],
            log,
            os.environ | {"KVCHAT_HOME": new_home(tmp_path / "home")},
        )
    body = {"model": "m", "prompt": "1, 2, 3, 4, 5,", "max_tokens": 3000, "stream": True}
    with httpx.Client(timeout=120) as http:
        with http.stream("POST", f"{served.url}/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            served.process.send_signal(signal.SIGINT)  # Ctrl-C
            rest = [line for line in lines if line.startswith("data: ")]
            returncode = served.process.wait(timeout=120)
    # The reply ended at once with an error event, not after its 3000 tokens.
    assert "the server is stopping" in rest[-1] and len(rest) < 3000
    assert returncode in (130, -signal.SIGINT)
    said = log_path.read_text()
    assert "Traceback" not in said, said[-4000:]


def test_a_sampled_reply_is_drawn_afresh_unless_the_request_gives_a_seed(server):
    client = server.client()

    def sample(**seed: int) -> str:
        messages = [{"role": "user", "content": "Write a line about the sea."}]
        reply = client.chat.completions.create(
            model="m", messages=messages, temperature=1.5, max_tokens=32, **seed
        )
        return reply.choices[0].message.content

    assert sample(seed=7) == sample(seed=7)
    assert len({sample(), sample(), sample()}) > 1


def test_a_body_past_the_limit_is_refused_unread(server):
    with server.http() as http:
        response = http.post(f"{server.url}/completions", content=b"x" * (65 << 20))
    assert response.status_code == 413
    assert "64 MiB" in response.json()["error"]["message"]
