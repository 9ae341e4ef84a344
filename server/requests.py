"""The OpenAI request bodies kvchat serves, read and checked: a bad body is an ApiError that the
app answers in the OpenAI error shape, before the request reaches the engine queue.

Fields a client sends that kvchat does not use (`frequency_penalty`, `user`, ...) are ignored,
as OpenAI-compatible servers do; a field whose value would change the answer in a way kvchat
cannot honour (`n` > 1, `tools`, `logprobs`) is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from kvchat.config import GenerationSettings, schema_fields
from kvchat.config.validate import Invalid, coerce

MAX_STOP = 4  # as OpenAI allows
# Characters of one stop string, as hosted APIs bound them: the engine thread scans each
# token's text for them, and a client's strings must not cost every other client time.
MAX_STOP_CHARS = 256


class ApiError(Exception):
    """A request answered with an error: HTTP status, message, and the parameter at fault."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = (
            status,
            message,
            param,
            kind,
            code,
        )

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@dataclass(frozen=True)
class Sampling:
    """What a request asks of the generation: the settings, stop strings, and streaming."""

    params: GenerationSettings
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    return_progress: bool  # prompt-processing progress as chunks, as llama-server sends them


@dataclass(frozen=True)
class ChatRequest:
    system: str | None
    turns: list[dict[str, str]]  # user and assistant turns before the question
    question: str
    sampling: Sampling


@dataclass(frozen=True)
class CompletionRequest:
    prompt: str
    sampling: Sampling


def parse_json(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


def chat_request(body: dict[str, Any], defaults: GenerationSettings) -> ChatRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty array", "messages")
    system, turns = None, []
    for i, message in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(message, dict):
            raise ApiError(400, f"{param} must be an object", param)
        role = message.get("role")
        content = _content(message.get("content"), f"{param}.content")
        if role in ("system", "developer"):
            if i != 0:
                raise ApiError(400, "a system message can only be the first message", param)
            system = content
        elif role in ("user", "assistant"):
            turns.append({"role": role, "content": content})
        else:
            raise ApiError(
                400, f"{param}.role must be system, user or assistant, not {role!r}", param
            )
    if not turns or turns[-1]["role"] != "user":
        raise ApiError(400, "the last message must be the user's", "messages")
    for i, (a, b) in enumerate(zip(turns, turns[1:], strict=False)):
        if a["role"] == b["role"]:
            raise ApiError(400, "user and assistant messages must alternate", f"messages[{i}]")
    _refuse_unsupported(body)
    return ChatRequest(
        system,
        turns[:-1],
        turns[-1]["content"],
        _sampling(body, defaults, "max_completion_tokens", "max_tokens"),
    )


def completion_request(body: dict[str, Any], defaults: GenerationSettings) -> CompletionRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string", "prompt")
    _refuse_unsupported(body)
    if body.get("echo") or body.get("suffix") is not None:
        raise ApiError(400, "echo and suffix are not supported", "echo")
    return CompletionRequest(prompt, _sampling(body, defaults, "max_tokens"))


def _content(content: Any, param: str) -> str:
    """A message's text: a string, or an array of text parts (joined)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise ApiError(400, f"{param}: only text parts are supported", param)
            if not isinstance(part.get("text"), str):
                raise ApiError(400, f"{param}: a text part needs a string text", param)
            parts.append(part["text"])
        return "".join(parts)
    raise ApiError(400, f"{param} must be a string or an array of text parts", param)


def _refuse_unsupported(body: dict[str, Any]) -> None:
    if body.get("n", 1) != 1:
        raise ApiError(400, "n must be 1: kvchat writes one answer per request", "n")
    for name in ("tools", "functions", "logprobs", "top_logprobs", "response_format"):
        if body.get(name) not in (None, False, [], {"type": "text"}):
            raise ApiError(400, f"{name} is not supported", name)


def _sampling(body: dict[str, Any], defaults: GenerationSettings, *max_names: str) -> Sampling:
    # As OpenAI's API: a sampled reply is drawn afresh unless the request gives a seed.
    params = replace(defaults, seed=-1)
    limits = {spec.name: spec for spec in schema_fields(GenerationSettings)}
    given_max = next((name for name in max_names if body.get(name) is not None), None)
    fields = [("temperature", "temperature"), ("top_p", "top_p"), ("seed", "seed")]
    if given_max is not None:
        fields.append((given_max, "max_new_tokens"))
    for name, key in fields:
        if body.get(name) is None:
            continue
        try:
            value = coerce(limits[key], name, body[name])
        except Invalid as e:
            raise ApiError(400, str(e), name) from None
        if key == "max_new_tokens":
            # The server's own generation.max_new_tokens is the most one request gets: the
            # engine serves one request at a time.
            value = min(value, defaults.max_new_tokens)
        params = replace(params, **{key: value})
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, "stop must be a non-empty string or an array of them", "stop")
    if len(stop) > MAX_STOP:
        raise ApiError(400, f"stop takes at most {MAX_STOP} strings", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise ApiError(400, f"a stop string takes at most {MAX_STOP_CHARS} characters", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")
    return Sampling(
        params,
        tuple(stop),
        stream,
        bool(options.get("include_usage")),
        body.get("return_progress") is True,
    )
