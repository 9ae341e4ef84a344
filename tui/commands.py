"""Slash commands typed into the prompt."""

from __future__ import annotations

from dataclasses import dataclass

HELP = """\
**Commands**

| command | what it does |
|---|---|
| `/load PATH` | load a document (no PATH: open the file dialog) |
| `/clear` | clear the chat and start over; the loaded document and its cache are kept |
| `/help` | this help |

**Keys**: Enter sends, Shift+Enter or Ctrl+J starts a new line, Esc stops a prefill or a reply,
Ctrl+O opens the file dialog, F2 shows or hides the panels, Ctrl+P lists every action,
Ctrl+Q quits.
"""

NAMES = ("load", "clear", "help")


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
