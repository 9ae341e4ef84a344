"""Other engines on the same weights, for `kvchat bench speed` to measure beside kvchat.

transformers (installed with kvchat) loads the GGUF into its own fp32 model; llama.cpp
(llama-cpp-python, an optional extra: `pip install 'kvchat[baseline]'`) runs the GGUF as it
is, with its own CPU kernels for this machine, on the same number of threads. Each measures a
greedy prefill and decode as kvchat's bench does: `warmup_tokens` untimed steps after the
prefill, then `decode_tokens` timed ones.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import torch

from kvchat.core.model_files import resolve_model_path

LLAMA_CPP_PIP = "llama-cpp-python==0.3.36"


class BaselineName(enum.Enum):
    TRANSFORMERS = "transformers"
    LLAMA_CPP = "llama.cpp"


class BaselineMissingError(RuntimeError):
    """A baseline's package is not installed; the message says how to install it."""


class Baseline(Protocol):
    name: str

    def measure(self, ids: Sequence[int], decode_tokens: int, warmup_tokens: int) -> dict:
        """prefill_tok_s, decode_tok_s, warmup_tok_s, prefill_s, decode_s for prompt `ids`."""
        ...


def _rates(n_prompt: int, prefill_s: float, warmup: int, warmup_s: float, n: int, s: float):
    return {
        "prefill_tok_s": n_prompt / prefill_s,
        "decode_tok_s": n / s,
        # The untimed steps right after the prefill, before the steady rate above.
        "warmup_tok_s": warmup / warmup_s,
        "prefill_s": prefill_s,
        "decode_s": s,
    }


class TransformersBaseline:
    name = BaselineName.TRANSFORMERS.value

    def __init__(self, path: Path) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoModelForCausalLM

        if path.is_dir():
            self.model = AutoModelForCausalLM.from_pretrained(path).eval()
        else:
            self.model = AutoModelForCausalLM.from_pretrained(
                path.parent, gguf_file=path.name
            ).eval()

    def measure(self, ids: Sequence[int], decode_tokens: int, warmup_tokens: int) -> dict:
        model = self.model
        with torch.inference_mode():
            started = time.perf_counter()
            out = model(torch.tensor([list(ids)]), use_cache=True)
            prefill_s = time.perf_counter() - started
            past = out.past_key_values
            token = out.logits[0, -1].argmax().view(1, 1)
            started = time.perf_counter()
            for step in range(warmup_tokens + decode_tokens):
                if step == warmup_tokens:
                    warmup_s = time.perf_counter() - started
                    started = time.perf_counter()
                out = model(token, past_key_values=past, use_cache=True)
                past = out.past_key_values
                token = out.logits[0, -1].argmax().view(1, 1)
            decode_s = time.perf_counter() - started
        return _rates(len(ids), prefill_s, warmup_tokens, warmup_s, decode_tokens, decode_s)


class LlamaCppBaseline:
    """llama.cpp through llama-cpp-python: its default batch sizes and f16 KV cache, and flash
    attention on, as llama.cpp's own tools run on a CPU (llama-cpp-python turns it off by
    default; on, it prefills ~1.2x faster here)."""

    name = BaselineName.LLAMA_CPP.value

    def __init__(self, path: Path, n_ctx: int, threads: int) -> None:
        try:
            from llama_cpp import Llama
        except ImportError:
            raise BaselineMissingError(
                "the llama.cpp baseline needs llama-cpp-python: pip install 'kvchat[baseline]' "
                f"(or pip install {LLAMA_CPP_PIP}; it compiles llama.cpp for this CPU, several "
                "minutes)"
            ) from None
        if path.is_dir():
            raise BaselineMissingError(f"llama.cpp reads GGUF files, and {path} is a folder")
        self.llm = Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            flash_attn=True,
            verbose=False,
        )

    def _next(self, tokens: Sequence[int]) -> int:
        """Evaluate `tokens` after what the context holds; the greedy next token (from the
        last token's logits, which llama.cpp computes without keeping them: the pinned
        version's context gives them)."""
        import numpy as np

        self.llm.eval(list(tokens))
        logits = np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.llm.n_vocab(),))
        return int(logits.argmax())

    def measure(self, ids: Sequence[int], decode_tokens: int, warmup_tokens: int) -> dict:
        self.llm.reset()
        started = time.perf_counter()
        token = self._next(ids)
        prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        for step in range(warmup_tokens + decode_tokens):
            if step == warmup_tokens:
                warmup_s = time.perf_counter() - started
                started = time.perf_counter()
            token = self._next([token])
        decode_s = time.perf_counter() - started
        return _rates(len(ids), prefill_s, warmup_tokens, warmup_s, decode_tokens, decode_s)


def load_baseline(name: BaselineName, spec: str, n_ctx: int, threads: int) -> Baseline:
    """The baseline `name` on the model `spec`, for contexts up to n_ctx tokens."""
    path = resolve_model_path(spec)
    if name is BaselineName.TRANSFORMERS:
        return TransformersBaseline(path)
    return LlamaCppBaseline(path, n_ctx, threads)
