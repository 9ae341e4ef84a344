"""The Engine: one loaded model, its sessions, chunked prefill, generation and stats.

Headless and thread-agnostic: a UI worker thread or a script drives it; `stats()` may be
called from any thread at any time and returns an immutable snapshot.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import psutil
import torch

from kvchat.config import GenerationSettings, Settings
from kvchat.kv.backend import AttentionBackend, CacheStats
from kvchat.kv.dense import DenseBackend
from kvchat.kv.sparse import SparseBackend

from .cancel import Cancelled
from .conversation import Conversation
from .device import configure_threads, resolve_device, resolve_dtype
from .model import Transformer
from .model_config import ModelConfig
from .plan import MemoryPlan, PlanRefusedError, plan_memory
from .sampling import sample_next
from .tokenizer import Tokenizer, load_tokenizer
from .weights import load_weights, resolve_model_path

ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True)
class EngineStats:
    model: str
    architecture: str
    device: str
    dtype: str
    weight_format: str
    threads: int
    attention: str
    position_mode: str
    max_seq_len: int
    context_tokens: int
    cache: CacheStats
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    time_to_first_token: float | None
    rss_bytes: int

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


class Session:
    """The token history of one conversation and the KV cache that holds it."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._cache: AttentionBackend | None = None
        self.tokens: list[int] = []
        self.conversation = Conversation()
        self._logits: torch.Tensor | None = None  # logits after the last cached token

    @property
    def logits(self) -> torch.Tensor | None:
        """Next-token logits after the last cached token (None before any prefill)."""
        return self._logits

    @property
    def cache(self) -> AttentionBackend:
        if self._cache is None:
            self._cache = self.engine.new_cache(0)
        return self._cache

    def cache_stats(self) -> CacheStats:
        """The cache's snapshot; an empty one before the first prefill (creates nothing, so
        any thread may call it)."""
        if self._cache is not None:
            return self._cache.stats()
        lc = self.engine.settings.long_context
        mode = self.engine.position_mode_for(0)
        return CacheStats(lc.attention, 0, lc.max_seq_len, 0, lc.kv_type, mode)

    def prepare(self, planned_tokens: int) -> None:
        """Make sure the cache suits a context of `planned_tokens` (prompt + reply).

        With position_mode auto, a cache that chose native positions for a short context is
        rebuilt in extrapolate mode once the conversation outgrows the trained context; the
        next sync then prefills everything again.
        """
        wanted = self.engine.position_mode_for(planned_tokens)
        if self._cache is not None and self._cache.position_mode == wanted:
            return
        self._cache = self.engine.new_cache(planned_tokens)
        self.tokens = []
        self._logits = None

    def extend(
        self,
        ids: Sequence[int],
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> torch.Tensor:
        """Prefill `ids` after the cached tokens in chunks; returns the last token's logits.

        Cancelling stops between chunks: the chunks done stay cached and `tokens` says which,
        so a later call resumes where this one stopped.
        """
        engine = self.engine
        engine.check_fits(len(self.tokens) + len(ids), 0)
        if self._cache is None:
            self.prepare(len(self.tokens) + len(ids) + engine.settings.generation.max_new_tokens)
        chunk = min(engine.settings.long_context.chunk_size, self.cache.max_chunk or len(ids) or 1)
        self.cache.reserve(len(self.tokens) + len(ids))
        done = 0
        started = time.perf_counter()
        engine._begin_prefill()
        while done < len(ids):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"prefill cancelled after {done} of {len(ids)} tokens")
            piece = list(ids[done : done + chunk])
            with torch.inference_mode():
                self._logits = engine.model.forward(torch.tensor(piece), self.cache)[-1]
            self.tokens += piece
            done += len(piece)
            engine._record_prefill(done, time.perf_counter() - started)
            if on_progress is not None:
                on_progress(done, len(ids))
        if self._logits is None:
            raise ValueError("nothing to prefill: no tokens given and none cached")
        return self._logits

    def sync(
        self,
        ids: Sequence[int],
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> int:
        """Make the cache hold exactly `ids`, reusing the longest cached common prefix.

        Returns how many tokens had to be prefilled.
        """
        if not ids:
            raise ValueError("nothing to prefill: the prompt is empty")
        common = 0
        limit = min(len(ids), len(self.tokens))
        while common < limit and ids[common] == self.tokens[common]:
            common += 1
        if common == len(ids) == len(self.tokens) and self._logits is not None:
            return 0
        # The logits of the last prompt token are needed, so at least it is recomputed.
        common = min(common, len(ids) - 1)
        self.truncate(common)
        self.extend(ids[common:], on_progress, cancel)
        return len(ids) - common

    def truncate(self, n_tokens: int) -> None:
        if n_tokens < len(self.tokens):
            self.cache.truncate(n_tokens)
            del self.tokens[n_tokens:]
            self._logits = None

    def generate(
        self,
        params: GenerationSettings | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        """Yield reply tokens after the cached prompt until an end-of-turn token, the
        max_new_tokens limit, or `cancel`. Every yielded token except the last is cached."""
        engine = self.engine
        params = params or engine.settings.generation
        if self._logits is None:
            raise RuntimeError("generate() needs a prefilled prompt first")
        generator = None
        if params.temperature > 0:
            generator = torch.Generator().manual_seed(
                params.seed if params.seed >= 0 else torch.seed()
            )
        eos = set(engine.tokenizer.eos_ids)
        reply: list[int] = []
        engine._begin_decode()
        started = time.perf_counter()
        for _ in range(params.max_new_tokens):
            if cancel is not None and cancel.is_set():
                return
            token = sample_next(self._logits, params, reply, generator)
            if not reply:
                engine._record_first_token()
            reply.append(token)
            yield token
            if token in eos or len(reply) == params.max_new_tokens:
                return
            if len(self.tokens) + 1 > engine.settings.long_context.max_seq_len:
                return
            with torch.inference_mode():
                self._logits = engine.model.forward(torch.tensor([token]), self.cache)[-1]
            self.tokens.append(token)
            engine._record_decode(len(reply), time.perf_counter() - started)

    def ask(
        self,
        question: str,
        params: GenerationSettings | None = None,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[str]:
        """One chat turn: prefill what is new, then stream the reply as text pieces."""
        engine = self.engine
        params = params or engine.settings.generation
        ids = self.conversation.prompt_ids(engine.tokenizer, question)
        engine.check_fits(len(ids), params.max_new_tokens)
        self.prepare(len(ids) + params.max_new_tokens)
        self.sync(ids, on_progress, cancel)
        decoder = engine.tokenizer.stream_decoder()
        eos = set(engine.tokenizer.eos_ids)
        pieces: list[str] = []
        try:
            for token in self.generate(params, cancel):
                if token in eos:
                    break
                text = decoder.push(token)
                if text:
                    pieces.append(text)
                    yield text
        finally:
            self.conversation.add_turn(question, "".join(pieces))


class Engine:
    """One loaded model. Create with `Engine.load`; drive from one thread at a time."""

    def __init__(
        self,
        settings: Settings,
        model: Transformer,
        tokenizer: Tokenizer,
        source: Path,
        threads: int,
        weight_format: str,
    ) -> None:
        self.settings = settings
        self.model = model
        self.tokenizer = tokenizer
        self.source = source
        self.threads = threads
        self.weight_format = weight_format
        self._prefill = (0, 0.0)
        self._decode = (0, 0.0)
        self._ttft: float | None = None
        self._turn_started = 0.0
        self.session = Session(self)

    @classmethod
    def load(cls, settings: Settings, model_spec: str | None = None) -> Engine:
        """Load weights and tokenizer for `model_spec` (default: settings.model.path)."""
        spec = model_spec or settings.model.path
        if model_spec:
            settings = replace(settings, model=replace(settings.model, path=model_spec))
        source = resolve_model_path(spec)
        device = resolve_device(settings.model.device)
        dtype = resolve_dtype(settings.model.dtype, device)
        threads = configure_threads(settings.long_context.threads_num or settings.model.threads)
        weights = load_weights(source)
        # Packed int4 keeps the file's exact 4-bit weights; its kernel wants bf16 activations.
        weight_format = "int4" if dtype == torch.bfloat16 and device.type == "cpu" else "dense"
        model = Transformer(weights, dtype=dtype, device=device, weight_format=weight_format)
        tokenizer = load_tokenizer(source)
        return cls(settings, model, tokenizer, source, threads, weight_format)

    def with_settings(self, settings: Settings) -> Engine:
        """Another Engine over the same loaded weights and tokenizer, with other settings
        (e.g. another cache type), for comparisons in one process."""
        return Engine(
            settings, self.model, self.tokenizer, self.source, self.threads, self.weight_format
        )

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    def position_mode_for(self, planned_tokens: int) -> str:
        """`native` while the context fits what the model was trained on, else `extrapolate`."""
        lc = self.settings.long_context
        if lc.attention == "dense":
            return "native"  # dense attention has no way to extrapolate
        if lc.position_mode != "auto":
            return lc.position_mode
        return "native" if planned_tokens <= self.config.trained_context else "extrapolate"

    def new_cache(self, planned_tokens: int) -> AttentionBackend:
        """An empty cache for a conversation expected to reach `planned_tokens`."""
        lc = self.settings.long_context
        cfg, model = self.config, self.model
        if lc.attention == "dense":
            return DenseBackend(
                cfg.num_layers,
                cfg.num_kv_heads,
                cfg.head_dim,
                model.rope,
                model.dtype,
                model.device,
                lc.max_seq_len,
            )
        return SparseBackend(
            cfg.num_layers,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            model.rope,
            model.dtype,
            model.device,
            lc,
            self.position_mode_for(planned_tokens),
            lc.max_seq_len,
            cfg.trained_context,
        )

    def new_session(self) -> Session:
        """Drop the current conversation and its cache and start an empty one."""
        self.session = Session(self)
        return self.session

    def update_settings(self, settings: Settings) -> None:
        """Apply settings that need no new cache (generation parameters)."""
        self.settings = replace(self.settings, generation=settings.generation)

    def plan(self, n_tokens: int) -> MemoryPlan:
        """Memory a context of n_tokens needs with the current settings, against what is free."""
        held = self.session.cache_stats()
        return plan_memory(
            self.config,
            self.settings.long_context,
            n_tokens,
            self.model.dtype.itemsize,
            self.model.nbytes,
            psutil.virtual_memory().available,
            held.kv_bytes + held.anchor_bytes + held.resident_bytes,
        )

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """Refuse, before any computation, a prompt the settings or the memory cannot hold."""
        lc = self.settings.long_context
        if n_prompt + max_new_tokens > lc.max_seq_len:
            raise PlanRefusedError(
                f"the prompt has {n_prompt} tokens and up to {max_new_tokens} may be generated, "
                f"but long_context.max_seq_len is {lc.max_seq_len}: at most "
                f"{lc.max_seq_len - max_new_tokens} prompt tokens fit. Raise "
                f"long_context.max_seq_len or lower generation.max_new_tokens "
                f"(e.g. --set long_context.max_seq_len={_round_up(n_prompt + max_new_tokens)})."
            )
        plan = self.plan(n_prompt + max_new_tokens)
        if not plan.fits:
            raise PlanRefusedError(plan.refusal())

    def prefill(
        self,
        ids: Sequence[int],
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> torch.Tensor:
        """Prefill `ids` after what the current session holds; returns the last logits."""
        session = self.session
        history = [*session.tokens, *ids]
        session.prepare(len(history) + self.settings.generation.max_new_tokens)
        session.sync(history, on_progress, cancel)
        return session.logits

    def generate(
        self, params: GenerationSettings | None = None, cancel: threading.Event | None = None
    ) -> Iterator[int]:
        return self.session.generate(params, cancel)

    # Progress bookkeeping, written by the driving thread and read by stats() from any thread.
    def _begin_prefill(self) -> None:
        self._turn_started = time.perf_counter()
        self._ttft = None
        self._prefill = (0, 0.0)

    def _record_prefill(self, tokens: int, seconds: float) -> None:
        self._prefill = (tokens, seconds)

    def _begin_decode(self) -> None:
        self._decode = (0, 0.0)

    def _record_first_token(self) -> None:
        if self._turn_started and self._ttft is None:
            self._ttft = time.perf_counter() - self._turn_started

    def _record_decode(self, tokens: int, seconds: float) -> None:
        self._decode = (tokens, seconds)

    def stats(self) -> EngineStats:
        cache = self.session.cache_stats()
        cfg = self.config
        return EngineStats(
            model=cfg.name or self.source.name,
            architecture=cfg.architecture,
            device=str(self.model.device),
            dtype=str(self.model.dtype).removeprefix("torch."),
            weight_format=self.weight_format,
            threads=self.threads,
            attention=cache.backend,
            position_mode=cache.position_mode,
            max_seq_len=self.settings.long_context.max_seq_len,
            context_tokens=len(self.session.tokens),
            cache=cache,
            prefill_tokens=self._prefill[0],
            prefill_seconds=self._prefill[1],
            decode_tokens=self._decode[0],
            decode_seconds=self._decode[1],
            time_to_first_token=self._ttft,
            rss_bytes=psutil.Process().memory_info().rss,
        )


def _round_up(n: int, step: int = 4096) -> int:
    return -(-n // step) * step
