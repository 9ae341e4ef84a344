"""The Textual app: chat with a local LLM about one long document.

All engine work (model load, tokenizing, prefill, generation) runs in one exclusive worker
thread; it reports through messages (see messages.py, bridge.py) and the live panels poll
`engine.stats()` on a timer. The UI thread only ever touches the engine for cheap reads and,
while no worker runs, for the Session calls that change its conversation (clear, system
prompt). A question is saved to SQLite (core/history.py) from the UI thread once its step has
ended, with its answer, in one place (`record_turn`) that follows what the engine's
conversation kept: one small write per message, never per token.

The keys, the command palette and the slash commands run the actions of one table
(commands.py).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import BinaryIO, TypeVar

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.css.query import NoMatches
from textual.notifications import SeverityLevel
from textual.screen import Screen
from textual.widgets import Footer

from kvchat.client.engine import RemoteEngine
from kvchat.client.stats import ServerStats, reported
from kvchat.config import (
    ConfigError,
    KeySettings,
    Settings,
    Theme,
    changed_keys,
    default_config_path,
    save_changes,
)
from kvchat.core.engine import Engine, EngineStats
from kvchat.core.history import (
    History,
    HistoryError,
    SavedDocument,
    SavedMessage,
    export_markdown,
)

from . import bridge
from .clipboard import copy_text
from .commands import ACTIONS, Action, Command, UnknownCommand, help_text, parse_command
from .log_notices import forward_engine_warnings
from .messages import (
    ConversationResumed,
    DocumentInfo,
    DocumentLoaded,
    FitOffered,
    KernelBuild,
    ModelLoaded,
    Notice,
    Progress,
    ReplyPiece,
    StepFinished,
)
from .screens.confirm import ConfirmScreen, rebuild_question
from .screens.load_file import LoadFileScreen
from .screens.sessions import SessionsScreen
from .screens.settings import SettingsScreen, prompt_clashes
from .widgets.chat import ChatMessage, ChatPane, Question, Reply, markdown_escape
from .widgets.heatmap import SelectionHeatmap
from .widgets.panels import DeviceWindowPanel, DramPanel, Panel, ThroughputPanel
from .widgets.prompt import PromptInput
from .widgets.status import StatusLine, StepProgress

READY = "ready"
T = TypeVar("T")


NO_MODEL = "No model is loaded: /model PATH loads one."


@dataclass
class Turn:
    """A question being answered, kept until its step ends to record what became of it.

    `old_reply`: for a regeneration, the reply on screen the new one is to replace, hidden
    while the new one streams; it comes back when the regeneration gets no answer.
    """

    question: Question
    answers_before: int = 0  # the session's answer_count when the step started
    old_reply: Reply | None = None


class KvchatApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "kvchat"
    # Each bound action is bound under its `keys` setting's name (the binding id), so the
    # keymap built from the settings can move it to another key.
    BINDINGS = [
        Binding(getattr(KeySettings(), action.name), action.name, action.label, id=action.name)
        for action in ACTIONS
        if action.bound
    ]

    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | RemoteEngine | None = None,
        model_spec: str | None = None,
        steps: bridge.Steps | None = None,
        paths: Sequence[str | Path] = (),
        stdin: BinaryIO | None = None,
        config_path: Path | None = None,
        notices: Sequence[str] = (),
    ) -> None:
        """`engine`: an already loaded engine to use (tests share one); else the app loads
        `model_spec` (default settings.model.path) in its worker at start. `steps`: how the
        engine is loaded and fed (default: here; remote_steps.RemoteSteps: on a server, where
        `model_spec` names the server's model). `paths`: the
        document to load once the model is ready; `stdin`: what "-" among them reads. The
        settings screen saves to `config_path` (default: the user's config file). `notices`
        (settings warnings, files moved) show as notifications once the app is up."""
        super().__init__()
        self.settings = settings
        self.config_path = config_path or default_config_path()
        self.notices = list(notices)
        self.set_keymap(asdict(settings.keys))
        self.engine = engine
        self.model_spec = model_spec
        self.steps: bridge.Steps = steps or bridge.LocalSteps()
        self.paths = list(paths)
        self.stdin = stdin
        self.state = "loading model…" if engine is None else READY
        self.busy = engine is None  # an engine step is running; guards the one-thread engine
        self.cancel_event = threading.Event()
        self.reply: Reply | None = None
        self.turn: Turn | None = None  # the question the running reply step answers
        self.queued: Question | None = None  # a question sent while a step ran, shown waiting
        self.offering = False  # a fit for a document is offered and not answered yet
        self.stop_warnings: Callable[[], None] = lambda: None
        self.document: DocumentInfo | None = None
        self.history = History()  # in the data folder, opened on first use
        self.conversation_id: int | None = None  # saved from its first question on

    # ---- layout --------------------------------------------------------------------------
    def compose(self) -> ComposeResult:
        with Horizontal(id="main"):
            with Vertical(id="chat-column"):
                yield ChatPane(id="chat")
                yield StepProgress(id="progress")
                yield PromptInput(id="prompt")
            with Vertical(id="side"):
                yield ThroughputPanel(id="throughput")
                yield DramPanel(id="dram")
                yield DeviceWindowPanel(id="device")
                with Vertical(id="heatmap-box") as box:
                    box.border_title = "selections per layer"
                    yield SelectionHeatmap(id="heatmap")
        yield StatusLine(id="status")
        yield Footer()

    def on_mount(self) -> None:
        self.theme = Theme(self.settings.ui.theme).textual_name
        self.query_one("#progress", StepProgress).hide()
        self.query_one("#side").display = self.settings.ui.show_panels
        self.query_one("#prompt", PromptInput).focus()
        self.stats_timer = self.set_interval(
            1 / self.settings.ui.stats_refresh_hz, self.refresh_stats
        )
        self.stop_warnings = forward_engine_warnings(self.post)
        for notice in self.notices:
            self.notify(notice, severity="warning")
        for problem in prompt_clashes(self.settings.keys):
            self.notify(f"{self.config_path}: {problem}", severity="warning")
        if self.engine is None:
            settings, spec, steps = self.settings, self.model_spec, self.steps
            self._engine_worker("model", lambda: steps.load_model(settings, spec, self.post))
        else:
            self.engine.new_session()  # a new app starts a new chat, even on a shared engine
            self._after_model()
        self.refresh_stats()

    def on_unmount(self) -> None:
        self.stop_warnings()
        # A thread worker cannot be killed: ask it to stop at the next chunk or token so
        # quitting does not wait for a long prefill to finish.
        self.cancel_event.set()
        if self.turn is not None and self.reply is not None:
            # Quitting during a reply: its step never reports back. The question is kept, with
            # what was shown of its answer (the conversation holds that once decoding began).
            turn, text = self.turn, self.reply.text
            self.turn = None
            self.record_turn(turn, text or None, stopped=True)
        # The timer could otherwise fire once more while the widgets are being removed.
        self.stats_timer.stop()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for action in ACTIONS:
            how = getattr(self.settings.keys, action.name) if action.bound else action.usage
            yield SystemCommand(action.label, f"{action.help} ({how})", self.palette_entry(action))

    def palette_entry(self, action: Action) -> Callable[[], object]:
        """What the palette entry of `action` runs: the action itself, or, for one whose
        argument is to be typed, its slash command put into the prompt."""
        if action.palette_types:
            return lambda: self.type_command(action)
        return getattr(self, f"action_{action.name}")

    def type_command(self, action: Action) -> None:
        """Put `action`'s slash command into the prompt, for its argument to be typed."""
        prompt = self.query_one("#prompt", PromptInput)
        prompt.text = f"/{action.command} "
        prompt.move_cursor(prompt.document.end)
        prompt.focus()

    def notify(
        self,
        message: str,
        *,
        title: str = "",
        severity: SeverityLevel = "information",
        timeout: float | None = None,
        markup: bool = False,
    ) -> None:
        """A notification shown as plain text unless `markup` is asked for: the app's
        notifications carry paths, file, model and conversation names and error messages,
        where a [bracket] is text, not a style."""
        super().notify(message, title=title, severity=severity, timeout=timeout, markup=markup)

    # ---- the engine worker ---------------------------------------------------------------
    def post(self, message: object) -> None:
        """Thread-safe post, for the worker."""
        self.post_message(message)  # type: ignore[arg-type]

    @work(thread=True, exclusive=True, group="engine")
    def _engine_worker(self, kind: str, body: Callable[[], str]) -> None:
        bridge.run_step(kind, self.post, self.cancel_event, body)

    def idle(self, needs_engine: bool = True) -> bool:
        """Whether the engine is free for a step (and, `needs_engine`, loaded); when not,
        says so."""
        if self.busy:
            self.notify("Busy: wait, or press Esc to stop the running step.", severity="warning")
            return False
        if needs_engine and self.engine is None:
            self.notify(NO_MODEL, severity="warning")
            return False
        return True

    def start_step(
        self,
        kind: str,
        state: str,
        body: Callable[[threading.Event], str],
        needs_engine: bool = True,
    ) -> bool:
        """Run `body(cancel)` in the worker unless one is running; False if refused."""
        if not self.idle(needs_engine):
            return False
        self.busy, self.state = True, state
        self.cancel_event = cancel = threading.Event()
        self._engine_worker(kind, lambda: body(cancel))
        self.refresh_stats()
        return True

    async def on_model_loaded(self, message: ModelLoaded) -> None:
        switched, self.engine = self.engine is not None, message.engine
        if switched:
            # The document was tokenized for the old model: the new one starts a new chat.
            self.document, self.conversation_id = None, None
            chat = self.query_one("#chat", ChatPane)
            await chat.remove_children()
            await chat.add_note(
                f"Model **{markdown_escape(message.engine.stats().model)}** loaded: a new "
                "chat starts. Load the document again (/load) to ask about it."
            )

    def on_notice(self, message: Notice) -> None:
        self.notify(message.text, title=message.title, severity=message.severity)  # type: ignore[arg-type]

    def on_kernel_build(self, message: KernelBuild) -> None:
        self.state = "building kernels"
        self.query_one("#progress", StepProgress).show_build(message.progress)

    def on_progress(self, message: Progress) -> None:
        self.state = message.phase
        self.query_one("#progress", StepProgress).show(
            message.phase, message.done, message.total, message.elapsed
        )

    async def on_document_loaded(self, message: DocumentLoaded) -> None:
        self.document, self.conversation_id = message.info, None
        chat = self.query_one("#chat", ChatPane)
        waiting = self.queued.text if self.queued is not None else None
        await chat.remove_children()
        await chat.add_document_card(message.info)
        if waiting is not None:  # a question sent while the document was read still waits
            self.queued = await chat.add_user(waiting)
            await self.queued.set_waiting(True)

    def on_fit_offered(self, message: FitOffered) -> None:
        fit, pending, engine = message.fit, message.pending, self.engine
        self.offering = True  # a waiting question waits for the answer too

        async def answered(apply: bool | None) -> None:
            self.offering = False
            if apply and engine is self.engine:
                # For this run: the config file keeps what the user saved.
                self.settings = replace(self.settings, long_context=fit.long_context)
                self.start_step(
                    "document",
                    f"loading {pending.doc.name}",
                    lambda cancel: bridge.open_pending(engine, pending, self.post, cancel, fit),  # type: ignore[arg-type]
                )
            elif self.queued is not None and not self.busy:
                await self.ask_queued()

        self.push_screen(
            ConfirmScreen(
                f"{pending.doc.name}: {len(pending.ids):,} tokens. With the reply they do not "
                f"fit the settings; they fit with {fit.describe()}.\n"
                "Apply these settings for this run and load the document? (/settings saves "
                "them.)",
                "Apply and load",
                "Cancel",
            ),
            answered,
        )

    async def on_reply_piece(self, message: ReplyPiece) -> None:
        if self.reply is not None:
            self.state = "answering"
            await self.reply.add_text(message.text)

    async def on_step_finished(self, message: StepFinished) -> None:
        self.query_one("#progress", StepProgress).hide()
        if message.kind == "reply":
            # Still busy meanwhile: the next question starts once this turn is recorded.
            await self.end_turn(message.stopped or message.error is not None)
        self.busy, self.state = False, READY
        if message.error:
            # A first model that failed leaves no engine: only /model can run. A failed
            # /model keeps the model loaded before.
            self.state = "model failed to load" if self.engine is None else READY
            self.notify(message.error, title=f"{message.kind} failed", severity="error")
        elif message.stopped:
            self.notify(message.detail or "stopped", title="stopped", severity="warning")
        elif message.kind == "model":
            self._after_model()
        elif message.kind == "reply" and message.detail:
            self.notify(message.detail, title="reply cut short", severity="warning")
        elif message.kind == "document" and message.detail:
            self.notify(message.detail, title="document loaded")
        elif message.kind == "resume":
            self.notify(message.detail, title="conversation resumed")
        elif message.kind == "rebuild":
            self.notify(message.detail, title="cache rebuilt")
        self.refresh_stats()
        if self.queued is not None and not self.offering:
            await self.ask_queued()

    def _after_model(self) -> None:
        if self.paths:
            paths, self.paths = self.paths, []
            self.load_document(*paths)

    # ---- user actions --------------------------------------------------------------------
    def load_document(self, *paths: str | Path) -> None:
        """Load the document `paths` make: a file, a folder, several, "-" for the standard
        input given at start (read once: the first load takes it)."""
        engine, stdin, self.stdin = self.engine, self.stdin, None
        names = ", ".join(Path(path).name or str(path) for path in paths)
        self.start_step(
            "document",
            f"loading {names}",
            lambda cancel: self.steps.load_document(engine, paths, self.post, cancel, stdin),
        )

    def ask(self, turn: Turn) -> bool:
        """Answer `turn`'s question in the worker (a regeneration when it has an old reply);
        `end_turn` records what became of it."""
        engine, question = self.engine, turn.question.text
        if engine is None:
            return False
        # Counted before the worker starts: it may add the turn before this thread reads on.
        turn.answers_before = engine.session.answer_count
        regenerating = turn.old_reply is not None

        def body(cancel: threading.Event) -> str:
            if regenerating:
                return bridge.regenerate(engine, self.post, cancel)
            return bridge.ask(engine, question, self.post, cancel)

        if not self.start_step("reply", "prefill", body):
            return False
        self.turn = turn
        return True

    async def ask_new(self, question: str) -> None:
        """Show `question` and answer it as a new turn."""
        if not self.idle():
            return
        chat = self.query_one("#chat", ChatPane)
        shown = await chat.add_user(question)
        self.reply = await chat.add_reply()
        self.ask(Turn(shown))

    async def end_turn(self, stopped: bool) -> None:
        """The reply step ended: keep its turn in the conversation, the history and on screen
        alike. The session's answer_count says whether the question got an answer: the session
        records the turn once decoding began (a reply stopped after that is kept, marked
        stopped) and drops a question stopped during its prefill, refused or failed before its
        reply (a regeneration's old turn then stays)."""
        turn, reply = self.turn, self.reply
        self.turn = self.reply = None
        if reply is None:
            return
        if turn is None or self.engine is None:  # a reply no question started: nothing to save
            await reply.finish(stopped=stopped)
            return
        session = self.engine.session
        answered = session.answer_count > turn.answers_before
        answer = session.messages[-1]["content"] if answered else None
        try:
            self.record_turn(turn, answer, stopped)
        finally:
            if answer is not None:
                reply.text = answer
                await reply.finish(stopped=stopped)
                if turn.old_reply is not None:
                    await turn.old_reply.remove()
            else:
                await reply.remove()
                if turn.old_reply is not None:
                    turn.old_reply.display = True
                else:
                    await turn.question.mark_unanswered()

    async def on_prompt_input_submitted(self, message: PromptInput.Submitted) -> None:
        try:
            command = parse_command(message.text)
        except UnknownCommand as e:
            self.notify(str(e), severity="error")
            return
        if command is not None:
            await self.run_command(command)
            return
        if self.busy:
            await self.queue_question(message)
            return
        if self.engine is None:
            message.prompt.text = message.text  # given back instead of lost
            self.notify(NO_MODEL, severity="warning")
            return
        await self.ask_new(message.text)

    async def queue_question(self, message: PromptInput.Submitted) -> None:
        """Show a question sent while a step runs as waiting; it is asked when the step ends.
        One question waits at a time: a second is given back to the prompt."""
        if self.queued is not None or self.engine is None:
            message.prompt.text = message.text  # given back instead of lost
            busy = "A question is already waiting" if self.queued else "The model is loading"
            self.notify(f"{busy}: wait, or press Esc to stop the running step.", severity="warning")
            return
        self.queued = await self.query_one("#chat", ChatPane).add_user(message.text)
        await self.queued.set_waiting(True)

    async def ask_queued(self) -> None:
        """Ask the waiting question, now that the engine is free."""
        question, self.queued = self.queued, None
        if question is None or not question.is_attached:  # the chat was cleared meanwhile
            return
        if self.engine is None or self.busy:
            self.queued = question
            return
        # Busy through the awaits: between the step that ended and this question's, the app
        # must not look idle (another step could start, a caller could think all is done).
        self.busy = True
        try:
            await question.set_waiting(False)
            chat = self.query_one("#chat", ChatPane)
            chat.move_to_end(question)
            self.reply = await chat.add_reply()
        finally:
            self.busy = False
        self.ask(Turn(question))

    async def run_command(self, command: Command) -> None:
        """Run the action of a slash command, handed the argument when it takes one."""
        action = command.action
        run = getattr(self, f"action_{action.name}")
        done = run(command.arg) if action.arg else run()
        if inspect.isawaitable(done):
            await done

    def action_load_file(self, path: str = "") -> None:
        """Load the document at `path`; with none, choose it in the file dialog."""
        if path:
            self.load_document(Path(path).expanduser())
            return

        def chosen(path: Path | None) -> None:
            if path is not None:
                self.load_document(path)

        self.push_screen(LoadFileScreen(), chosen)

    def action_stop(self) -> None:
        if not self.busy or self.engine is None:
            return
        self.cancel_event.set()
        self.state = "stopping…"
        self.refresh_stats()

    def action_toggle_panels(self) -> None:
        side = self.query_one("#side")
        side.display = not side.display

    # ---- saved conversations -------------------------------------------------------------
    def record_turn(self, turn: Turn, answer: str | None, stopped: bool) -> None:
        """Save how `turn` ended, as the conversation holds it: the one place the history
        gains a turn. `answer` None: the question got no answer, and the conversation does
        not hold it; it is saved alone, marked stopped, so a resumed chat shows it as it was
        shown and leaves it out of the turns the model sees."""
        if turn.old_reply is not None:  # a regeneration: its answer takes the old one's place
            conversation_id = self.conversation_id
            if answer is None:
                return  # the old answer stands, in the conversation and in the history
            if conversation_id is not None:
                self.history_call(lambda h: h.drop_last_reply(conversation_id), "not saved")
        else:
            self.save_message(SavedMessage("user", turn.question.text, stopped=answer is None))
        if answer is not None:
            self.save_message(SavedMessage("assistant", answer, stopped))

    def save_message(self, message: SavedMessage) -> None:
        """Write one finished message; the conversation's record starts at its first."""
        if self.engine is None:
            return
        try:
            if self.conversation_id is None:
                session = self.engine.session
                doc = self.document if session.has_document else None
                saved = (
                    SavedDocument(doc.path, doc.name, doc.size_bytes, doc.tokens, doc.sha256)
                    if doc is not None
                    else None
                )
                model = self.engine.stats().model
                self.conversation_id = self.history.create(model, session.system, saved)
            self.history.add_message(self.conversation_id, message)
        except HistoryError as e:
            self.notify(str(e), title="not saved", severity="error")

    def history_call(self, call: Callable[[History], T], title: str) -> T | None:
        """`call(self.history)`, or None after a notification saying why it failed."""
        try:
            return call(self.history)
        except HistoryError as e:
            self.notify(str(e), title=title, severity="error")
            return None

    def action_sessions(self) -> None:
        if not self.idle():
            return
        screen = SessionsScreen(self.history)

        def closed(conversation_id: int | None) -> None:
            if self.conversation_id in screen.deleted:
                self.conversation_id = None  # the chat on screen is saved anew from its next turn
            self.resume(conversation_id)

        self.push_screen(screen, closed)

    def resume(self, conversation_id: int | None) -> None:
        """Continue a saved conversation: its document is reloaded in the worker."""
        if conversation_id is None:
            return
        saved = self.history_call(lambda h: h.load(conversation_id), "sessions")
        if saved is None:
            return
        engine = self.engine
        self.start_step(
            "resume",
            f"resuming {saved.title}",
            lambda cancel: self.steps.resume(engine, saved, self.post, cancel),
        )

    async def on_conversation_resumed(self, message: ConversationResumed) -> None:
        saved = message.saved
        self.document, self.conversation_id = message.info, saved.id
        chat = self.query_one("#chat", ChatPane)
        await chat.remove_children()
        if message.info is not None:
            await chat.add_document_card(message.info)
        elif saved.document is not None:
            await chat.add_note(
                f"The document **{markdown_escape(saved.document.name)}** is not loaded: "
                f"{markdown_escape(message.problem)}. The chat goes on without it."
            )
        if saved.system:
            await chat.add_note(system_note(saved.system))
        shown = saved.messages
        for i, m in enumerate(shown):
            if m.role == "user":
                question = await chat.add_user(m.text)
                # As SavedConversation.turns() reads it: a question with no answer after it
                # got none (stopped, refused, or the app ended during its prefill).
                if i + 1 == len(shown) or shown[i + 1].role != "assistant":
                    await question.mark_unanswered()
            else:
                await chat.add_saved_reply(m.text, m.stopped)

    def action_export(self, target: str = "") -> None:
        """Write the saved conversation as Markdown to `target` (default: the exports folder)."""
        conversation_id = self.conversation_id
        if conversation_id is None:
            self.notify("Nothing to export yet: ask a question first.", severity="warning")
            return
        path = self.history_call(
            lambda h: export_markdown(
                h.load(conversation_id), Path(target).expanduser() if target else None
            ),
            "export failed",
        )
        if path is not None:
            self.notify(str(path), title="exported")

    def action_copy_reply(self) -> None:
        turns = self.engine.session.messages if self.engine is not None else []
        replies = [m["content"] for m in turns if m["role"] == "assistant"]
        if not replies or not replies[-1]:
            self.notify("No reply to copy yet.", severity="warning")
            return
        self.copy_out(replies[-1], "the last reply")

    def on_chat_message_copy_requested(self, message: ChatMessage.CopyRequested) -> None:
        self.copy_out(message.text, message.what)

    def copy_out(self, text: str, what: str) -> None:
        """Copy `text` and say whether a clipboard took it (tui/clipboard.py)."""
        result = copy_text(self, text, what)
        severity = "information" if result.confirmed else "warning"
        self.notify(result.notice, title="copy", severity=severity)

    async def action_regenerate(self) -> None:
        """Answer the last question again. For an answered one, the cache still holds
        everything before the old reply, so the question is not prefilled again; one that got
        no answer is asked again below it, where it stays marked."""
        if not self.idle():
            return
        assert self.engine is not None
        chat = self.query_one("#chat", ChatPane)
        question = chat.last_question()
        if question is not None and not question.answered:
            await self.ask_new(question.text)
            return
        last_turn = self.engine.session.messages[-2:]
        if question is None or not last_turn or last_turn[0]["content"] != question.text:
            self.notify("Nothing to regenerate yet: ask a question first.", severity="warning")
            return
        old_reply = chat.replies()[-1]
        old_reply.display = False
        self.reply = await chat.add_reply()
        self.ask(Turn(question, old_reply=old_reply))

    async def action_system(self, prompt: str = "") -> None:
        """Set (empty: clear) the system prompt of the conversation."""
        if not self.idle():
            return
        assert self.engine is not None
        session = self.engine.session
        session.set_system(prompt)
        conversation_id = self.conversation_id
        if conversation_id is not None:
            self.history_call(lambda h: h.set_system(conversation_id, prompt or None), "not saved")
        note = system_note(prompt) if prompt else "System prompt cleared."
        if session.tokens:
            note += (
                f" It comes first, so the next question prefills the context again "
                f"({len(session.tokens):,} tokens)."
            )
        await self.query_one("#chat", ChatPane).add_note(note)

    def action_model(self, spec: str = "") -> None:
        """Load another model (empty: the one the settings name; on a server, the first it
        lists) in place of this one."""
        settings, steps = self.settings, self.steps
        self.start_step(
            "model",
            f"loading model {spec}" if spec else "loading the model",
            lambda cancel: steps.load_model(settings, spec or None, self.post),
            needs_engine=False,
        )

    async def action_clear_chat(self) -> None:
        """Clear the chat and forget the questions, keeping the document.

        The session (and its KV cache) stays: the next question shares the document prefix
        with what is cached, so only the question is prefilled.
        """
        if not self.idle():
            return
        assert self.engine is not None
        session = self.engine.session
        self.conversation_id = None  # what follows is saved as a new conversation
        session.clear()
        chat = self.query_one("#chat", ChatPane)
        await chat.remove_children()
        if self.document is not None and session.has_document:
            await chat.add_document_card(self.document)

    async def action_help(self) -> None:
        await self.query_one("#chat", ChatPane).add_note(help_text(self.settings.keys))

    def action_settings(self) -> None:
        # Settings change what a running step reads: open them only while the engine is idle
        # (while the screen is up, no step can start).
        if self.busy or self.engine is None:
            self.notify("Busy: wait, or press Esc to stop the running step.", severity="warning")
            return
        self.push_screen(SettingsScreen(self.settings, self.config_path), self.apply_settings)

    def watch_theme(self, name: str) -> None:
        """Save a theme chosen in the command palette ("Change theme"), as /settings would."""
        theme = Theme.from_textual(name)
        if theme is None or theme == self.settings.ui.theme or not self.is_mounted:
            return
        old = self.settings
        self.settings = replace(old, ui=replace(old.ui, theme=theme))
        try:
            save_changes(self.config_path, old, self.settings)
        except (ConfigError, OSError) as e:
            self.notify(f"{self.config_path}: the theme is not saved ({e})", severity="warning")

    def apply_settings(self, settings: Settings | None) -> None:
        """Put saved settings to work: keys, theme and panels here, the rest in the engine."""
        if settings is None or self.engine is None:
            return
        old, self.settings = self.settings, settings
        self.set_keymap(asdict(settings.keys))
        self.theme = Theme(settings.ui.theme).textual_name
        if settings.ui.show_panels != old.ui.show_panels:  # else keep what the panels key made
            self.query_one("#side").display = settings.ui.show_panels
        if settings.ui.stats_refresh_hz != old.ui.stats_refresh_hz:
            self.stats_timer.stop()
            self.stats_timer = self.set_interval(
                1 / settings.ui.stats_refresh_hz, self.refresh_stats
            )
        result = self.engine.apply_settings(settings)
        reload = [key for key in changed_keys(old, settings) if key.startswith("model.")]
        lines = [f"Saved to {self.config_path}."]
        if result.cache:
            lines.append(f"Needs a new cache: {', '.join(result.cache)}.")
        if reload or result.reload:
            lines.append(
                f"Needs the model loaded again (restart kvchat or use /model): "
                f"{', '.join(reload + list(result.reload))}."
            )
        self.notify("\n".join(lines), title="settings")
        session = self.engine.session
        if result.cache and session.tokens:
            self.push_screen(
                rebuild_question(result.cache, len(session.tokens)),
                lambda now: self.rebuild_cache() if now else None,
            )
        self.refresh_stats()

    def rebuild_cache(self) -> None:
        engine = self.engine
        self.start_step(
            "rebuild",
            "rebuilding cache",
            lambda cancel: bridge.rebuild_cache(engine, self.post, cancel),  # type: ignore[arg-type]
        )

    # ---- live panels ---------------------------------------------------------------------
    def refresh_stats(self) -> None:
        try:
            if self.engine is None:
                self.query_one("#status", StatusLine).show(self.state, None)
            else:
                self.show_stats(self.engine.stats())
        except NoMatches:
            pass  # the timer fired while the app was shutting down and its widgets are gone

    def show_stats(self, stats: EngineStats | ServerStats) -> None:
        self.query_one("#status", StatusLine).show(self.state, stats)
        if self.query_one("#side").display:
            for panel in self.query(Panel):
                panel.show(stats)
            engine = reported(stats)
            self.query_one("#heatmap", SelectionHeatmap).show(engine and engine.cache)


def system_note(prompt: str) -> str:
    return f"**System prompt:** {prompt}"
