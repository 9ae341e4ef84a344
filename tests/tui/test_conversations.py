"""Saved conversations and the chat commands, end to end with the real SmolLM2 engine.

Every test gets a KVCHAT_HOME of its own, so the sessions list holds only its conversations;
one engine is shared by the module (each app starts a new session on it).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.pilot import Pilot
from textual.widgets import Input, OptionList

from kvchat.config import Settings
from kvchat.core.conversation import Conversation
from kvchat.core.engine import Engine
from kvchat.core.history import History, SavedMessage
from kvchat.tui.app import KvchatApp
from kvchat.tui.screens.confirm import ConfirmScreen
from kvchat.tui.screens.sessions import RenameScreen, SessionsScreen
from kvchat.tui.widgets.chat import STOPPED_MARK

from .conftest import NOTE, messages, notifications, wait_for, wait_idle

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("home")]

QUESTION = "Where is the meeting?"


@pytest.fixture
def note(tmp_path: Path) -> Path:
    path = tmp_path / "note.txt"
    path.write_text(NOTE * 3)
    return path


async def send(pilot: Pilot, app: KvchatApp, text: str) -> None:
    """Type `text` into the prompt and press Enter, then wait for what it started."""
    app.query_one("#prompt").focus()
    await pilot.press(*text)
    await pilot.press("enter")
    await wait_idle(pilot, app)


async def chat_about_the_note(pilot: Pilot, app: KvchatApp, note: Path) -> str:
    """Load the note, ask QUESTION; returns the reply."""
    await send(pilot, app, f"/load {note}")
    await send(pilot, app, QUESTION)
    [reply] = messages(app, "assistant")
    assert reply.source.strip() and STOPPED_MARK not in reply.source
    return reply.source


@pytest.mark.slow
async def test_a_conversation_survives_a_restart_and_exports_to_markdown(
    settings: Settings, engine: Engine, note: Path, home: Path
) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen))
        assert app.screen.query_one(OptionList).option_count == 0
        await pilot.press("escape")
        answer = await chat_about_the_note(pilot, app, note)

    [summary] = History().summaries()
    assert (summary.title, summary.document_name, summary.message_count) == (
        QUESTION,
        "note.txt",
        2,
    )

    app = KvchatApp(settings, engine=engine)  # a restart: a new app and a new session
    async with app.run_test(size=(140, 45)) as pilot:
        assert not engine.session.conversation.messages and not messages(app, "user")
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen))
        options = app.screen.query_one(OptionList)
        assert options.option_count == 1
        listed = str(options.get_option_at_index(0).prompt)
        assert QUESTION in listed and "note.txt" in listed and "2 messages" in listed
        await pilot.press("enter")
        await wait_idle(pilot, app)

        [card] = messages(app, "document")
        assert "note.txt" in card.source
        assert [m.source for m in messages(app, "user")] == [QUESTION]
        assert [m.source for m in messages(app, "assistant")] == [answer]
        conversation = engine.session.conversation
        assert conversation.messages == [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": answer},
        ]
        # The document was reloaded and its prefix prefilled; a follow-up prefills only the
        # turns after it.
        prefix = Conversation(
            document_ids=conversation.document_ids, document_name="note.txt"
        ).document_prefix_ids(engine.tokenizer)
        assert conversation.document_ids and engine.session.tokens == prefix
        follow_up = "Which street?"
        expected = len(conversation.prompt_ids(engine.tokenizer, follow_up)) - len(prefix)
        await send(pilot, app, follow_up)
        assert engine.stats().prefill_tokens == expected
        second = messages(app, "assistant")[-1].source

        await send(pilot, app, "/export")
        [exported] = (home / "exports").glob("*.md")
        assert any(str(exported) in n for n in notifications(app))
        text = exported.read_text()
        assert text.startswith(f"# {QUESTION}\n")
        assert "- document: note.txt" in text
        for line in (QUESTION, answer, follow_up, second):
            assert f"\n\n{line}\n" in text
        assert text.count("## You") == 2 and text.count("## Assistant") == 2

        target = home / "chat.md"
        await send(pilot, app, f"/export {target}")
        assert target.read_text() == text
    [summary] = History().summaries()  # the resumed conversation went on in the same record
    assert summary.message_count == 4


@pytest.mark.slow
@pytest.mark.parametrize("change", ["edited", "deleted"])
async def test_resuming_without_the_document_when_the_file_changed(
    settings: Settings, engine: Engine, note: Path, change: str
) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        answer = await chat_about_the_note(pilot, app, note)
    if change == "edited":
        note.write_text(NOTE.replace("Tuesday", "Friday"))
    else:
        note.unlink()

    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        [summary] = app.history.summaries()
        app.resume(summary.id)
        await wait_idle(pilot, app)
        [problem] = messages(app, "note")
        reason = "the file changed since then" if change == "edited" else "no such file"
        assert "note.txt" in problem.source and reason in problem.source
        assert not messages(app, "document")
        assert [m.source for m in messages(app, "assistant")] == [answer]
        conversation = engine.session.conversation
        assert not conversation.document_ids and len(conversation.messages) == 2
        assert any("without its document" in n for n in notifications(app))


async def test_system_prompt(settings: Settings, engine: Engine) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await send(pilot, app, "/system Answer in one word.")
        [shown] = messages(app, "note")
        assert "Answer in one word." in shown.source
        assert engine.session.conversation.system == "Answer in one word."
        await send(pilot, app, "What color is the sky?")
        assert "Answer in one word." in engine.tokenizer.decode(engine.session.tokens)
        [summary] = app.history.summaries()
        assert app.history.load(summary.id).system == "Answer in one word."

        await send(pilot, app, "/system")
        assert "cleared" in messages(app, "note")[-1].source
        assert "prefills the context again" in messages(app, "note")[-1].source
        assert engine.session.conversation.system is None
        assert app.history.load(summary.id).system is None


@pytest.mark.slow
async def test_regenerate_reuses_the_cache_up_to_the_reply(
    settings: Settings, engine: Engine, note: Path
) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await send(pilot, app, "/regenerate")
        assert any("Nothing to regenerate yet" in n for n in notifications(app))
        answer = await chat_about_the_note(pilot, app, note)
        first_prefill = engine.stats().prefill_tokens
        cached = len(engine.session.tokens)

        await pilot.press("ctrl+r")
        await wait_idle(pilot, app)
        # Greedy decoding: the same reply again, prefilling nothing (Session.sync cut the
        # cache back to the prompt, which it still held, with the logits after it).
        assert first_prefill > 1 and engine.session.last_prefill.prefilled == 0
        assert [m.source for m in messages(app, "assistant")] == [answer]
        assert [m.source for m in messages(app, "user")] == [QUESTION]
        assert engine.session.conversation.messages == [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": answer},
        ]
        assert len(engine.session.tokens) == cached
        [summary] = app.history.summaries()
        saved = app.history.load(summary.id)
        assert [(m.role, m.text) for m in saved.messages] == [
            ("user", QUESTION),
            ("assistant", answer),
        ]


@pytest.mark.slow
async def test_copy_the_last_reply_or_any_message(
    settings: Settings, engine: Engine, note: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("DISPLAY", "WAYLAND_DISPLAY"):  # no clipboard tool: OSC 52 only
        monkeypatch.delenv(name, raising=False)
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await send(pilot, app, "/copy")
        assert any("No reply to copy yet" in n for n in notifications(app))
        answer = await chat_about_the_note(pilot, app, note)
        await pilot.press("ctrl+t")
        assert app.clipboard == answer
        sent = f"sent the last reply ({len(answer):,} characters) to the terminal's clipboard"
        assert any(sent in n for n in notifications(app))
        assert not any(n.startswith("Copied") for n in notifications(app))

        [question] = messages(app, "user")
        await pilot.click(question, times=2)  # a double click copies one message
        await pilot.pause()
        assert app.clipboard == QUESTION
        sent = f"sent the question ({len(QUESTION)} characters)"
        assert any(sent in n for n in notifications(app))


@pytest.mark.slow
async def test_model_with_a_bad_path_keeps_the_model(
    settings: Settings, engine: Engine, tmp_path: Path
) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        missing = tmp_path / "nowhere" / "model.gguf"
        await send(pilot, app, f"/model {missing}")
        assert any(f"model file or folder not found: {missing}" in n for n in notifications(app))
        assert app.engine is engine and not app.busy and app.state == "ready"
        await send(pilot, app, "Say hello.")
        [reply] = messages(app, "assistant")
        assert reply.source.strip() and STOPPED_MARK not in reply.source


@pytest.mark.slow
async def test_model_loads_another_engine_and_starts_a_new_chat(
    settings: Settings, engine: Engine, note: Path
) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await chat_about_the_note(pilot, app, note)
        await send(pilot, app, "/model")  # no PATH: the model the settings name, loaded again
        assert app.engine is not engine and not app.busy
        assert not messages(app, "user") and not messages(app, "document")
        [shown] = messages(app, "note")
        assert "loaded: a new chat starts" in shown.source
        await send(pilot, app, "Say hello.")  # saved as a conversation of its own
        assert [s.title for s in app.history.summaries()] == ["Say hello.", QUESTION]


async def test_the_command_palette_lists_the_conversation_actions(
    settings: Settings, engine: Engine
) -> None:
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)):
        titles = {command.title for command in app.get_system_commands(app.screen)}
        assert {"Sessions", "Regenerate", "Copy reply", "Export"} <= titles


async def test_the_sessions_list_searches_renames_and_deletes(
    settings: Settings, engine: Engine
) -> None:
    history = History()
    ids = {}
    for question, answer in (("When does the lease end?", "In March."), ("Who owns it?", "Ada.")):
        ids[question] = cid = history.create("SmolLM2-135M", None, None)
        history.add_message(cid, SavedMessage("user", question))
        history.add_message(cid, SavedMessage("assistant", answer))
    lease = ids["When does the lease end?"]
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        app.conversation_id = lease  # as if the chat on screen were that conversation
        await pilot.press("f4")
        await wait_for(pilot, lambda: isinstance(app.screen, SessionsScreen))
        screen = app.screen
        options = screen.query_one(OptionList)
        assert options.option_count == 2

        await pilot.press("slash", *"LEASE", "enter")  # searched in any case; Enter: the list
        await pilot.pause()
        assert options.option_count == 1 and options.has_focus
        assert "When does the lease end?" in str(options.get_option_at_index(0).prompt)

        await pilot.press("f2")
        await wait_for(pilot, lambda: isinstance(app.screen, RenameScreen))
        app.screen.query_one(Input).value = ""
        await pilot.press(*"Lease dates", "enter")
        await wait_for(pilot, lambda: app.screen is screen)
        assert history.load(lease).title == "Lease dates"
        assert "Lease dates" in str(options.get_option_at_index(0).prompt)

        await pilot.press("delete")
        await wait_for(pilot, lambda: isinstance(app.screen, ConfirmScreen))
        assert "Delete “Lease dates” and its 2 messages?" in app.screen.question  # type: ignore[attr-defined]
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.screen is screen)
        assert options.option_count == 0
        assert [s.id for s in history.summaries()] == [ids["Who owns it?"]]

        await pilot.press("escape")
        await pilot.pause()
        assert app.conversation_id is None  # deleted: the chat is saved anew from its next turn
