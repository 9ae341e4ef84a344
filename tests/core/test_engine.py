"""The Engine and Session on the real SmolLM2-135M, against transformers on the same GGUF."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch

from kvchat.core.cancel import Cancelled
from kvchat.core.documents import Document
from kvchat.core.plan import PlanRefusedError
from kvchat.core.steps import EngineStep
from kvchat.core.turns import ReplyEnd

QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def hf_model(smollm_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        smollm_path.parent, gguf_file=smollm_path.name
    ).eval()


def _chat_ids(engine, question=QUESTION):
    return engine.tokenizer.chat_ids([{"role": "user", "content": question}])


def test_logits_and_greedy_tokens_match_transformers(engine_fp32, hf_model):
    ids = _chat_ids(engine_fp32)
    session = engine_fp32.new_session()
    with torch.inference_mode():
        ours = engine_fp32.model.forward(torch.tensor(ids), session.cache, all_logits=True)
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() < 1e-4

    session = engine_fp32.new_session()
    session.sync(ids)
    greedy = replace(engine_fp32.settings.generation, temperature=0.0, max_new_tokens=32)
    mine = list(session.generate(greedy))
    with torch.inference_mode():
        theirs = hf_model.generate(
            torch.tensor([ids]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=engine_fp32.tokenizer.eos_ids[0],
        )[0, len(ids) :].tolist()
    # Stop where either model ended its turn; up to there the tokens must be identical.
    n = len(mine)
    assert n == 32 or mine[-1] in engine_fp32.tokenizer.eos_ids
    assert mine == theirs[:n]
    assert n >= 8


def test_chunked_prefill_equals_one_pass(engine_fp32, settings_fp32):
    ids = _chat_ids(engine_fp32, "Tell me about the history of Paris, briefly. " * 8)
    whole = engine_fp32.new_session().extend(ids)
    small = replace(settings_fp32, long_context=replace(settings_fp32.long_context, chunk_size=16))
    chunked = engine_fp32.with_settings(small)
    progress = []
    last = chunked.session.extend(ids, on_progress=lambda d, t: progress.append((d, t)))
    assert (last - whole).abs().max().item() < 1e-4
    assert progress[-1] == (len(ids), len(ids))
    assert [d for d, _ in progress] == sorted({d for d, _ in progress})
    # Every chunk's end, and its layers in between: a long chunk's progress moves.
    ends = {min(end, len(ids)) for end in range(16, len(ids) + 16, 16)}
    assert ends < {d for d, _ in progress}
    assert len(progress) > 4 * len(ends)


def test_cancelled_prefill_leaves_session_usable(engine_fp32, settings_fp32):
    small = replace(settings_fp32, long_context=replace(settings_fp32.long_context, chunk_size=16))
    engine = engine_fp32.with_settings(small)
    ids = _chat_ids(engine, "Summarise the plot of Hamlet in detail. " * 6)
    cancel = threading.Event()

    def stop_after_two(done, total):
        if done >= 32:
            cancel.set()

    with pytest.raises(Cancelled):
        engine.session.extend(ids, on_progress=stop_after_two, cancel=cancel)
    assert engine.session.tokens == ids[:32]
    assert engine.session.cache.length == 32
    # Resuming prefills only the rest and gives the same logits as an uncancelled run.
    assert engine.session.sync(ids) == len(ids) - 32
    fresh = engine_fp32.new_session().extend(ids)
    assert (engine.session.logits - fresh).abs().max().item() < 1e-4


@pytest.mark.parametrize("attention", ["dense", "sparse"])
def test_a_prefill_cancelled_between_layers_stops_there_and_resumes_exactly(
    engine_fp32, settings_fp32, attention
):
    # Esc during a long chunk: the chunk stops at its next layer, the cache drops it.
    lc = replace(
        settings_fp32.long_context,
        chunk_size=64,
        attention=attention,
        block_size=16,
        local_windows_len=32,
        second_select_num=2,
    )
    engine = engine_fp32.with_settings(replace(settings_fp32, long_context=lc))
    ids = _chat_ids(engine, "Summarise the plot of Hamlet in detail. " * 20)
    assert len(ids) > 192
    cancel = threading.Event()
    seen = []

    def stop_inside_the_third_chunk(done, total):
        seen.append(done)
        if done > 128 + 20:
            cancel.set()

    with pytest.raises(Cancelled):
        engine.session.extend(ids, on_progress=stop_inside_the_third_chunk, cancel=cancel)
    assert max(seen) < 192  # no layer after the one that saw the cancel
    assert engine.session.tokens == ids[:128] and engine.session.cache.length == 128
    assert engine.session.sync(ids) == len(ids) - 128
    fresh = engine.new_session().extend(ids)
    assert (engine.session.logits - fresh).abs().max().item() < 1e-4


class SetAfter(threading.Event):
    """An Event that reads as set from its `n`-th look on: a stop at a known point."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.looks, self.n = 0, n

    def is_set(self) -> bool:
        self.looks += 1
        return self.looks >= self.n


def test_a_prefill_without_progress_still_stops_between_layers(engine_fp32, settings_fp32):
    lc = replace(settings_fp32.long_context, chunk_size=64)
    engine = engine_fp32.with_settings(replace(settings_fp32, long_context=lc))
    ids = _chat_ids(engine, "Summarise the plot of Hamlet in detail. " * 20)
    assert len(ids) > 192
    # Looks: the first chunk's start and its 30 layers, then the second chunk's start and
    # five of its layers: the stop lands inside the second chunk.
    with pytest.raises(Cancelled):
        engine.session.extend(ids, cancel=SetAfter(1 + 30 + 1 + 5))
    assert engine.session.tokens == ids[:64] and engine.session.cache.length == 64


def test_generation_cancel_and_limit_say_why_the_reply_ended(engine_fp32, settings_fp32):
    session = engine_fp32.new_session()
    ids = _chat_ids(engine_fp32)
    session.sync(ids)
    params = replace(engine_fp32.settings.generation, max_new_tokens=5, temperature=0.0)
    assert len(list(session.generate(params))) == 5
    assert session.reply_end is ReplyEnd.MAX_NEW_TOKENS
    session.sync(ids)
    cancel = threading.Event()
    got = []
    for token in session.generate(replace(params, max_new_tokens=50), cancel):
        got.append(token)
        cancel.set()
    assert len(got) == 1 and session.reply_end is ReplyEnd.STOPPED
    session.sync(ids)
    reply = list(session.generate(replace(params, max_new_tokens=200)))
    assert reply[-1] in engine_fp32.tokenizer.eos_ids and session.reply_end is ReplyEnd.END_OF_TURN

    lc = replace(settings_fp32.long_context, max_seq_len=len(ids) + 3)
    tight = engine_fp32.with_settings(replace(engine_fp32.settings, long_context=lc))
    session = tight.new_session()
    session.sync(ids)
    assert len(list(session.generate(replace(params, max_new_tokens=50)))) == 4
    assert session.reply_end is ReplyEnd.FULL_CONTEXT


def test_the_step_hook_sees_every_batch_chunk_and_token_and_a_stop_there_ends_the_next(
    engine_fp32, settings_fp32
):
    lc = replace(settings_fp32.long_context, chunk_size=16, max_seq_len=131072)
    engine = engine_fp32.with_settings(replace(settings_fp32, long_context=lc))
    steps: list[EngineStep] = []
    engine.on_step = steps.append
    # 320K characters: two of the tokenizer's batches (32 pieces of 8K characters each).
    text = "Summarise the plot of Hamlet in detail. " * 8000
    ids = engine.encode_document(Document((), "hamlet.txt", text, len(text), ""))
    assert steps == [EngineStep.TOKENIZED] * 2
    steps.clear()
    session = engine.new_session()
    chat = _chat_ids(engine)
    session.sync(chat)
    assert steps == [EngineStep.PREFILLED] * -(-len(chat) // 16)
    steps.clear()
    params = replace(engine.settings.generation, max_new_tokens=4, temperature=0.0)
    assert len(list(session.generate(params))) == 4 and steps == [EngineStep.SAMPLED] * 4

    # A stop set while the engine is at a step ends the work before the next step.
    session.sync(chat)
    cancel = threading.Event()
    engine.on_step = lambda step: cancel.set()
    assert len(list(session.generate(replace(params, max_new_tokens=50), cancel))) == 1
    assert session.reply_end is ReplyEnd.STOPPED
    cancel.clear()
    with pytest.raises(Cancelled, match="tokenizing cancelled after"):
        engine.encode_document(Document((), "hamlet.txt", text, len(text), ""), cancel=cancel)
    cancel.clear()
    with pytest.raises(Cancelled, match="prefill cancelled after 16 of 100 tokens"):
        engine.new_session().extend(ids[:100], cancel=cancel)
    assert engine.session.tokens == ids[:16]


def test_follow_up_prefills_only_new_tokens(engine_fp32):
    session = engine_fp32.new_session()
    params = replace(engine_fp32.settings.generation, max_new_tokens=12, temperature=0.0)
    first = "".join(session.ask("Name a colour.", params))
    assert first
    cached = len(session.tokens)
    ids = session.conversation.prompt_ids(engine_fp32.tokenizer, "Name another one.")
    prefilled = session.sync(ids)
    # Everything up to the previous reply is reused; the re-rendered reply may differ in its
    # last token or two (re-tokenisation), never in the prefix.
    assert prefilled <= len(ids) - cached + 4
    assert prefilled < len(ids) // 2


def test_sampling_is_seeded(engine_fp32):
    params = replace(
        engine_fp32.settings.generation,
        temperature=0.9,
        top_p=0.9,
        top_k=50,
        seed=7,
        max_new_tokens=10,
    )
    runs = []
    for _ in range(2):
        session = engine_fp32.new_session()
        session.sync(_chat_ids(engine_fp32, "Write a short poem."))
        runs.append(list(session.generate(params)))
    assert runs[0] == runs[1]


def test_prompt_over_max_seq_len_is_refused_with_numbers(engine_fp32, settings_fp32):
    tight = replace(
        settings_fp32, long_context=replace(settings_fp32.long_context, max_seq_len=1024)
    )
    engine = engine_fp32.with_settings(tight)
    with pytest.raises(PlanRefusedError) as e:
        engine.check_fits(1000, 512)
    msg = str(e.value)
    assert (
        "1000" in msg and "512" in msg and "long_context.max_seq_len" in msg and "512 prompt" in msg
    )


def test_stats_snapshot(engine_fp32):
    session = engine_fp32.new_session()
    session.sync(_chat_ids(engine_fp32))
    list(session.generate(replace(engine_fp32.settings.generation, max_new_tokens=4)))
    s = engine_fp32.stats()
    assert s.context_tokens == len(session.tokens) == s.cache.tokens
    assert s.prefill_tokens > 0 and s.prefill_tok_s > 0
    assert s.attention == "sparse" and s.position_mode == "native"  # short: native positions
    assert s.rss_bytes > 0 and s.cache.resident_bytes > 0
    assert s.cache.resident_tokens == s.context_tokens  # all of it still in the local window
    with pytest.raises(AttributeError):
        s.context_tokens = 0  # type: ignore[misc]


def test_a_dense_cache_is_reserved_for_the_prompt_and_the_reply(engine_fp32, settings_fp32):
    # The plan counts prompt + max_new_tokens; a cache that grew for the reply would double.
    settings = replace(
        settings_fp32,
        long_context=replace(settings_fp32.long_context, attention="dense"),
        generation=replace(settings_fp32.generation, max_new_tokens=9),
    )
    session = engine_fp32.with_settings(settings).new_session()
    ids = session.conversation.prompt_ids(engine_fp32.tokenizer, "Name a colour.")
    session.sync(ids)
    assert session.cache._capacity == len(ids) + 9
