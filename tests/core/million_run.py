"""A 1M-token document through the engine's public API with a tiny random GGUF model: load,
prefill (saving a snapshot), a question and 16 reply tokens, then the snapshot loaded by a
second session. Prints one JSON line.

Usage: million_run.py KV_TYPE FOLDER. Runs in its own process (see test_million.py) so its
peak RSS is its own; FOLDER holds the model file and (as KVCHAT_HOME) the snapshot.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGUFWriter

TOKENS = 1 << 20
QUESTION = 40
REPLY = 16
VOCAB, HIDDEN, INTER, LAYERS, HEADS, KV_HEADS = 64, 32, 64, 2, 1, 1
HEAD_DIM = HIDDEN // HEADS


def write_model(path: Path) -> None:
    """A llama GGUF of random fp32 weights and a tokenizer of VOCAB plain tokens."""
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)

    writer = GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny-million")
    for key, value in {
        "block_count": LAYERS,
        "context_length": 8192,
        "embedding_length": HIDDEN,
        "feed_forward_length": INTER,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
    }.items():
        writer.add_uint32(f"llama.{key}", value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    writer.add_string("tokenizer.ggml.model", "llama")
    writer.add_array(
        "tokenizer.ggml.tokens", ["<unk>", "<s>", "</s>", *(f"t{i}" for i in range(3, VOCAB))]
    )
    writer.add_array("tokenizer.ggml.scores", [0.0] * VOCAB)
    writer.add_array("tokenizer.ggml.token_type", [2, 3, 3, *([1] * (VOCAB - 3))])
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_tensor("token_embd.weight", weight(VOCAB, HIDDEN))
    writer.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for i in range(LAYERS):
        for name, shape in {
            "attn_norm.weight": (HIDDEN,),
            "ffn_norm.weight": (HIDDEN,),
            "attn_q.weight": (HEADS * HEAD_DIM, HIDDEN),
            "attn_k.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_v.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
            "attn_output.weight": (HIDDEN, HEADS * HEAD_DIM),
            "ffn_gate.weight": (INTER, HIDDEN),
            "ffn_up.weight": (INTER, HIDDEN),
            "ffn_down.weight": (HIDDEN, INTER),
        }.items():
            data = np.ones(shape, np.float32) if len(shape) == 1 else weight(*shape)
            writer.add_tensor(f"blk.{i}.{name}", data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    kv_type, folder = sys.argv[1], Path(sys.argv[2])
    os.environ["KVCHAT_HOME"] = str(folder / "home")
    # Imported after KVCHAT_HOME is set: the snapshot folder lives under it.
    from kvchat.config import GenerationSettings, load_settings
    from kvchat.core.engine import Engine, Session
    from kvchat.core.memory import peak_rss, process_rss, reset_peak_rss
    from kvchat.core.snapshot import PrefillReport

    model = folder / "tiny.gguf"
    write_model(model)
    planned = TOKENS + QUESTION + REPLY
    settings = load_settings(
        overrides=[
            f"long_context.kv_type={kv_type}",
            f"long_context.max_seq_len={planned}",
            # A small attention span: with the defaults a query reads ~5,200 keys, which is
            # most of this run's time with a 32-wide model; what is tested here is a million
            # tokens' blocks, their memory and their snapshot.
            "long_context.chunk_size=1024",
            "long_context.local_windows_len=128",
            "long_context.second_select_num=2",
        ]
    ).settings
    engine = Engine.load(settings, str(model))
    gen = np.random.default_rng(1)
    document = gen.integers(3, VOCAB, TOKENS).tolist()
    prompt = document + gen.integers(3, VOCAB, QUESTION).tolist()
    params = GenerationSettings(temperature=0.0, max_new_tokens=REPLY)
    plan = engine.plan(planned)
    # The peak from here on, from the RSS now: getrusage's maximum would carry the parent
    # process's RSS over the exec (a pytest worker's is larger than this whole run's).
    assert reset_peak_rss(), "the peak RSS cannot be reset on this system"
    base = process_rss()

    def answer() -> tuple[Session, PrefillReport, float, list[int]]:
        """A fresh session: the document (prefilled or loaded), then the question's reply."""
        session = engine.new_session()
        started = time.perf_counter()
        report = session.prefill_document(document, planned_tokens=planned)
        seconds = time.perf_counter() - started
        session.prefill_prompt(prompt, params)
        return session, report, seconds, list(session.generate(params))

    session, cold, prefill_s, reply = answer()
    stats = session.cache_stats()
    logits = session.logits
    peak = peak_rss()
    del session
    engine.new_session()  # the first cache goes before the second is built
    _, warm, warm_s, warm_reply = answer()
    print(
        json.dumps(
            {
                "tokens": stats.tokens,
                "blocks_in_dram": stats.blocks_in_dram,
                "kv_type": kv_type,
                "reply": reply,
                "finite": bool(logits is not None and np.isfinite(logits.float().numpy()).all()),
                "rss_growth": peak - base,
                "plan_cache_bytes": plan.cache_bytes + plan.activation_bytes,
                "prefill_s": prefill_s,
                "saved": cold.saved is not None,
                "restored": warm.restored is not None and warm.prefilled == 0,
                "warm_s": warm_s,
                "warm_reply": warm_reply,
                "warnings": [*cold.warnings, *warm.warnings],
            }
        )
    )


if __name__ == "__main__":
    main()
