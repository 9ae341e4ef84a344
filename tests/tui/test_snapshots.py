"""Snapshots of the app's screens (pytest-textual-snapshot), made deterministic.

The app runs on the real engine, but the stats timer is paused and the panels are fed fixed
EngineStats snapshots; cursors do not blink; the terminal size is fixed; paths are shown
relative to a temporary $HOME filled with known files. Update the SVGs after a deliberate
change with `pytest tests/tui/test_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import DirectoryTree, Input, TextArea

from kvchat.config import Settings, load_settings
from kvchat.core.engine import Engine, EngineStats
from kvchat.kv.backend import CacheStats, LayerStats
from kvchat.tui.app import KvchatApp
from kvchat.tui.messages import DocumentInfo
from kvchat.tui.screens.load_file import LoadFileScreen
from kvchat.tui.screens.settings import SettingsScreen
from kvchat.tui.widgets.chat import ChatPane

from .conftest import wait_for

SIZE = (140, 44)
OVERRIDES = ["generation.max_new_tokens=8", "long_context.max_seq_len=65536"]
DOCUMENT = DocumentInfo(
    "lighthouse-logs.txt",
    161_204,
    40_960,
    "Keeper's log, Tern Rock light, 1871.\nMarch 3: wind NW, strong; lamp lit at 18:02.",
)


@pytest.fixture(scope="module")
def settings() -> Settings:
    return load_settings(overrides=OVERRIDES).settings


@pytest.fixture(scope="module")
def engine(settings: Settings) -> Engine:
    return Engine.load(settings)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A $HOME with a docs folder of known files, the working directory of the app."""
    monkeypatch.setenv("HOME", str(tmp_path))
    docs = tmp_path / "docs"
    (docs / "contracts").mkdir(parents=True)
    (docs / "contracts" / "lease.txt").write_text("The lease ends on 31 March 2031.\n")
    (docs / "lighthouse-logs.txt").write_text("March 3: wind NW.\n")
    (docs / "notes.md").write_text("# Notes\n")
    monkeypatch.chdir(docs)
    return tmp_path


def fixed_stats(engine: Engine, decode_tokens: int, decode_seconds: float) -> EngineStats:
    """A sparse cache 40K tokens deep, mid-answer: every value fixed, none measured."""
    n_blocks = 320
    layers = tuple(
        LayerStats(
            layer=i,
            dense=False,
            candidates=n_blocks - 32,
            selected=tuple(sorted({0, 97, 98, (i * 37) % n_blocks, (i * 11 + 200) % n_blocks})),
        )
        for i in range(engine.config.num_layers)
    )
    cache = CacheStats(
        backend="sparse",
        tokens=40_981,
        capacity_tokens=65_536,
        kv_bytes=943_718_400,
        kv_dtype="FP16",
        position_mode="extrapolate",
        block_size=128,
        blocks_in_dram=n_blocks,
        resident_tokens=4_224,
        resident_bytes=97_320_960,
        anchor_bytes=2_949_120,
        device_slots_used=1_740,
        device_slots_total=5_760,
        hits=61_230,
        misses=5_402,
        bytes_moved=248_512_512,
        layers=layers,
    )
    return replace(
        engine.stats(),
        model="Smollm2 135M",
        device="cpu",
        dtype="bfloat16",
        attention="sparse",
        position_mode="extrapolate",
        max_seq_len=65_536,
        context_tokens=40_981,
        cache=cache,
        prefill_tokens=40_960,
        prefill_seconds=190.5,
        decode_tokens=decode_tokens,
        decode_seconds=decode_seconds,
        time_to_first_token=1.84,
        rss_bytes=1_298_137_088,
        available_bytes=19_645_317_120,
        gpu=None,
    )


def no_blinking(app: KvchatApp) -> None:
    for widget in app.screen.query("Input, TextArea"):
        assert isinstance(widget, Input | TextArea)
        widget.cursor_blink = False


async def wait_for_screen(pilot: Pilot, screen_type: type) -> None:
    await wait_for(pilot, lambda: isinstance(pilot.app.screen, screen_type))


def make_app(settings: Settings, engine: Engine, home: Path) -> KvchatApp:
    return KvchatApp(
        settings, engine=engine.with_settings(settings), config_path=home / ".kvchat/config.yaml"
    )


def freeze_stats(app: KvchatApp, engine: Engine) -> None:
    """Stop polling the engine and show fixed stats, with a sparkline of five samples."""
    app.stats_timer.pause()
    for tokens, seconds in ((8, 0.4), (16, 0.9), (24, 1.3), (32, 1.9), (40, 2.3)):
        app.show_stats(fixed_stats(engine, tokens, seconds))


def test_main_screen_with_panels(snap_compare, settings, engine, home) -> None:
    app = make_app(settings, engine, home)

    async def run_before(pilot: Pilot) -> None:
        chat = app.query_one(ChatPane)
        await chat.add_document_card(DOCUMENT)
        await chat.add_user("When was the lamp first lit in March?")
        reply = await chat.add_reply()
        await reply.add_text("The log for **March 3** says the lamp was lit at 18:02, with a")
        app.state = "answering"
        freeze_stats(app, engine)
        no_blinking(app)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_file_dialog(snap_compare, settings, engine, home) -> None:
    app = make_app(settings, engine, home)

    async def run_before(pilot: Pilot) -> None:
        freeze_stats(app, engine)
        await pilot.press("ctrl+o")
        await wait_for_screen(pilot, LoadFileScreen)
        tree = app.screen.query_one(DirectoryTree)
        await wait_for(pilot, lambda: len(tree.root.children) == 3)  # listed in a worker
        no_blinking(app)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_settings_screen(snap_compare, settings, engine, home) -> None:
    app = make_app(settings, engine, home)

    async def run_before(pilot: Pilot) -> None:
        freeze_stats(app, engine)
        await pilot.press("f3")
        await wait_for_screen(pilot, SettingsScreen)
        no_blinking(app)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)
