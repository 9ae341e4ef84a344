"""The Textual app: chat with a local LLM about one long document.

All engine work (model load, tokenizing, prefill, generation) runs in one exclusive worker
thread; it reports through messages (see messages.py, bridge.py) and the live panels poll
`engine.stats()` on a timer. The UI thread only ever touches the engine for cheap reads and
for swapping a Conversation object while no worker runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from pathlib import Path

from textual import work
from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from kvchat.config import Settings
from kvchat.core.conversation import Conversation
from kvchat.core.engine import Engine

from . import bridge
from .commands import HELP, Command, UnknownCommand, parse_command
from .messages import DocumentInfo, DocumentLoaded, ModelLoaded, Progress, ReplyPiece, StepFinished
from .screens.load_file import LoadFileScreen
from .widgets.chat import ChatPane, Reply
from .widgets.heatmap import SelectionHeatmap
from .widgets.panels import DeviceWindowPanel, DramPanel, Panel, ThroughputPanel
from .widgets.prompt import PromptInput
from .widgets.status import StatusLine, StepProgress

READY = "ready"


class KvchatApp(App[None]):
    CSS_PATH = "app.tcss"
    TITLE = "kvchat"
    BINDINGS = [
        Binding("ctrl+o", "load_file", "Load file"),
        Binding("escape", "stop", "Stop"),
        Binding("f2", "toggle_panels", "Panels"),
        Binding("ctrl+l", "clear_chat", "Clear"),
    ]

    def __init__(
        self,
        settings: Settings,
        *,
        engine: Engine | None = None,
        model_spec: str | None = None,
        prompt_file: str | Path | None = None,
    ) -> None:
        """`engine`: an already loaded engine to use (tests share one); else the app loads
        `model_spec` (default settings.model.path) in its worker at start."""
        super().__init__()
        self.settings = settings
        self.engine = engine
        self.model_spec = model_spec
        self.prompt_file = prompt_file
        self.state = "loading model…" if engine is None else READY
        self.busy = engine is None  # an engine step is running; guards the one-thread engine
        self.cancel_event = threading.Event()
        self.reply: Reply | None = None
        self.document: DocumentInfo | None = None

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
        self.theme = "textual-light" if self.settings.ui.theme == "light" else "textual-dark"
        self.query_one("#progress", StepProgress).hide()
        self.query_one("#side").display = self.settings.ui.show_panels
        self.query_one("#prompt", PromptInput).focus()
        self.set_interval(1 / self.settings.ui.stats_refresh_hz, self.refresh_stats)
        if self.engine is None:
            settings, spec = self.settings, self.model_spec
            self._engine_worker("model", lambda: bridge.load_model(settings, spec, self.post))
        else:
            self.engine.new_session()  # a new app starts a new chat, even on a shared engine
            self._after_model()
        self.refresh_stats()

    def on_unmount(self) -> None:
        # A thread worker cannot be killed: ask it to stop at the next chunk or token so
        # quitting does not wait for a long prefill to finish.
        self.cancel_event.set()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand("Load document", "Open the file dialog (Ctrl+O)", self.action_load_file)
        yield SystemCommand("Stop", "Stop the running prefill or reply (Esc)", self.action_stop)
        yield SystemCommand("Clear chat", "Start over, keep the document", self.action_clear_chat)
        yield SystemCommand("Panels", "Show or hide the live panels", self.action_toggle_panels)
        yield SystemCommand("Help", "Commands and keys", self.action_help)

    # ---- the engine worker ---------------------------------------------------------------
    def post(self, message: object) -> None:
        """Thread-safe post, for the worker."""
        self.post_message(message)  # type: ignore[arg-type]

    @work(thread=True, exclusive=True, group="engine")
    def _engine_worker(self, kind: str, body: Callable[[], str]) -> None:
        bridge.run_step(kind, self.post, self.cancel_event, body)

    def start_step(self, kind: str, state: str, body: Callable[[threading.Event], str]) -> bool:
        """Run `body(cancel)` in the worker unless one is running; False if refused."""
        if self.engine is None or self.busy:
            self.notify("Busy: wait, or press Esc to stop the running step.", severity="warning")
            return False
        self.busy, self.state = True, state
        self.cancel_event = cancel = threading.Event()
        self._engine_worker(kind, lambda: body(cancel))
        self.refresh_stats()
        return True

    def on_model_loaded(self, message: ModelLoaded) -> None:
        self.engine = message.engine

    def on_progress(self, message: Progress) -> None:
        self.state = message.phase
        self.query_one("#progress", StepProgress).show(
            message.phase, message.done, message.total, message.elapsed
        )

    async def on_document_loaded(self, message: DocumentLoaded) -> None:
        self.document = message.info
        chat = self.query_one("#chat", ChatPane)
        await chat.remove_children()
        await chat.add_document_card(message.info)

    async def on_reply_piece(self, message: ReplyPiece) -> None:
        if self.reply is not None:
            self.state = "answering"
            await self.reply.add_text(message.text)

    async def on_step_finished(self, message: StepFinished) -> None:
        self.busy, self.state = False, READY
        self.query_one("#progress", StepProgress).hide()
        if message.kind == "reply" and self.reply is not None:
            await self.reply.finish(stopped=message.stopped or message.error is not None)
            self.reply = None
        if message.error:
            self.state = "model failed to load" if message.kind == "model" else READY
            self.busy = message.kind == "model"  # no engine: nothing can run
            self.notify(message.error, title=f"{message.kind} failed", severity="error")
        elif message.stopped:
            self.notify(message.detail or "stopped", title="stopped", severity="warning")
        elif message.kind == "model":
            self._after_model()
        elif message.kind == "document" and message.detail:
            self.notify(message.detail, title="document loaded")
        self.refresh_stats()

    def _after_model(self) -> None:
        if self.prompt_file is not None:
            path, self.prompt_file = Path(self.prompt_file), None
            self.load_document(path)

    # ---- user actions --------------------------------------------------------------------
    def load_document(self, path: Path) -> None:
        engine = self.engine
        self.start_step(
            "document",
            f"loading {path.name}",
            lambda cancel: bridge.load_document(engine, path, self.post, cancel),  # type: ignore[arg-type]
        )

    def ask(self, question: str) -> bool:
        engine = self.engine
        return self.start_step(
            "reply",
            "prefill",
            lambda cancel: bridge.ask(engine, question, self.post, cancel),  # type: ignore[arg-type]
        )

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
            message.prompt.text = message.text  # give the question back instead of losing it
            self.notify("Busy: wait, or press Esc to stop the running step.", severity="warning")
            return
        chat = self.query_one("#chat", ChatPane)
        await chat.add_user(message.text)
        self.reply = await chat.add_reply()
        self.ask(message.text)

    async def run_command(self, command: Command) -> None:
        if command.name == "load":
            if command.arg:
                self.load_document(Path(command.arg).expanduser())
            else:
                self.action_load_file()
        elif command.name == "clear":
            await self.action_clear_chat()
        else:
            await self.action_help()

    def action_load_file(self) -> None:
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

    async def action_clear_chat(self) -> None:
        """Clear the chat and forget the questions, keeping the document.

        The session (and its KV cache) stays: the next question shares the document prefix
        with what is cached, so only the question is prefilled.
        """
        if self.busy or self.engine is None:
            self.notify("Busy: wait, or press Esc to stop the running step.", severity="warning")
            return
        session = self.engine.session
        old = session.conversation
        session.conversation = Conversation(
            system=old.system, document_ids=old.document_ids, document_name=old.document_name
        )
        chat = self.query_one("#chat", ChatPane)
        await chat.remove_children()
        if self.document is not None and old.document_ids:
            await chat.add_document_card(self.document)

    async def action_help(self) -> None:
        await self.query_one("#chat", ChatPane).add_note(HELP)

    # ---- live panels ---------------------------------------------------------------------
    def refresh_stats(self) -> None:
        status = self.query_one("#status", StatusLine)
        if self.engine is None:
            status.show(self.state, None)
            return
        stats = self.engine.stats()
        status.show(self.state, stats)
        if self.query_one("#side").display:
            for panel in self.query(Panel):
                panel.show(stats)
            self.query_one("#heatmap", SelectionHeatmap).show(stats.cache)
