"""Multi-turn reuse on the real SmolLM2 in fp32: a follow-up prefills only its new tokens, an
edit or a regenerated reply truncates to the common prefix, and either way the logits equal
those of a fresh session that prefills the whole history at once.

Small cache settings (32-token blocks, a 128-token window, 64-token chunks) make a 300-token
document span ten blocks, so the sparse paths (store, anchors, window shifts and reloads)
really run; `second_select_num` covers every block, the budget at which the block-sparse
cache must equal dense attention.
"""

from __future__ import annotations

from dataclasses import replace
from importlib import resources

import pytest
import torch

from kvchat.core.engine import Session

QUESTIONS = (
    "When was the lighthouse built?",
    "Who designed it?",
    "How many steps lead to the lantern room?",
)
# Chunk boundaries differ between a turn-by-turn session and a one-pass prefill, so fp32 sums
# are ordered differently: equal up to rounding (the chunked-prefill test's bound).
TOL = 1e-4
# Native positions only: with extrapolate, which tokens keep exact distances (the local
# window) depends on where each pass starts, so no chunking equals another by design.
CASES = {
    "dense": {"attention": "dense"},
    "sparse": {"attention": "sparse", "second_select_num": 10_000, "position_mode": "native"},
}


@pytest.fixture(scope="module")
def document_ids(engine_fp32):
    text = resources.files("kvchat.core").joinpath("data/sample.txt").read_text()
    return engine_fp32.tokenizer.encode(text[:1200])


def small_engine(engine_fp32, settings_fp32, **long_context):
    lc = replace(
        settings_fp32.long_context,
        chunk_size=64,
        max_seq_len=4096,
        block_size=32,
        local_windows_len=128,
        **long_context,
    )
    generation = replace(settings_fp32.generation, max_new_tokens=8, temperature=0.0)
    cache = replace(settings_fp32.cache, snapshots=False)
    settings = replace(settings_fp32, long_context=lc, generation=generation, cache=cache)
    return engine_fp32.with_settings(settings)


def common_prefix(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def fresh_logits(engine, prompt) -> torch.Tensor:
    """A new session that prefills `prompt` in one go, from position 0."""
    session = Session(engine)
    session.prepare(len(prompt) + engine.settings.generation.max_new_tokens)
    assert session.sync(prompt) == len(prompt)
    return session.logits


def turn(session: Session, question: str) -> tuple[torch.Tensor, int]:
    """What `Session.ask` does, with the logits at the start of the answer kept: prefill
    the new turn, then answer. Returns those logits and how many tokens were prefilled."""
    engine = session.engine
    prompt = session.conversation.prompt_ids(engine.tokenizer, question)
    session.prepare(len(prompt) + engine.settings.generation.max_new_tokens)
    prefilled = session.sync(prompt)
    if prefilled:  # the stats keep the last prefill that computed something
        assert engine.stats().prefill_tokens == prefilled
    logits = session.logits.clone()
    answer = "".join(session.ask(question))
    assert answer.strip()
    assert session.last_prefill.prefilled == 0  # ask found the prompt cached
    return logits, prefilled


def start(engine, document_ids) -> Session:
    session = engine.new_session()
    session.conversation.document_ids = document_ids
    prefix = session.conversation.document_prefix_ids(engine.tokenizer)
    assert session.prefill_document(prefix).prefilled == len(prefix)
    return session


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_three_questions_prefill_only_new_tokens_and_equal_a_fresh_prefill(
    engine_fp32, settings_fp32, document_ids, case
):
    engine = small_engine(engine_fp32, settings_fp32, **CASES[case])
    session = start(engine, document_ids)
    for i, question in enumerate(QUESTIONS):
        cached = list(session.tokens)
        prompt = session.conversation.prompt_ids(engine.tokenizer, question)
        # The cache holds the document, every earlier turn and the answers' own tokens.
        assert common_prefix(prompt, cached) == len(cached)
        logits, prefilled = turn(session, question)
        assert prefilled == len(prompt) - len(cached)
        if i:
            assert prefilled < 40  # the question and the template around it, nothing else
        reference = fresh_logits(engine, prompt)
        assert (logits - reference).abs().max().item() < TOL
        assert logits.argmax() == reference.argmax()
    assert session.cache.stats().tokens > 330  # the turns crossed many blocks and windows


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_regenerate_and_edits_truncate_to_the_common_prefix(
    engine_fp32, settings_fp32, document_ids, case
):
    engine = small_engine(engine_fp32, settings_fp32, **CASES[case])
    session = start(engine, document_ids)
    for question in QUESTIONS[:2]:
        turn(session, question)
    conversation = session.conversation

    # Regenerate the last reply: the same prompt again, minus the reply's tokens.
    conversation.messages = conversation.messages[:-2]
    prompt = conversation.prompt_ids(engine.tokenizer, QUESTIONS[1])
    assert len(session.tokens) > len(prompt)
    logits, prefilled = turn(session, QUESTIONS[1])
    assert prefilled == 0  # the logits after the prompt were kept
    assert (logits - fresh_logits(engine, prompt)).abs().max().item() < TOL

    # Edit the first question: the document stays, everything after it is prefilled again.
    conversation.messages[0] = {"role": "user", "content": "When was it built, exactly?"}
    prompt = conversation.prompt_ids(engine.tokenizer, QUESTIONS[2])
    common = common_prefix(prompt, session.tokens)
    assert len(document_ids) < common < len(session.tokens)
    logits, prefilled = turn(session, QUESTIONS[2])
    assert prefilled == len(prompt) - common
    assert (logits - fresh_logits(engine, prompt)).abs().max().item() < TOL

    # Change the system prompt: only the template's first tokens survive.
    conversation.system = "You answer in one short sentence."
    prompt = conversation.prompt_ids(engine.tokenizer, QUESTIONS[0])
    common = common_prefix(prompt, session.tokens)
    assert common < 10
    logits, prefilled = turn(session, QUESTIONS[0])
    assert prefilled == len(prompt) - common
    assert (logits - fresh_logits(engine, prompt)).abs().max().item() < TOL
