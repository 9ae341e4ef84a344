"""The saved history keeps pace with the conversation: a question stopped during its prefill
or refused stays on screen and in the history, marked as having no answer, and never takes
another question's answer; regenerating and resuming keep every answer with its question.

End to end with the real SmolLM2 engine under Textual's pilot; each test has a KVCHAT_HOME
of its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.pilot import Pilot

from kvchat.config import Settings, load_settings
from kvchat.core.engine import Engine
from kvchat.tui import app as app_module
from kvchat.tui.app import KvchatApp
from kvchat.tui.messages import Progress
from kvchat.tui.widgets.chat import ChatMessage, ChatPane

from .conftest import notifications, send, wait_idle

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("home")]

# Prefill chunks of 16 tokens: a short question's prompt takes two or more, so the prefill
# is still under way when its first progress is reported. 1024 tokens: a long question is
# refused cheaply.
OVERRIDES = [
    "generation.max_new_tokens=8",
    "long_context.chunk_size=16",
    "long_context.max_seq_len=1024",
]
STOPPED_FIRST = "Name a color."  # 34 prompt tokens with the template's system prompt
ANSWERED = "Name a fruit."
STOPPED_LATER = "Which animals live in the deep sea, and how do they see?"  # ~26 new tokens
NO_ANSWER = "\n\n*[no answer]*"  # the mark under a question that got no answer


@pytest.fixture(scope="module")
def settings() -> Settings:
    """Overrides the shared fixture (tests/tui/conftest.py)."""
    return load_settings(overrides=OVERRIDES).settings


class StopsDuringPrefill(KvchatApp):
    """The app, with its stop action run at the first prefill progress of the next question
    when `stop_next_prefill` is set. The worker reports progress after the layers of its
    first chunk and waits here until the UI thread has run the action, so the prefill stops
    inside that chunk whatever the machine's speed: Esc pressed at a known moment."""

    # Textual finds a relative CSS_PATH beside the module of the class that sets it.
    CSS_PATH = str(Path(app_module.__file__).with_name("app.tcss"))
    stop_next_prefill = False

    def post(self, message: object) -> None:
        if (
            self.stop_next_prefill
            and isinstance(message, Progress)
            and message.phase == "prefill"
            and message.done < message.total
        ):
            self.stop_next_prefill = False
            self.call_from_thread(self.action_stop)
        super().post(message)


async def stop_during_prefill(pilot: Pilot, app: StopsDuringPrefill, question: str) -> None:
    app.stop_next_prefill = True
    await send(pilot, app, question)
    assert not app.stop_next_prefill, "the prefill ended in one chunk: nothing was stopped"


async def regenerate(pilot: Pilot, app: KvchatApp) -> None:
    await pilot.press("ctrl+r")
    await wait_idle(pilot, app)


def screen(app: KvchatApp) -> list[tuple[str, str]]:
    """The chat's questions and replies in order, as shown: (role, Markdown source)."""
    shown = []
    for message in app.query_one(ChatPane).query(ChatMessage):
        if message.role in ("user", "assistant"):
            assert message.display, "a reply is left hidden"
            shown.append((message.role, message.source))
    return shown


async def test_stopped_questions_and_regenerated_answers_survive_a_resume(
    settings: Settings, engine: Engine
) -> None:
    app = StopsDuringPrefill(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await stop_during_prefill(pilot, app, STOPPED_FIRST)
        assert any("prefill cancelled after 0 of" in n for n in notifications(app))
        assert screen(app) == [("user", STOPPED_FIRST + NO_ANSWER)]
        assert engine.session.conversation.messages == []

        await send(pilot, app, ANSWERED)
        await regenerate(pilot, app)  # answers ANSWERED again, under ANSWERED
        await stop_during_prefill(pilot, app, STOPPED_LATER)
        await regenerate(pilot, app)  # asks STOPPED_LATER again: the last question
        conversation = engine.session.conversation.messages
        [summary] = app.history.summaries()
        saved = app.history.load(summary.id)
        assert saved.turns() == conversation  # the history holds the turns the model sees
        assert [m["content"] for m in conversation[::2]] == [ANSWERED, STOPPED_LATER]
        answer, later_answer = (m["content"] for m in conversation[1::2])
        live = [
            ("user", STOPPED_FIRST + NO_ANSWER),
            ("user", ANSWERED),
            ("assistant", answer),
            ("user", STOPPED_LATER + NO_ANSWER),
            ("user", STOPPED_LATER),
            ("assistant", later_answer),
        ]
        assert screen(app) == live
        assert [(m.role, m.text, m.stopped) for m in saved.messages] == [
            ("user", STOPPED_FIRST, True),
            ("user", ANSWERED, False),
            ("assistant", answer, False),
            ("user", STOPPED_LATER, True),
            ("user", STOPPED_LATER, False),
            ("assistant", later_answer, False),
        ]
        live_conversation = list(conversation)

    app = KvchatApp(settings, engine=engine)  # a restart: a new app and a new session
    async with app.run_test(size=(140, 45)) as pilot:
        app.resume(summary.id)
        await wait_idle(pilot, app)
        assert screen(app) == live
        assert engine.session.conversation.messages == live_conversation


async def test_a_refused_question_is_kept_unanswered_and_not_sent_again(
    settings: Settings, engine: Engine
) -> None:
    too_long = "Summarize this:" + " word" * 1100  # more tokens than max_seq_len
    app = KvchatApp(settings, engine=engine)
    async with app.run_test(size=(140, 45)) as pilot:
        await send(pilot, app, ANSWERED)
        [_, (_, answer)] = screen(app)
        await send(pilot, app, too_long)
        assert any("long_context.max_seq_len" in n for n in notifications(app))
        assert screen(app) == [
            ("user", ANSWERED),
            ("assistant", answer),
            ("user", too_long + NO_ANSWER),
        ]
        conversation = engine.session.conversation.messages
        assert conversation == [
            {"role": "user", "content": ANSWERED},
            {"role": "assistant", "content": answer},
        ]
        [summary] = app.history.summaries()
        saved = app.history.load(summary.id)
        assert [(m.role, m.text, m.stopped) for m in saved.messages] == [
            ("user", ANSWERED, False),
            ("assistant", answer, False),
            ("user", too_long, True),
        ]
        assert saved.turns() == conversation
