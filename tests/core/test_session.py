"""The Session's conversation API on the real SmolLM2 in fp32: regenerate, clear, the system
prompt, a new session going on from a given conversation, and the throughput records that
`Engine.stats()` reports."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest

from kvchat.core.cancel import Cancelled
from kvchat.core.conversation import Conversation
from kvchat.core.engine import Throughput

QUESTION = "Name a colour."


@pytest.fixture(scope="module")
def engine(engine_fp32, settings_fp32):
    """Greedy and short replies: a regenerated reply equals the first one."""
    generation = replace(settings_fp32.generation, max_new_tokens=8, temperature=0.0)
    return engine_fp32.with_settings(replace(settings_fp32, generation=generation))


def test_regenerate_answers_again_from_the_cached_prompt(engine):
    session = engine.new_session()
    first = "".join(session.ask(QUESTION))
    cached = len(session.tokens)
    assert first and session.answer_count == 1

    again = "".join(session.regenerate())
    # The cache held the prompt before the old reply, and the logits after it.
    assert session.last_prefill.prefilled == 0
    assert again == first and len(session.tokens) == cached
    assert session.messages == [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": again},
    ]
    assert session.answer_count == 2


def test_a_regeneration_stopped_before_its_reply_keeps_the_old_turn(engine):
    session = engine.new_session()
    "".join(session.ask(QUESTION))
    turns = session.messages
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        "".join(session.regenerate(cancel=cancel))
    assert session.messages == turns and session.answer_count == 1


def test_a_regeneration_stopped_during_its_reply_replaces_the_old_turn(engine):
    session = engine.new_session()
    "".join(session.ask(QUESTION))
    cancel = threading.Event()
    pieces = []
    for piece in session.regenerate(cancel=cancel):
        pieces.append(piece)
        cancel.set()
    assert session.messages == [
        {"role": "user", "content": QUESTION},
        {"role": "assistant", "content": "".join(pieces)},
    ]
    assert session.answer_count == 2


def test_regenerate_needs_an_answered_question(engine):
    with pytest.raises(ValueError, match="nothing to regenerate"):
        next(engine.new_session().regenerate())


def test_clear_keeps_the_system_prompt_the_document_and_the_cache(engine):
    ids = engine.tokenizer.encode("The meeting is on Tuesday at the blue house.\n")
    conversation = Conversation(system="Be brief.", document_ids=ids, document_name="note.txt")
    session = engine.new_session(conversation)
    prefix = conversation.document_prefix_ids(engine.tokenizer)
    session.prefill_document(prefix)
    "".join(session.ask("When is the meeting?"))
    tokens = list(session.tokens)

    session.clear()
    assert session.messages == [] and session.answer_count == 1
    assert session.system == "Be brief." and session.has_document
    assert session.conversation.document_name == "note.txt" and session.tokens == tokens
    follow_up = "Where is it?"
    prompt = session.conversation.prompt_ids(engine.tokenizer, follow_up)
    "".join(session.ask(follow_up))
    # The cached document prefix is reused: at most the question and its template prefill.
    assert 0 < engine.stats().prefill_tokens <= len(prompt) - len(prefix)


def test_the_system_prompt_comes_first_and_empty_clears_it(engine):
    session = engine.new_session()
    session.set_system("Answer in one word.")
    assert session.system == "Answer in one word."
    prompt = session.conversation.prompt_ids(engine.tokenizer, QUESTION)
    assert "Answer in one word." in engine.tokenizer.decode(prompt)
    session.set_system("")
    assert session.system is None


def test_messages_is_a_copy(engine):
    turns = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello."}]
    session = engine.new_session(Conversation(messages=turns))
    copy = session.messages
    copy[0]["content"] = "changed"
    copy.clear()
    assert session.messages[0] == {"role": "user", "content": "Hi."}


def test_a_new_session_goes_on_from_a_given_conversation(engine):
    saved = Conversation(
        system="Be brief.",
        messages=[
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": "Blue."},
        ],
    )
    session = engine.new_session(saved)
    assert engine.session is session and session.conversation is saved
    assert session.tokens == [] and session.answer_count == 0
    reply = "".join(session.regenerate())
    assert session.messages[-1] == {"role": "assistant", "content": reply}
    assert session.answer_count == 1 and len(session.messages) == 2
    # Nothing was cached: the prompt before the old reply is prefilled whole.
    prompt = Conversation(system="Be brief.").prompt_ids(engine.tokenizer, QUESTION)
    assert engine.stats().prefill_tokens == len(prompt)


def test_throughput_records_what_stats_report(engine):
    throughput = Throughput()
    throughput.record_first_token()
    assert throughput.time_to_first_token is None  # no turn began
    throughput.begin_prefill()
    throughput.record_prefill(5, 0.5)
    throughput.begin_decode()
    throughput.record_first_token()
    first = throughput.time_to_first_token
    throughput.record_first_token()
    throughput.record_decode(3, 0.25)
    assert first is not None and throughput.time_to_first_token == first
    assert (throughput.prefill, throughput.decode) == ((5, 0.5), (3, 0.25))

    session = engine.new_session()
    prompt = session.conversation.prompt_ids(engine.tokenizer, QUESTION)
    "".join(session.ask(QUESTION))
    stats, recorded = engine.stats(), engine.throughput
    assert (stats.prefill_tokens, stats.prefill_seconds) == recorded.prefill
    assert stats.prefill_tokens == len(prompt)
    assert (stats.decode_tokens, stats.decode_seconds) == recorded.decode
    assert stats.decode_tokens == len(session.tokens) - len(prompt)
    assert stats.time_to_first_token is not None
    assert stats.time_to_first_token == recorded.time_to_first_token
