"""The status line and the prefill / tokenize progress bar."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.content import Content
from textual.widgets import Label, ProgressBar, Static

from kvchat.client.stats import ServerStats, reported
from kvchat.core.engine import EngineStats
from kvchat.native import BuildProgress
from kvchat.tui.messages import LOAD_PHASE, SAVE_PHASE


class StatusLine(Static):
    """Model, context used / max_seq_len, kv_type, position mode, and what the engine does.

    Built as Content, not markup: the state names files and saved titles, and the model name
    comes from its file, so brackets in them show as they are.
    """

    def show(self, state: str, stats: EngineStats | ServerStats | None) -> None:
        if stats is None:
            self.update(Content.assemble((state, "bold")))
            return
        # A server's URL comes right after the model: the line is cut at the terminal's edge.
        where = f" on {stats.url}" if isinstance(stats, ServerStats) else ""
        engine = reported(stats)
        if engine is None:
            n = stats.context_tokens
            facts = f"{stats.model}{where} │ context {'not reported' if n is None else f'{n:,}'}"
        else:
            facts = (
                f"{engine.model}{where} │ context {engine.context_tokens:,}/"
                f"{engine.max_seq_len:,} │ kv {engine.cache.kv_dtype} │ {engine.attention} │ "
                f"positions {engine.position_mode} │ {engine.device} {engine.dtype}"
            )
        self.update(Content.assemble((state, "bold"), f" │ {facts}"))


class StepProgress(Horizontal):
    """A progress bar with tokens done / total, speed and ETA; hidden while idle."""

    def compose(self) -> ComposeResult:
        yield ProgressBar(show_eta=False, id="step-bar")
        yield Label(id="step-label", markup=False)  # kernel names and numbers, never markup

    def show(self, phase: str, done: int, total: int, elapsed: float) -> None:
        self.display = True
        self.query_one(ProgressBar).update(total=max(total, 1), progress=done)
        unit = {"tokenize": "chars", LOAD_PHASE: "tensors", SAVE_PHASE: "MiB"}.get(phase, "tok")
        stops = "" if phase == LOAD_PHASE else "  (Esc stops)"
        rate = done / elapsed if elapsed > 0 else 0.0
        eta = f"{(total - done) / rate:.0f} s" if rate > 0 else "—"
        self.query_one(Label).update(
            f"{phase} {done:,}/{total:,} {unit}  {rate:,.0f} {unit}/s  ETA {eta}{stops}"
        )

    def show_build(self, progress: BuildProgress) -> None:
        """A kernel build: sources compiled of all, and the line that says what and why."""
        self.display = True
        self.query_one(ProgressBar).update(total=progress.sources, progress=progress.compiled)
        self.query_one(Label).update(progress.line())

    def hide(self) -> None:
        self.display = False
