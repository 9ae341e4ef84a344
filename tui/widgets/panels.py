"""Live panels fed from EngineStats snapshots (polled a few times a second, never per token)."""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import Sparkline, Static

from kvchat.client.stats import ServerStats, reported
from kvchat.core.engine import EngineStats
from kvchat.tui.widgets.chat import human_bytes

SPARK_SAMPLES = 60
NOT_REPORTED = "not reported by the server"


class Panel(Vertical):
    """A titled box whose body is rewritten from each stats snapshot."""

    def __init__(self, title: str, **kwargs: str) -> None:
        super().__init__(**kwargs)
        self.border_title = title

    def compose(self) -> ComposeResult:
        # Plain text: the bodies carry names from the settings and the device, never markup.
        yield Static(classes="panel-body", markup=False)

    def show(self, stats: EngineStats | ServerStats) -> None:
        self.query_one(".panel-body", Static).update(self.body(stats))

    def body(self, stats: EngineStats | ServerStats) -> str:
        engine = reported(stats)
        return NOT_REPORTED if engine is None else self.engine_body(engine)

    def engine_body(self, stats: EngineStats) -> str:
        raise NotImplementedError


class ThroughputPanel(Panel):
    """Prefill and decode speed, a sparkline of recent decode speed, time to first token: the
    engine's own, or as measured here for a server that does not report them."""

    def __init__(self, **kwargs: str) -> None:
        super().__init__("throughput", **kwargs)
        self.samples: deque[float] = deque(maxlen=SPARK_SAMPLES)
        self._last_decode = 0

    def compose(self) -> ComposeResult:
        yield from super().compose()
        yield Sparkline([], id="decode-spark")

    def show(self, stats: EngineStats | ServerStats) -> None:
        stats = reported(stats) or stats
        # Sample only while decoding moves, so the line shows speeds, not idle time.
        if stats.decode_tokens != self._last_decode and stats.decode_tokens:
            self.samples.append(stats.decode_tok_s)
        self._last_decode = stats.decode_tokens
        self.query_one(Sparkline).data = list(self.samples)
        super().show(stats)

    def body(self, stats: EngineStats | ServerStats) -> str:
        ttft = "—" if stats.time_to_first_token is None else f"{stats.time_to_first_token:.2f} s"
        prefill = f"prefill {stats.prefill_tok_s:8.0f} tok/s ({stats.prefill_tokens:,} tok)"
        if isinstance(stats, ServerStats) and stats.context_tokens is None:
            prefill = "prefill  tokens not reported"  # the server sends no usage
        return (
            f"{prefill}\n"
            f"decode  {stats.decode_tok_s:8.1f} tok/s ({stats.decode_tokens:,} tok)\n"
            f"first token {ttft}"
        )


class DramPanel(Panel):
    """The block store in host memory, and the process's memory against what is free."""

    def __init__(self, **kwargs: str) -> None:
        super().__init__("DRAM blocks", **kwargs)

    def engine_body(self, stats: EngineStats) -> str:
        c = stats.cache
        memory = (
            f"process {human_bytes(stats.rss_bytes)}, free {human_bytes(stats.available_bytes)}"
        )
        if not c.block_size:
            return f"{c.backend}: no blocks\nKV {human_bytes(c.kv_bytes)} ({c.kv_dtype})\n{memory}"
        return (
            f"{c.blocks_in_dram:,} blocks × {c.block_size} tok\n"
            f"KV {human_bytes(c.kv_bytes)} ({c.kv_dtype})\n"
            f"anchors {human_bytes(c.anchor_bytes)}\n"
            f"{memory}"
        )


class DeviceWindowPanel(Panel):
    """What the compute device holds. Without a GPU the window stays in host memory, and the
    device block cache only counts what a GPU's slots would hold and move: labelled so."""

    def __init__(self, **kwargs: str) -> None:
        super().__init__("device window", **kwargs)

    def engine_body(self, stats: EngineStats) -> str:
        c = stats.cache
        gpu = stats.gpu
        used = (
            []
            if gpu is None
            else [f"GPU {human_bytes(gpu.used_bytes)} of {human_bytes(gpu.total_bytes)} used"]
        )
        if not c.block_size:
            return "\n".join([f"{c.backend}: all {c.tokens:,} tokens on {stats.device}", *used])
        resident = f"{c.resident_tokens:,} tok ({human_bytes(c.resident_bytes)})"
        slots = f"{c.device_slots_used}/{c.device_slots_total} slots"
        if stats.device == "cpu":
            would = f"hit {c.hit_rate:.0%}, move {human_bytes(c.bytes_moved)}"
            return f"no GPU: the window is in DRAM\n{resident}\na GPU would hold {slots},\n{would}"
        traffic = f"hit {c.hit_rate:.0%}, moved {human_bytes(c.bytes_moved)}"
        return "\n".join([f"resident {resident}", f"{slots}, {traffic}", *used])
