"""The Engine: one loaded model, its sessions, chunked prefill, generation and stats.

Headless and thread-agnostic: a UI worker thread or a script drives it; `stats()` may be
called from any thread at any time and returns an immutable snapshot.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import BinaryIO

import torch

from kvchat.config import (
    AttentionMode,
    GenerationSettings,
    LongContextSettings,
    PositionMode,
    Settings,
    changed_keys,
)
from kvchat.kv.backend import AttentionBackend, CacheStats
from kvchat.kv.dense import DenseBackend
from kvchat.kv.kernels import cpu_kernels
from kvchat.kv.sparse import RETUNABLE, SparseBackend
from kvchat.kv.state import StateMismatchError
from kvchat.native.cpu import LEVEL_ENV, cpu_level, cpu_name, machine_level, widened_products

from . import cpu_ops
from .cancel import Cancelled
from .conversation import Conversation
from .device import configure_threads, resolve_device, resolve_dtype
from .documents import Document, DocumentTooLongError
from .fit import Fit, PlanAt, fit_context, largest_context, round_up
from .memory import (
    GpuMemory,
    available_memory,
    gpu_memory,
    process_rss,
    release_freed_memory,
)
from .model import Transformer, decoder_ops
from .model_config import ModelConfig
from .model_files import load_weights, resolve_model_path
from .plan import MemoryPlan, PlanRefusedError, check_model_fits, plan_memory
from .sampling import sample_next
from .snapshot import (
    PrefillReport,
    SnapshotError,
    SnapshotInfo,
    SnapshotStore,
    cache_settings,
    cap_bytes,
    model_identity,
    snapshot_dir,
)
from .sources import read_sources
from .steps import EngineStep, StepHook
from .tokenizer import Tokenizer, TooManyTokensError, load_tokenizer
from .turns import ProgressFn, ReplyEnd, Turns
from .weight_plan import planned_weights

EFFECTS = ("live", "cache", "reload")


def setting_effect(key: str) -> str:
    """When a changed `section.key` takes effect: "live" (from the next token on), "cache"
    (with a new KV cache, i.e. once the context is prefilled again) or "reload" (once the
    model is loaded again)."""
    section, name = key.split(".")
    if section == "model" or key == "long_context.threads_num":
        return "reload"
    if section == "long_context" and name not in RETUNABLE:
        return "cache"
    return "live"


def _cache_shape(lc: LongContextSettings) -> dict[str, object]:
    """The values a built cache cannot change."""
    return {k: v for k, v in asdict(lc).items() if setting_effect(f"long_context.{k}") == "cache"}


@dataclass(frozen=True)
class ApplyResult:
    """The changed keys of `Engine.apply_settings`, by `setting_effect`."""

    live: tuple[str, ...]
    cache: tuple[str, ...]
    reload: tuple[str, ...]


class Rates:
    """Prefill and decode rates from a stats record's token counts and seconds."""

    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0


@dataclass(frozen=True)
class EngineStats(Rates):
    model: str
    architecture: str
    device: str
    dtype: str
    weight_format: str
    threads: int
    attention: AttentionMode
    position_mode: PositionMode
    max_seq_len: int
    context_tokens: int
    cache: CacheStats
    prefill_tokens: int
    prefill_seconds: float
    decode_tokens: int
    decode_seconds: float
    time_to_first_token: float | None
    rss_bytes: int
    available_bytes: int  # host memory this process can still take (core/memory.py)
    gpu: GpuMemory | None  # the CUDA device's memory, all processes; None elsewhere


class Throughput:
    """The prefill and decode progress of the running (or last) turn, as `Engine.stats()`
    reports it: written by the thread that drives the engine, read from any thread (each
    record is one value, replaced whole)."""

    def __init__(self) -> None:
        self.prefill = (0, 0.0)  # tokens, seconds
        self.decode = (0, 0.0)
        self.time_to_first_token: float | None = None
        self._turn_started = 0.0

    def begin_prefill(self) -> None:
        """A prefill starts: its tokens, and the turn's first reply token, count from now."""
        self._turn_started = time.perf_counter()
        self.time_to_first_token = None
        self.prefill = (0, 0.0)

    def record_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill = (tokens, seconds)

    def begin_decode(self) -> None:
        self.decode = (0, 0.0)

    def record_first_token(self) -> None:
        """The turn's first reply token is sampled: the time since its prefill began."""
        if self._turn_started and self.time_to_first_token is None:
            self.time_to_first_token = time.perf_counter() - self._turn_started

    def record_decode(self, tokens: int, seconds: float) -> None:
        self.decode = (tokens, seconds)


class Session(Turns[Conversation]):
    """The token history of one conversation and the KV cache that holds it."""

    def __init__(self, engine: Engine, conversation: Conversation | None = None) -> None:
        super().__init__(conversation if conversation is not None else Conversation())
        self.engine = engine
        self._cache: AttentionBackend | None = None
        self._built_with: LongContextSettings | None = None  # the settings of _cache
        self.tokens: list[int] = []
        self._logits: torch.Tensor | None = None  # logits after the last cached token
        # The last synced prompt's length and the logits after it: a prompt asked again (a
        # regenerated reply) samples from the same logits, not ones its last token recomputes
        # through the one-token path, whose products round differently on some CPUs.
        self._prompt_logits: tuple[int, torch.Tensor] | None = None
        self.last_prefill = PrefillReport()  # what the last sync computed, loaded, warned
        # An extrapolating cache stays so when a shorter context comes (a server's): else one
        # client's long request and the next one's short one rebuild the cache in turn, each
        # prefilling the document again.
        self.keep_extrapolating = False

    @property
    def logits(self) -> torch.Tensor | None:
        """Next-token logits after the last cached token (None before any prefill)."""
        return self._logits

    @property
    def cache(self) -> AttentionBackend:
        if self._cache is None:
            self._new_cache(0)
        assert self._cache is not None
        return self._cache

    @property
    def stale(self) -> bool:
        """The cache was built with cache-shaping settings that have changed since; the next
        prepare() (every question makes one) or rebuild() replaces it."""
        built, now = self._built_with, self.engine.settings.long_context
        return built is not None and _cache_shape(built) != _cache_shape(now)

    def _new_cache(self, planned_tokens: int) -> None:
        self.drop_cache()
        self._cache = self.engine.new_cache(planned_tokens)
        self._built_with = self.engine.settings.long_context
        self.tokens = []
        self._logits = self._prompt_logits = None

    def drop_cache(self) -> None:
        """Let go of the cache and give its memory back to the OS before anything new is
        allocated: freed blocks otherwise stay in the allocator's arenas, and the process
        would outgrow the memory plan of the next cache."""
        if self._cache is None:
            return
        self._cache = None
        self.tokens = []
        self._logits = self._prompt_logits = None
        gc.collect()
        release_freed_memory()

    def cache_stats(self) -> CacheStats:
        """The cache's snapshot; an empty one before the first prefill (creates nothing, so
        any thread may call it)."""
        cache = self._cache  # read once: the engine's thread may replace it meanwhile
        if cache is not None:
            return cache.stats()
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
        cache = self._cache
        if cache is not None and not self.stale:
            kept = self.keep_extrapolating and cache.position_mode == PositionMode.EXTRAPOLATE
            if cache.position_mode == wanted or kept:
                return
        self._new_cache(planned_tokens)

    def rebuild(
        self, on_progress: ProgressFn | None = None, cancel: threading.Event | None = None
    ) -> int:
        """Prefill the cached tokens again into a new cache made with the current settings;
        returns how many. Refused before anything changes when they no longer fit."""
        tokens = list(self.tokens)
        max_new = self.engine.settings.generation.max_new_tokens
        self.engine.check_fits(len(tokens), max_new)
        self._new_cache(len(tokens) + max_new)
        if tokens:
            self.extend(tokens, on_progress, cancel)
        return len(tokens)

    def retune(self) -> None:
        """Hand the engine's retunable long_context values to the cache built already."""
        if isinstance(self._cache, SparseBackend):
            self._cache.retune(self.engine.settings.long_context)

    def extend(
        self,
        ids: Sequence[int],
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> torch.Tensor:
        """Prefill `ids` after the cached tokens in chunks; returns the last token's logits.

        Cancelling stops at the next layer: the chunk under way is dropped, the chunks done
        stay cached and `tokens` says which, so a later call resumes where this one stopped.
        """
        engine = self.engine
        engine.check_fits(len(self.tokens) + len(ids), 0)
        if self._cache is None:
            self.prepare(len(self.tokens) + len(ids) + engine.settings.generation.max_new_tokens)
        chunk = min(engine.settings.long_context.chunk_size, self.cache.max_chunk or len(ids) or 1)
        # The reply's tokens too: the plan counts them, and the dense cache grows for them by
        # doubling (without them a 32K context's first reply token takes it 0.2 GiB past its plan).
        reply = engine.settings.generation.max_new_tokens
        self.cache.reserve(len(self.tokens) + len(ids) + reply)
        if len(ids) > chunk:
            # Tokenizing a long document leaves its temporaries in the allocator's arenas
            # (~57 MB at 128K tokens): give them back before the cache grows past them.
            release_freed_memory()
        done = reported = 0
        n_layers = engine.config.num_layers

        def layer_done(layer: int) -> None:
            # A chunk at 1M tokens takes seconds: Esc stops it and its layers move the
            # progress.
            nonlocal reported
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"prefill cancelled after {done} of {len(ids)} tokens")
            at = done + len(piece) * layer // n_layers
            if on_progress is not None and reported < at < done + len(piece):
                reported = at
                on_progress(at, len(ids))

        started = time.perf_counter()
        engine.throughput.begin_prefill()
        while done < len(ids):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"prefill cancelled after {done} of {len(ids)} tokens")
            piece = list(ids[done : done + chunk])
            with torch.inference_mode():
                self._logits = engine.model.forward(
                    torch.tensor(piece),
                    self.cache,
                    on_layer=None if on_progress is None and cancel is None else layer_done,
                )[-1]
            self.tokens += piece
            done += len(piece)
            # A chunk's temporaries, freed into the heap between the cache's long-lived
            # buffers, stay resident until trimmed; held over a long prefill and into the next
            # session they add 80 MB to a 16K session's RSS, and 8 MB when trimmed here (at no
            # measurable prefill cost).
            release_freed_memory()
            engine.throughput.record_prefill(done, time.perf_counter() - started)
            if on_progress is not None:
                reported = done
                on_progress(done, len(ids))
            engine.step_done(EngineStep.PREFILLED)
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
        if cancel is not None and cancel.is_set():  # a stop raises here, even with all cached
            raise Cancelled("stopped before the prompt was prefilled")
        common = 0
        limit = min(len(ids), len(self.tokens))
        while common < limit and ids[common] == self.tokens[common]:
            common += 1
        kept = self._prompt_logits
        if common == len(ids) and kept is not None and kept[0] == len(ids):
            self.truncate(len(ids))
            self._logits = kept[1]
        if common == len(ids) == len(self.tokens) and self._logits is not None:
            self.last_prefill = PrefillReport()
            self._prompt_logits = (len(ids), self._logits)
            return 0
        report = self.last_prefill = self._restore_snapshot(ids, common)
        # A snapshot replaces the cache; a failed attempt leaves it empty.
        common = len(self.tokens) if report.restored else min(common, len(self.tokens))
        if report.restored is None or common < len(ids):
            # The logits of the last prompt token are needed, so at least it is recomputed.
            common = min(common, len(ids) - 1)
            self.truncate(common)
            self.extend(ids[common:], on_progress, cancel)
            self.last_prefill = replace(report, prefilled=len(ids) - common)
        assert self._logits is not None
        self._prompt_logits = (len(ids), self._logits)
        return len(ids) - common

    def _restore_snapshot(self, ids: Sequence[int], cached: int) -> PrefillReport:
        """Load the longest usable snapshot of a prefix of `ids` into the cache, when it would
        spare a prefill of cache.snapshot_min_tokens or more beyond the `cached` tokens."""
        engine = self.engine
        store = engine.snapshots
        if store is None or len(ids) - cached < engine.settings.cache.snapshot_min_tokens:
            return PrefillReport()
        planned = len(ids) + engine.settings.generation.max_new_tokens
        if self._cache is None or self.stale:
            self.prepare(planned)
        started = time.perf_counter()
        settings = engine.snapshot_settings(self.cache.position_mode)
        cached = min(cached, len(self.tokens))  # prepare() may have replaced the cache
        lookup = store.find(ids, engine.model_id, settings, longer_than=cached)
        found = lookup.snapshot
        if found is None:
            return PrefillReport(warnings=lookup.warnings)
        try:
            self.cache.load_state(found.state)
        except StateMismatchError as e:
            self._new_cache(planned)
            why = f"snapshot {found.info.id} does not fit this cache ({e}); ignored"
            return PrefillReport(warnings=(*lookup.warnings, why))
        self.tokens, self._logits = list(found.tokens), found.logits.clone()
        return PrefillReport(
            restored=found.info,
            restore_seconds=time.perf_counter() - started,
            warnings=lookup.warnings,
        )

    def save_snapshot(
        self, on_progress: ProgressFn | None = None, cancel: threading.Event | None = None
    ) -> SnapshotInfo:
        """Write the cache, its tokens and the last logits to the snapshot folder (an
        identical snapshot already there is only marked as used). `on_progress` follows the
        bytes written; `cancel` stops the write and keeps nothing."""
        engine = self.engine
        store = engine.snapshots
        if store is None:
            raise SnapshotError("snapshots are off (cache.snapshots is false)")
        if not self.tokens or self._logits is None:
            raise SnapshotError("nothing to save: no prefilled tokens")
        rate = engine.stats().prefill_tok_s
        with torch.inference_mode():
            return store.save(
                self.cache.export_state(),
                self.tokens,
                self._logits,
                engine.model_id,
                engine.config.name or engine.source.name,
                engine.snapshot_settings(self.cache.position_mode),
                rate or None,
                on_progress,
                cancel,
            )

    def prefill_document(
        self,
        ids: Sequence[int],
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
        planned_tokens: int | None = None,
        on_saving: ProgressFn | None = None,
    ) -> PrefillReport:
        """Prefill a document prefix so that questions only prefill themselves: loaded from a
        snapshot when one holds it, and saved as one (cache settings) after a prefill of at
        least cache.snapshot_min_tokens tokens. `on_saving` follows the save's bytes; a
        cancel during the save keeps the prefilled cache and no snapshot (a warning)."""
        engine = self.engine
        self.prepare(planned_tokens or len(ids) + engine.settings.generation.max_new_tokens)
        self.sync(ids, on_progress, cancel)
        report = self.last_prefill
        if engine.snapshots is None or report.prefilled < engine.settings.cache.snapshot_min_tokens:
            return report
        try:
            report = replace(report, saved=self.save_snapshot(on_saving, cancel))
        except (SnapshotError, OSError) as e:
            report = replace(report, warnings=(*report.warnings, f"snapshot not saved: {e}"))
        self.last_prefill = report
        return report

    def truncate(self, n_tokens: int) -> None:
        if n_tokens < len(self.tokens):
            self.cache.truncate(n_tokens)
            del self.tokens[n_tokens:]
            self._logits = None
            if self._prompt_logits is not None and self._prompt_logits[0] > n_tokens:
                self._prompt_logits = None

    def generate(
        self,
        params: GenerationSettings | None = None,
        cancel: threading.Event | None = None,
    ) -> Iterator[int]:
        """Yield reply tokens after the cached prompt until an end-of-turn token, the
        max_new_tokens limit, a full context or `cancel`; `reply_end` says which. Every
        yielded token except the last is cached."""
        self.reply_end = None
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
        engine.throughput.begin_decode()
        started = time.perf_counter()
        while True:
            if cancel is not None and cancel.is_set():
                self.reply_end = ReplyEnd.STOPPED
                return
            token = sample_next(self._logits, params, reply, generator)
            if not reply:
                engine.throughput.record_first_token()
            reply.append(token)
            engine.step_done(EngineStep.SAMPLED)
            yield token
            if token in eos:
                self.reply_end = ReplyEnd.END_OF_TURN
            elif len(reply) == params.max_new_tokens:
                self.reply_end = ReplyEnd.MAX_NEW_TOKENS
            elif len(self.tokens) + 1 > engine.settings.long_context.max_seq_len:
                self.reply_end = ReplyEnd.FULL_CONTEXT
            if self.reply_end is not None:
                return
            with torch.inference_mode():
                self._logits = engine.model.forward(torch.tensor([token]), self.cache)[-1]
            self.tokens.append(token)
            engine.throughput.record_decode(len(reply), time.perf_counter() - started)

    def prefill_prompt(
        self,
        ids: Sequence[int],
        params: GenerationSettings,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
    ) -> None:
        """Prefill what the cache lacks of the prompt `ids`; refused before any work when the
        prompt and its reply do not fit."""
        self.engine.check_fits(len(ids), params.max_new_tokens)
        self.prepare(len(ids) + params.max_new_tokens)
        self.sync(ids, on_progress, cancel)

    def stream_reply(
        self, params: GenerationSettings, cancel: threading.Event | None = None
    ) -> Iterator[tuple[int, str]]:
        """Each reply token after the prefilled prompt with the text it completes (often "",
        mid-character), until the end-of-turn token (not yielded), max_new_tokens, a full
        context or `cancel`."""
        tokenizer = self.engine.tokenizer
        decoder = tokenizer.stream_decoder()
        eos = set(tokenizer.eos_ids)
        for token in self.generate(params, cancel):
            if token in eos:
                return
            yield token, decoder.push(token)

    def _reply(
        self,
        before: Conversation,
        question: str,
        params: GenerationSettings,
        on_progress: ProgressFn | None,
        cancel: threading.Event | None,
    ) -> Iterator[str]:
        """Prefill the prompt (a refusal or a stop raises here), then stream the reply."""
        ids = before.prompt_ids(self.engine.tokenizer, question)
        self.prefill_prompt(ids, params, on_progress, cancel)
        return (text for _, text in self.stream_reply(params, cancel) if text)


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
        self.throughput = Throughput()
        self.snapshot_dir = snapshot_dir()
        # The process's memory besides weights and cache (interpreter, libraries, tokenizer),
        # which a plan must count too; measured once the model is loaded.
        self.runtime_bytes = max(process_rss() - model.nbytes, 0)
        self.session = Session(self)
        self.on_step: StepHook | None = None  # called on the engine's thread (core/steps.py)

    @classmethod
    def load(
        cls,
        settings: Settings,
        model_spec: str | None = None,
        on_progress: ProgressFn | None = None,
    ) -> Engine:
        """Load weights and tokenizer for `model_spec` (default: settings.model.path);
        `on_progress(done, total)` follows the weight tensors read, the longest part."""
        spec = model_spec or settings.model.path
        if model_spec:
            settings = replace(settings, model=replace(settings.model, path=model_spec))
        source = resolve_model_path(spec)
        device = resolve_device(settings.model.device)
        dtype = resolve_dtype(settings.model.dtype)
        threads = configure_threads(settings.long_context.threads_num or settings.model.threads)
        # The first process on a machine compiles the CPU kernels (~30-80 s): let loading pay
        # it, not the first question.
        cpu_kernels(device)
        weights = load_weights(source, on_progress)  # the header: no tensor is read yet
        # Packed int4 keeps the file's exact 4-bit weights; its kernel wants bf16 activations.
        weight_format = "int4" if dtype == torch.bfloat16 and device.type == "cpu" else "dense"
        if device.type == "cpu":
            held = planned_weights(
                weights, weight_format, dtype, device, decoder_ops(device, dtype)
            )
            check_model_fits(
                weights.config, settings.long_context, dtype.itemsize, held, process_rss()
            )
        model = Transformer(weights, dtype=dtype, device=device, weight_format=weight_format)
        del weights  # the file's reader and metadata; the model holds its own format
        gc.collect()
        release_freed_memory()
        tokenizer = load_tokenizer(source)
        return cls(settings, model, tokenizer, source, threads, weight_format)

    def with_settings(self, settings: Settings) -> Engine:
        """Another Engine over the same loaded weights and tokenizer, with other settings
        (e.g. another cache type), for comparisons in one process."""
        engine = Engine(
            settings, self.model, self.tokenizer, self.source, self.threads, self.weight_format
        )
        engine.snapshot_dir = self.snapshot_dir
        engine.runtime_bytes = self.runtime_bytes
        return engine

    def step_done(self, step: EngineStep) -> None:
        if self.on_step is not None:
            self.on_step(step)

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg

    @property
    def snapshots(self) -> SnapshotStore | None:
        """The snapshot folder under the current cache settings; None when they are off."""
        c = self.settings.cache
        return (
            SnapshotStore(self.snapshot_dir, cap_bytes(c.snapshot_max_gib)) if c.snapshots else None
        )

    @property
    def model_id(self) -> str:
        """What snapshots know the model by (core/snapshot.py model_identity)."""
        return model_identity(self.source)

    def snapshot_settings(self, position_mode: PositionMode) -> dict[str, object]:
        """The settings a snapshot of a cache in `position_mode` must share with its user."""
        dtype = str(self.model.dtype).removeprefix("torch.")
        lc = self.settings.long_context
        return cache_settings(lc, position_mode, dtype, self.weight_format, self.config)

    def position_mode_for(self, planned_tokens: int) -> PositionMode:
        """`native` while the context fits what the model was trained on, else `extrapolate`."""
        lc = self.settings.long_context
        if lc.attention == AttentionMode.DENSE:
            return PositionMode.NATIVE  # dense attention has no way to extrapolate
        if lc.position_mode != PositionMode.AUTO:
            return lc.position_mode
        if planned_tokens <= self.config.trained_context:
            return PositionMode.NATIVE
        return PositionMode.EXTRAPOLATE

    def new_cache(self, planned_tokens: int) -> AttentionBackend:
        """An empty cache for a conversation expected to reach `planned_tokens`."""
        lc = self.settings.long_context
        cfg, model = self.config, self.model
        if lc.attention == AttentionMode.DENSE:
            return DenseBackend(
                cfg.num_layers,
                cfg.num_kv_heads,
                cfg.head_dim,
                model.rope,
                model.dtype,
                model.device,
                lc.max_seq_len,
            )
        geom = model.cache_geometry(lc.max_seq_len)
        return SparseBackend(geom, model.rope, lc, self.position_mode_for(planned_tokens))

    def new_session(self, conversation: Conversation | None = None) -> Session:
        """Drop the current conversation and its cache and start a new one: empty, or going
        on from `conversation` (e.g. a saved one, or one over a newly loaded document)."""
        self.session.drop_cache()
        self.session = Session(self, conversation)
        return self.session

    def apply_settings(self, settings: Settings) -> ApplyResult:
        """Take the values of `settings`, except those of the loaded model.

        Live values act from the next token on. Cache-shaping ones make the session's cache
        stale: it is replaced, and the context prefilled again, by Session.rebuild() or the
        next question. threads_num keeps its value until the model is loaded again. The
        model section is not read (this engine's names the model it loaded, which --model
        may have chosen), so its keys are not in the result.
        """
        old = self.settings
        changed = [key for key in changed_keys(old, settings) if not key.startswith("model.")]
        lc = replace(settings.long_context, threads_num=old.long_context.threads_num)
        self.settings = replace(settings, model=old.model, long_context=lc)
        self.session.retune()
        return ApplyResult(
            *(tuple(key for key in changed if setting_effect(key) == e) for e in EFFECTS)
        )

    def compute_summary(self) -> str:
        """One line on how this engine computes: the CPU level and its kernels, the dtype, the
        weight format and how large products run (for `kvchat plan` and -v)."""
        model, device = self.model, self.model.device
        dtype = str(model.dtype).removeprefix("torch.")
        if device.type != "cpu":
            return f"compute: {device.type}, {dtype}, weights {self.weight_format}"
        level = cpu_level()
        kernels = {
            "attention": cpu_kernels(device) is not None,
            "weight products": cpu_ops.load() is not None,
        }
        built = ", ".join(f"{k} {'C++' if ok else 'torch'}" for k, ok in kernels.items())
        products = dtype
        if widened_products(device, model.dtype):
            # Packed int4 weights keep their integer product for many rows, and int8 ones with
            # VNNI (core/linear.py); the rest runs in fp32.
            ops = cpu_ops.load()
            kernels = []
            if ops is not None and self.weight_format == "int4":
                kernels += ["int4"] if ops.int4_vectorized else []
                kernels += ["int8"] if ops.integer_products == "avx512-vnni" else []
            products = "fp32 on widened bf16"
            if kernels:
                products = f"{' and '.join(kernels)} integer kernels, else {products}"
        lowered = f" ({LEVEL_ENV}; the CPU runs {machine_level().value})"
        return (
            f"compute: {cpu_name()}, {level.value} kernels"
            f"{lowered if level is not machine_level() else ''}; {dtype} activations and KV; "
            f"weights {self.weight_format}; {built}; prefill products {products}; "
            f"{self.threads} threads"
        )

    def plan(self, n_tokens: int) -> MemoryPlan:
        """Memory a context of n_tokens needs with the current settings, against what is free."""
        return self.plan_at(self.settings.long_context, n_tokens)

    def plan_at(self, lc: LongContextSettings, n_tokens: int) -> MemoryPlan:
        """Memory a context of n_tokens needs with the long-context settings `lc`."""
        return self.planner()(lc, n_tokens)

    def planner(self) -> PlanAt:
        """plan_at on the machine as it is now: free memory and the cache held are read once,
        so a search over many contexts (core/fit.py) plans them all on the same numbers."""
        held = self.session.cache_stats()
        held_bytes = held.kv_bytes + held.anchor_bytes + held.resident_bytes
        available = available_memory()

        def plan_at(lc: LongContextSettings, n_tokens: int) -> MemoryPlan:
            return plan_memory(
                self.config,
                lc,
                n_tokens,
                self.model.dtype.itemsize,
                self.model.nbytes,
                available,
                held_bytes,
                self.runtime_bytes,
            )

        return plan_at

    def fit(self, n_prompt: int) -> Fit | None:
        """The settings under which a prompt of n_prompt tokens and its reply fit (core/fit.py):
        None when the current ones hold it; PlanRefusedError when nothing does."""
        n_tokens = n_prompt + self.settings.generation.max_new_tokens
        return fit_context(self.settings.long_context, n_tokens, self.planner())

    def apply_fit(self, fit: Fit) -> None:
        """Take `fit`'s long-context settings (for this engine; the config file is not
        written): the next cache is made with them."""
        self.apply_settings(replace(self.settings, long_context=fit.long_context))

    def _reading_limit(self, fitting: bool) -> int:
        lc = self.settings.long_context
        return largest_context(lc, self.planner()) if fitting else lc.max_seq_len

    def read_document(
        self, *paths: str | Path, stdin: BinaryIO | None = None, fitting: bool = False
    ) -> Document:
        """The document `paths` make (core/sources.py; `stdin` is what "-" reads); a file
        whose size alone shows more tokens than long_context.max_seq_len holds (`fitting`:
        than any fit could hold on this machine) is refused before it is read, a folder as
        soon as its text does."""
        limit = self._reading_limit(fitting)
        max_bytes = limit * self.tokenizer.bytes_per_token_bound
        try:
            return read_sources(paths, max_bytes=max_bytes, stdin=stdin)
        except DocumentTooLongError as e:
            fewest = self.tokenizer.fewest_tokens(e.size_bytes)
            raise PlanRefusedError(
                f"{e.path}: {e.size_bytes:,} bytes hold at least {fewest:,} tokens, more than "
                f"{limit:,} ({_limit_name(fitting)}). " + _what_to_do(fewest, fitting)
            ) from None

    def encode_document(
        self,
        doc: Document,
        on_progress: ProgressFn | None = None,
        cancel: threading.Event | None = None,
        fitting: bool = False,
    ) -> list[int]:
        """The ids of `doc`; tokenizing stops, refusing the document, as soon as they pass
        long_context.max_seq_len (`fitting`: what any fit could hold on this machine)."""
        limit = self._reading_limit(fitting)

        def batch_done(done: int, total: int) -> None:
            if on_progress is not None:
                on_progress(done, total)
            self.step_done(EngineStep.TOKENIZED)

        try:
            return self.tokenizer.encode_long(doc.text, batch_done, cancel, stop_after=limit)
        except TooManyTokensError as e:
            estimate = e.tokens * e.total // e.done
            raise PlanRefusedError(
                f"{doc.name} holds more than {limit:,} tokens ({_limit_name(fitting)}): "
                f"{e.tokens:,} in its first {e.done / e.total:.0%}, about {estimate:,} in all. "
                + _what_to_do(estimate, fitting)
            ) from None

    def check_fits(self, n_prompt: int, max_new_tokens: int) -> None:
        """Refuse, before any computation, a prompt the settings or the memory cannot hold."""
        lc = self.settings.long_context
        if n_prompt + max_new_tokens > lc.max_seq_len:
            raise PlanRefusedError(
                f"the prompt has {n_prompt} tokens and up to {max_new_tokens} may be generated, "
                f"but long_context.max_seq_len is {lc.max_seq_len}: at most "
                f"{lc.max_seq_len - max_new_tokens} prompt tokens fit. Raise "
                f"long_context.max_seq_len or lower generation.max_new_tokens "
                f"(e.g. --set long_context.max_seq_len={round_up(n_prompt + max_new_tokens)})."
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

    def stats(self) -> EngineStats:
        cache = self.session.cache_stats()
        cfg = self.config
        throughput = self.throughput
        prefill, decode = throughput.prefill, throughput.decode
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
            prefill_tokens=prefill[0],
            prefill_seconds=prefill[1],
            decode_tokens=decode[0],
            decode_seconds=decode[1],
            time_to_first_token=throughput.time_to_first_token,
            rss_bytes=process_rss(),
            available_bytes=available_memory(),
            gpu=gpu_memory(self.model.device),
        )


def _limit_name(fitting: bool) -> str:
    """What bounds a document read `fitting` (or not)."""
    if fitting:
        return "what this machine's memory holds now, even with INT4 blocks"
    return "long_context.max_seq_len"


def _what_to_do(tokens: int, fitting: bool) -> str:
    if fitting:
        return "Load a shorter text or free memory."
    return (
        f"Raise it (e.g. --set long_context.max_seq_len={round_up(tokens)}) or load a shorter text."
    )
