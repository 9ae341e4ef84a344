"""`kvchat ask` prints the model's reply: on a terminal it is shown, never obeyed (no escape
sequence in a reply or a quoted document can drive the terminal); anywhere else it is written
exactly as generated. The terminal is a real pseudo-terminal.
"""

from __future__ import annotations

import io
import os

from kvchat.core.terminal_text import terminal_safe
from kvchat.tui.cli import write_reply

OSC52 = "\x1b]52;c;aGk=\x07"  # "write 'hi' to the clipboard", as a terminal reads it


def read_all(fd: int) -> bytes:
    """Everything written to the other side of a pseudo-terminal, once that side is closed."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the terminal side is closed and nothing is left
            return data
        if not chunk:
            return data
        data += chunk


def test_a_reply_printed_on_a_terminal_cannot_drive_it() -> None:
    # The sequence arrives split over pieces, as the reply streams it.
    pieces = ["Hi ", OSC52[:3], OSC52[3:], " there\x1b[2J\x9b31m.\tok\n"]
    leader, follower = os.openpty()
    try:
        with open(follower, "w", encoding="utf-8") as terminal:
            assert terminal.isatty()
            write_reply(pieces, terminal)
        printed = read_all(leader).decode()
    finally:
        os.close(leader)
    assert "\x1b" not in printed and "\x07" not in printed and "\x9b" not in printed
    # What remains of the sequences is plain text; the line ends as the terminal writes it.
    assert printed == "Hi ]52;c;aGk= there[2J31m.\tok\r\n"


def test_a_reply_written_to_a_file_or_pipe_is_kept_exactly() -> None:
    pieces = ["Hi ", OSC52, " there\n"]
    out = io.StringIO()
    write_reply(pieces, out)
    assert out.getvalue() == "".join(pieces)
    assert terminal_safe("\x00a\x08b\x1bc\x7fd\te\nf\r") == "abcd\te\nf"
