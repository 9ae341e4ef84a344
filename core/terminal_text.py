"""Text a terminal shows rather than obeys: what kvchat shows of documents, replies and model
files."""

from __future__ import annotations

import re

# What a terminal obeys instead of showing: the C0 controls but tab and newline (ESC opens
# every escape sequence, BEL ends an OSC one), DEL, and the C1 controls (8-bit CSI, OSC, DCS).
_TERMINAL_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def terminal_safe(text: str) -> str:
    """`text` without the control characters a terminal would act on: a model's reply or a
    document's text cannot move the cursor, retitle the window or write the clipboard (OSC
    52). The characters of a sequence after its introducer stay, as plain text."""
    return _TERMINAL_CONTROLS.sub("", text)
