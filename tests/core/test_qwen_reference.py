"""Qwen2.5-Coder-0.5B (`make model-qwen`: Q5_0, Q8_0, Q4_K and Q6_K tensors) against
transformers loading the same GGUF: the fp32 engine's logits and greedy tokens, and the bf16
engine on the file's int8 and int4 groups. Skipped where the model's parts are not installed
(`make test` installs only SmolLM2, the model the suite runs on)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kvchat.core.weights import SPLIT_MODELS, WeightsError, split_model_path

QUESTION = "Write a Python function that returns the n-th Fibonacci number, with a docstring."
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def qwen_path(tmp_path_factory):
    try:
        return split_model_path(SPLIT_MODELS["qwen2.5-coder-0.5b"], tmp_path_factory.mktemp("m"))
    except WeightsError as e:
        pytest.skip(str(e))


def _run(path, dtype: str) -> tuple[object, list[int], torch.Tensor, list[int]]:
    """The engine in `dtype`: the prompt's ids, its logits, 32 greedy tokens."""
    from kvchat.config import load_settings
    from kvchat.core.engine import Engine

    settings = load_settings(overrides=[f"model.dtype={dtype}"]).settings
    engine = Engine.load(settings, str(path))
    ids = engine.tokenizer.chat_ids([{"role": "user", "content": QUESTION}])
    with torch.inference_mode():
        logits = engine.model.forward(
            torch.tensor(ids), engine.new_session().cache, all_logits=True
        )
    session = engine.new_session()
    session.sync(ids)
    greedy = replace(settings.generation, temperature=0.0, max_new_tokens=32)
    return engine, ids, logits.float(), list(session.generate(greedy))


def test_qwen_matches_transformers_in_fp32_and_stays_close_on_its_quantized_groups(qwen_path):
    from transformers import AutoModelForCausalLM

    engine, ids, exact, tokens = _run(qwen_path, "float32")
    del engine
    quantized, ids_bf16, logits, tokens_bf16 = _run(qwen_path, "bfloat16")
    # Every projection but the embedding runs on the file's integers: int4 (Q4_K), int8 (the
    # rest); the embedding is a bf16 lookup table.
    assert set(quantized.model.bytes_by_format()) == {"int4", "int8", "bfloat16"}
    del quantized
    hf = AutoModelForCausalLM.from_pretrained(
        qwen_path.parent, gguf_file=qwen_path.name, dtype=torch.float32
    ).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
        theirs = hf.generate(
            torch.tensor([ids]),
            max_new_tokens=32,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(ids) :].tolist()

    assert ids_bf16 == ids
    assert (exact - ref).abs().max().item() < 1e-4
    assert tokens == theirs  # 32 tokens (the reply does not end sooner)
    # bf16 activations on the file's exact integers: the same next tokens almost everywhere
    # (measured: 46 of 47 positions, mean KL 0.0013) and the same greedy reply here.
    kl = torch.nn.functional.kl_div(
        logits.log_softmax(-1), ref.log_softmax(-1), log_target=True, reduction="batchmean"
    )
    assert kl.item() < 0.005
    assert (logits.argmax(-1) == ref.argmax(-1)).float().mean().item() > 0.9
    assert tokens_bf16[:16] == theirs[:16]
