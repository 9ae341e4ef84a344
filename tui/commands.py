"""The app's actions, in one table: the footer's key bindings, the command palette, the slash
commands typed into the prompt and the commands /help lists are all made from it."""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.config import KeySettings, schema_fields


@dataclass(frozen=True)
class Action:
    """One thing the user can do.

    `name` is the app's action: its `action_<name>` method runs it, from a key, the palette
    or the slash command alike, and is handed the slash command's argument when `arg` is
    set. `bound`: the `keys` setting of the same name binds it to a key (and the footer shows
    it with `label`). `command`: the slash command, without its slash; `arg`, what may follow
    it as /help writes it ("PATH", "[PATH]"), and `arg_help`, what it means. `palette_types`:
    the palette entry puts the slash command into the prompt, for the argument to be typed,
    instead of running the action.
    """

    name: str
    label: str
    help: str
    bound: bool = False
    command: str | None = None
    arg: str = ""
    arg_help: str = ""
    palette_types: bool = False

    @property
    def usage(self) -> str:
        """The slash command as /help shows it, e.g. `/load PATH`."""
        return f"/{self.command} {self.arg}".rstrip()


# In the footer's order.
ACTIONS = (
    Action(
        "load_file",
        "Load file",
        "Load a document",
        bound=True,
        command="load",
        arg="PATH",
        arg_help="no PATH: open the file dialog",
    ),
    Action("stop", "Stop", "Stop the running prefill or reply", bound=True),
    Action("toggle_panels", "Panels", "Show or hide the live panels", bound=True),
    Action(
        "clear_chat",
        "Clear",
        "Clear the chat and start over; the loaded document and its cache are kept",
        bound=True,
        command="clear",
    ),
    Action(
        "settings",
        "Settings",
        "Edit and save the settings (every key of the config file)",
        bound=True,
        command="settings",
    ),
    Action("help", "Help", "Show the commands and keys", bound=True, command="help"),
    Action(
        "sessions",
        "Sessions",
        "Resume a saved conversation (its document is reloaded if unchanged)",
        bound=True,
        command="sessions",
    ),
    Action(
        "regenerate",
        "Regenerate",
        "Answer the last question again (a new seed when sampling)",
        bound=True,
        command="regenerate",
    ),
    Action(
        "copy_reply",
        "Copy reply",
        "Copy the last reply to the clipboard",
        bound=True,
        command="copy",
    ),
    Action(
        "export",
        "Export",
        "Save the conversation as Markdown",
        command="export",
        arg="[PATH]",
        arg_help="default: exports/ in the data folder",
    ),
    Action(
        "system",
        "System prompt",
        "Set the system prompt",
        command="system",
        arg="PROMPT",
        arg_help="no PROMPT: clear it",
        palette_types=True,
    ),
    Action(
        "model",
        "Load model",
        "Load another model",
        command="model",
        arg="[MODEL]",
        arg_help="a path, org/name from the Hugging Face cache or ollama:NAME; none: the "
        "model of the settings, again",
        palette_types=True,
    ),
)
COMMANDS = {action.command: action for action in ACTIONS if action.command is not None}

KEYS_INTRO = """\
**Keys**: Enter sends, Shift+Enter or Ctrl+J starts a new line, Ctrl+P lists every action,
Ctrl+Q quits; and, as the `keys` settings bind them now:
"""


def help_text(keys: KeySettings) -> str:
    """The /help note: a Markdown table of the slash commands, then one of the keys as `keys`
    binds them, each with its `keys` setting's help."""
    commands = [
        f"| `{a.usage}` | {a.help}{f' ({a.arg_help})' if a.arg_help else ''} |"
        for a in COMMANDS.values()
    ]
    key_rows = [
        f"| `{getattr(keys, spec.name)}` | {spec.help} |" for spec in schema_fields(KeySettings)
    ]
    return (
        "**Commands**\n\n| command | what it does |\n|---|---|\n"
        + "\n".join(commands)
        + "\n\n"
        + KEYS_INTRO
        + "\n| key | action |\n|---|---|\n"
        + "\n".join(key_rows)
        + "\n"
    )


@dataclass(frozen=True)
class Command:
    name: str
    arg: str

    @property
    def action(self) -> Action:
        return COMMANDS[self.name]


class UnknownCommand(ValueError):
    pass


def parse_command(text: str) -> Command | None:
    """The command in `text`, or None when it is a question (does not start with `/`)."""
    text = text.strip()
    if not text.startswith("/"):
        return None
    name, _, arg = text[1:].partition(" ")
    if name not in COMMANDS:
        raise UnknownCommand(f"unknown command /{name}; try /help")
    return Command(name, arg.strip())
