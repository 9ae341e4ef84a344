"""Slash commands typed into the prompt."""

from __future__ import annotations

from dataclasses import dataclass

from kvchat.config import KeySettings, schema_fields

HELP = """\
**Commands**

| command | what it does |
|---|---|
| `/load PATH` | load a document (no PATH: open the file dialog) |
| `/clear` | clear the chat and start over; the loaded document and its cache are kept |
| `/settings` | edit the settings (every key of the config file) |
| `/sessions` | resume a saved conversation (its document is reloaded if unchanged) |
| `/export [PATH]` | save the conversation as Markdown (default: $KVCHAT_HOME/exports/) |
| `/copy` | copy the last reply to the clipboard |
| `/regenerate` | answer the last question again (a new seed when sampling) |
| `/system PROMPT` | set the system prompt (no PROMPT: clear it) |
| `/model [PATH]` | load another model (no PATH: the model of the settings, again) |
| `/help` | this help |

**Keys**: Enter sends, Shift+Enter or Ctrl+J starts a new line, Ctrl+P lists every action,
Ctrl+Q quits; and, as the `keys` settings bind them now:
"""

NAMES = (
    "load",
    "clear",
    "settings",
    "sessions",
    "export",
    "copy",
    "regenerate",
    "system",
    "model",
    "help",
)


def keys_help(keys: KeySettings) -> str:
    """A Markdown table of the remappable keys as `keys` binds them, with what each does."""
    rows = [
        f"| `{getattr(keys, spec.name)}` | {spec.help} |" for spec in schema_fields(KeySettings)
    ]
    return "| key | action |\n|---|---|\n" + "\n".join(rows) + "\n"


@dataclass(frozen=True)
class Command:
    name: str
    arg: str


class UnknownCommand(ValueError):
    pass


def parse_command(text: str) -> Command | None:
    """The command in `text`, or None when it is a question (does not start with `/`)."""
    text = text.strip()
    if not text.startswith("/"):
        return None
    name, _, arg = text[1:].partition(" ")
    if name not in NAMES:
        raise UnknownCommand(f"unknown command /{name}; try /help")
    return Command(name, arg.strip())
