"""The other process of the snapshot tests (test_snapshot.py runs it with a JSON task file).

`ask`: load the model, open each task's snapshot folder, load the document from its snapshot,
ask the question, and save what the original session is compared with.
`write`: save one large snapshot and kill this process (SIGKILL, as a crash or `kill -9`
does) once the write has passed `kill_at` bytes.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

from kvchat.config import Settings, load_settings
from kvchat.core.engine import Engine
from kvchat.core.snapshot import SnapshotStore
from kvchat.kv.state import CacheState

# Small cache settings over the real SmolLM2 in fp32: a 300-token document spans ten
# 32-token blocks, so every part of the sparse cache is in the snapshot.
BASE = (
    "model.dtype=float32",
    "long_context.chunk_size=64",
    "long_context.max_seq_len=4096",
    "long_context.block_size=32",
    "long_context.local_windows_len=128",
    "generation.max_new_tokens=8",
    "cache.snapshot_min_tokens=64",
)


def settings_for(extra: list[str]) -> Settings:
    return load_settings(overrides=[*BASE, *extra]).settings


def ask(tasks: list[dict]) -> None:
    base = Engine.load(settings_for([]))
    for task in tasks:
        engine = base.with_settings(settings_for(task["overrides"]))
        engine.snapshot_dir = Path(task["snapshot_dir"])
        session = engine.new_session()
        session.conversation.document_ids = task["document_ids"]
        prefix = session.conversation.document_prefix_ids(engine.tokenizer)
        report = session.prefill_document(prefix)
        prompt = session.conversation.prompt_ids(engine.tokenizer, task["question"])
        session.prepare(len(prompt) + engine.settings.generation.max_new_tokens)
        prefilled = session.sync(prompt)
        logits = session.logits.clone()
        torch.save(
            {
                "restored": report.restored.id if report.restored else None,
                "document_prefilled": report.prefilled,
                "warnings": list(report.warnings),
                "prompt_prefilled": prefilled,
                "logits": logits,
                "answer": list(session.generate()),
            },
            task["out"],
        )


def write(task: dict) -> None:
    big = torch.ones(task["n_bytes"] // 4, dtype=torch.float32)
    state = CacheState({"length": 1}, {"big": big})
    store = SnapshotStore(Path(task["snapshot_dir"]), 2 * task["n_bytes"])

    def progress(done: int, total: int) -> None:
        if done > task["kill_at"]:
            os.kill(os.getpid(), signal.SIGKILL)

    store.save(
        state, [1, 2, 3], torch.zeros(8), "model", "model", {"kv_type": "FP16"}, None, progress
    )


if __name__ == "__main__":
    mode, path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(path).read_text())
    {"ask": ask, "write": write}[mode](spec)
