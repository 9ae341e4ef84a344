"""The Textual app end to end with the real SmolLM2 engine, driven by Textual's pilot.

One engine is loaded for the module and shared by the app instances (each app starts a new
session on it); only the first test lets the app load its own model in its worker.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, Label, Static

from kvchat.config import Settings
from kvchat.core.engine import Engine
from kvchat.core.steps import EngineStep
from kvchat.core.turns import ReplyEnd
from kvchat.tui.app import KvchatApp
from kvchat.tui.log_notices import NoticeHandler
from kvchat.tui.messages import LOAD_PHASE, Progress, ReplyPiece, StepFinished
from kvchat.tui.screens.load_file import LoadFileScreen
from kvchat.tui.widgets.chat import STOPPED_MARK, ChatPane
from kvchat.tui.widgets.panels import DeviceWindowPanel, DramPanel, Panel
from kvchat.tui.widgets.prompt import PromptInput
from kvchat.tui.widgets.status import StatusLine

from .conftest import NOTE, StepGate, messages, notifications, wait_for, wait_idle

pytestmark = pytest.mark.anyio


async def load_through_dialog(pilot: Pilot, app: KvchatApp, path: Path) -> None:
    await pilot.press("ctrl+o")
    await wait_for(pilot, lambda: isinstance(app.screen, LoadFileScreen))
    app.screen.query_one("#load-path", Input).value = str(path)
    await pilot.press("enter")


async def send(pilot: Pilot, app: KvchatApp, question: str) -> None:
    """Send `question` at once (typing it key by key may outlast a short prefill)."""
    prompt = app.query_one("#prompt", PromptInput)
    prompt.focus()
    prompt.text = question
    await pilot.press("enter")


async def ask(pilot: Pilot, app: KvchatApp, question: str) -> None:
    app.query_one("#prompt").focus()
    await pilot.press(*question)
    await pilot.press("enter")


def status_text(app: KvchatApp) -> str:
    return str(app.query_one(StatusLine).render())


async def test_app_loads_its_own_model_in_the_worker(settings: Settings) -> None:
    app = KvchatApp(settings)
    posted: list[object] = []
    post = app.post
    app.post = lambda message: (posted.append(message), post(message))  # type: ignore[method-assign]
    async with app.run_test(size=(140, 45)) as pilot:
        assert app.engine is None and "loading model" in status_text(app)
        await wait_idle(pilot, app)
        assert app.engine is not None
        loads = [
            (p.done, p.total) for p in posted if isinstance(p, Progress) and p.phase == LOAD_PHASE
        ]
        assert loads and loads[-1] == (272, 272)  # SmolLM2's weight tensors, read
        assert len(loads) >= 2 or loads[0][0] == loads[0][1]
        app.refresh_stats()
        assert app.engine.stats().model in status_text(app)
        assert "context 0/" in status_text(app)


async def test_a_failed_first_model_leaves_the_app_usable(
    settings: Settings, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    app = KvchatApp(settings, model_spec=str(broken))
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_for(pilot, lambda: "model failed" in status_text(app))
        assert app.engine is None and not app.busy
        assert any("broken.gguf" in n for n in notifications(app))
        await send(pilot, app, "What now?")  # no model: the question is given back
        assert app.query_one("#prompt").text == "What now?"
        assert any("No model is loaded" in n for n in notifications(app))
        app.query_one("#prompt", PromptInput).text = ""
        await send(pilot, app, "/model smollm2-135m")
        await wait_for(pilot, lambda: app.engine is not None and not app.busy)
        assert app.engine.stats().model in status_text(app)


async def test_engine_warnings_become_notifications(settings: Settings, engine: Engine) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        logging.getLogger("kvchat.native").warning(
            "the C++ kernels for %s could not be built (%s); %s",
            "decode attention",
            "no C++ compiler",
            "using torch",
        )
        worker = threading.Thread(  # as the engine's worker thread logs
            target=logging.getLogger("kvchat.core.snapshot").warning,
            args=("snapshot %s cannot be read (%s); skipped", "3f2a", "I/O error"),
        )
        worker.start()
        worker.join()
        await wait_for(pilot, lambda: len(notifications(app)) >= 2)
        shown = notifications(app)
        assert any("could not be built (no C++ compiler); using torch" in n for n in shown)
        assert any("snapshot 3f2a cannot be read (I/O error); skipped" in n for n in shown)
    assert not any(isinstance(h, NoticeHandler) for h in logging.getLogger("kvchat").handlers)


async def test_a_kernel_build_shows_in_the_progress_bar(settings: Settings, engine: Engine) -> None:
    from kvchat.native import BuildProgress
    from kvchat.tui.messages import KernelBuild
    from kvchat.tui.widgets.status import StepProgress

    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        app.post_message(KernelBuild(BuildProgress("decode attention", "avx2", 2, 6, 31.0)))
        progress = app.query_one("#progress", StepProgress)
        await wait_for(pilot, lambda: progress.display)
        label = str(progress.query_one(Label).render())
        assert "building the C++ kernels for decode attention (avx2" in label
        assert "2/6 sources, 31 s" in label
        assert app.state == "building kernels"


async def test_load_a_document_and_ask(settings: Settings, engine: Engine, tmp_path: Path) -> None:
    doc = tmp_path / "note.txt"
    doc.write_text(NOTE * 3)
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await load_through_dialog(pilot, app, doc)
        await wait_idle(pilot, app)
        conversation = engine.session.conversation
        assert conversation.document_name == "note.txt" and conversation.document_ids
        [card] = messages(app, "document")
        assert (
            "note.txt" in card.source and f"{len(conversation.document_ids)} tokens" in card.source
        )
        assert "The meeting is on Tuesday" in card.source
        prefilled = len(engine.session.tokens)
        assert prefilled > len(conversation.document_ids)

        await ask(pilot, app, "Where is the meeting?")
        await wait_idle(pilot, app)
        [user] = messages(app, "user")
        [reply] = messages(app, "assistant")
        assert user.source == "Where is the meeting?"
        assert reply.source.strip() and STOPPED_MARK not in reply.source
        assert conversation.messages[-1] == {"role": "assistant", "content": reply.source}
        assert len(engine.session.tokens) > prefilled  # the document prefix was reused
        assert app.query_one("#prompt").text == ""
        # The reply is cut at max_new_tokens (8 here): the app says so, and what makes room.
        assert engine.session.reply_end is ReplyEnd.MAX_NEW_TOKENS
        assert any("generation.max_new_tokens (8)" in n for n in notifications(app))


async def test_the_panels_say_what_is_real_on_a_cpu(
    settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    doc = tmp_path / "note.txt"
    doc.write_text(NOTE * 3)
    app = KvchatApp(settings, engine=engine, paths=[str(doc)])
    async with app.run_test(size=(140, 45)) as pilot:
        await wait_idle(pilot, app)
        app.refresh_stats()
        stats = engine.stats()
        device = panel_text(app, DeviceWindowPanel)
        resident = f"{stats.cache.resident_tokens:,} tok"
        assert device.startswith(f"no GPU: the window is in DRAM\n{resident}"), device
        assert "a GPU would hold" in device and "GPU " not in device.replace("a GPU", "")
        dram = panel_text(app, DramPanel)
        assert "\nprocess " in dram and ", free " in dram
        assert stats.rss_bytes > 0 and 0 < stats.available_bytes and stats.gpu is None


def panel_text(app: KvchatApp, panel: type[Panel]) -> str:
    return str(app.query_one(panel).query_one(".panel-body", Static).render())


@pytest.mark.slow
async def test_esc_stops_a_prefill_and_the_session_stays_usable(
    settings: Settings, engine: Engine, gate: StepGate, tmp_path: Path
) -> None:
    doc = tmp_path / "long.txt"
    doc.write_text(" ".join(f"Line {i}: the lighthouse keeper logs weather." for i in range(60)))
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot, gate:
        gate.arm(EngineStep.PREFILLED)  # held after the document's first chunk
        await load_through_dialog(pilot, app, doc)
        await wait_for(pilot, gate.held.is_set)
        await pilot.press("escape")
        gate.release()
        await wait_idle(pilot, app)
        chunk = settings.long_context.chunk_size
        total = len(engine.session.conversation.document_prefix_ids(engine.tokenizer))
        assert len(engine.session.tokens) == chunk < total  # the chunk done stays cached
        assert any("prefill cancelled after 256 of" in n for n in notifications(app))

        await ask(pilot, app, "What does the keeper log?")
        await wait_idle(pilot, app)
        [reply] = messages(app, "assistant")
        assert reply.source.strip() and STOPPED_MARK not in reply.source
        assert len(engine.session.tokens) > total


async def ask_during_a_prefill(
    pilot: Pilot, app: KvchatApp, engine: Engine, gate: StepGate, folder: Path
) -> int:
    """Load a three-chunk document and, while its prefill is held after its first chunk, send a
    question; it must wait. Returns the document's token count."""
    doc = folder / "long.txt"
    doc.write_text(" ".join(f"Line {i}: the lighthouse keeper logs weather." for i in range(60)))
    gate.arm(EngineStep.PREFILLED)
    await load_through_dialog(pilot, app, doc)
    await wait_for(pilot, gate.held.is_set)
    total = len(engine.session.conversation.document_prefix_ids(engine.tokenizer))
    await send(pilot, app, "What does the keeper log?")
    [waiting] = messages(app, "user")
    assert waiting.has_class("waiting") and app.busy and app.turn is None
    return total


@pytest.mark.slow
async def test_a_question_sent_during_a_prefill_waits_and_is_answered_after_it(
    settings: Settings, engine: Engine, gate: StepGate, tmp_path: Path
) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot, gate:
        total = await ask_during_a_prefill(pilot, app, engine, gate, tmp_path)
        assert not messages(app, "assistant")
        await send(pilot, app, "And when?")  # one question waits at a time: given back
        assert app.query_one("#prompt").text == "And when?"
        assert any("already waiting" in n for n in notifications(app))
        gate.release()
        await wait_idle(pilot, app)
        [question] = messages(app, "user")
        [reply] = messages(app, "assistant")
        assert not question.has_class("waiting") and question.answered
        assert question.source == "What does the keeper log?"
        assert reply.source.strip() and STOPPED_MARK not in reply.source
        assert len(engine.session.tokens) > total  # the whole document, then the turn


@pytest.mark.slow
async def test_esc_stops_the_prefill_then_the_waiting_question(
    settings: Settings, engine: Engine, gate: StepGate, tmp_path: Path
) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot, gate:
        total = await ask_during_a_prefill(pilot, app, engine, gate, tmp_path)
        gate.arm(EngineStep.SAMPLED)  # the waiting question's first reply token
        await pilot.press("escape")  # stops the document's prefill; the question starts
        gate.release()
        await wait_for(pilot, gate.held.is_set)
        [question] = messages(app, "user")
        assert app.turn is not None and not question.has_class("waiting")
        assert any("prefill cancelled after 256 of" in n for n in notifications(app))
        await pilot.press("escape")  # stops the question's reply after its first token
        gate.release()
        await wait_idle(pilot, app)
        [reply] = messages(app, "assistant")
        assert reply.source.endswith(STOPPED_MARK) and reply.has_class("stopped")
        assert engine.session.reply_end is ReplyEnd.STOPPED
        # The question went on from the chunk cached: the rest of the document, then itself.
        assert len(engine.session.tokens) > total


@pytest.mark.parametrize(
    "content,reason",
    [
        (bytes(range(256)) * 4, "binary file"),
        (b"", "the file is empty"),
    ],
    ids=["binary", "empty"],
)
async def test_bad_files_are_refused_and_change_nothing(
    settings: Settings, engine: Engine, tmp_path: Path, content: bytes, reason: str
) -> None:
    good, bad = tmp_path / "good.txt", tmp_path / "bad.bin"
    good.write_text(NOTE)
    bad.write_bytes(content)
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await load_through_dialog(pilot, app, good)
        await wait_idle(pilot, app)
        session = engine.session
        ids = list(session.conversation.document_ids)
        tokens = list(session.tokens)
        await ask(pilot, app, f"/load {bad}")
        await wait_idle(pilot, app)
        assert any(reason in n for n in notifications(app)), notifications(app)
        assert engine.session is session
        assert session.conversation.document_ids == ids and session.tokens == tokens
        assert len(messages(app, "document")) == 1


async def test_slash_commands(settings: Settings, engine: Engine) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await ask(pilot, app, "/help")
        await pilot.pause()
        [note] = messages(app, "note")
        assert "/load PATH" in note.source
        await ask(pilot, app, "/nonsense")
        await pilot.pause()
        assert any("unknown command /nonsense" in n for n in notifications(app))
        await ask(pilot, app, "/clear")
        await pilot.pause()
        assert not messages(app, "note")


async def test_newline_keys_do_not_send(settings: Settings, engine: Engine) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await ask(pilot, app, "")  # focus; an empty prompt sends nothing
        await pilot.press("a", "ctrl+j", "b")
        assert app.query_one("#prompt").text == "a\nb"
        assert not messages(app, "user")


async def test_a_stopped_reply_is_kept_and_marked(settings: Settings, engine: Engine) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        app.reply = await app.query_one(ChatPane).add_reply()
        app.busy = True
        app.post_message(ReplyPiece("The meeting is"))
        app.post_message(StepFinished("reply", stopped=True, detail="stopped"))
        await wait_idle(pilot, app)
        [reply] = messages(app, "assistant")
        assert reply.source == "The meeting is" + STOPPED_MARK
        assert reply.has_class("stopped") and app.reply is None
