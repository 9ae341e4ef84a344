"""Copying text out of the app, and saying truly whether it reached a clipboard.

A terminal app has two ways to a clipboard: the desktop's own tool (wl-copy, xclip, xsel,
pbcopy, clip.exe), which says whether it worked, and the OSC 52 escape sequence, which the
terminal honours or silently ignores (many do by default, and tmux only with set-clipboard
on). kvchat uses the tool where the session has one and also sends OSC 52 (for a terminal
on another machine over ssh); it says "copied" only when the tool confirmed it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

from textual.app import App

# (command, the display it needs to reach the user's clipboard), in order of preference;
# pbcopy (macOS) and clip.exe (WSL) exist only where they work.
TOOLS: tuple[tuple[tuple[str, ...], str | None], ...] = (
    (("wl-copy",), "WAYLAND_DISPLAY"),
    (("xclip", "-selection", "clipboard"), "DISPLAY"),
    (("xsel", "--clipboard", "--input"), "DISPLAY"),
    (("pbcopy",), None),
    (("clip.exe",), None),
)
TIMEOUT_S = 3.0


@dataclass(frozen=True)
class CopyResult:
    confirmed: bool  # a clipboard tool took the text
    notice: str


def copy_text(app: App, text: str, what: str) -> CopyResult:
    """Put `text` (described as `what`, e.g. "the last reply") on the clipboard."""
    app.copy_to_clipboard(text)  # OSC 52: a terminal that honours it copies on any machine
    size = f"{what} ({len(text):,} characters)"
    failure = ""
    for command, needs in TOOLS:
        if needs is not None and not os.environ.get(needs):
            continue
        if shutil.which(command[0]) is None:
            continue
        try:
            subprocess.run(
                command, input=text.encode(), timeout=TIMEOUT_S, check=True, capture_output=True
            )
        except (OSError, subprocess.SubprocessError) as e:
            failure = f"{command[0]} failed ({_reason(e)}); "
            continue
        return CopyResult(True, f"Copied {size}.")
    return CopyResult(
        False,
        f"{failure}sent {size} to the terminal's clipboard (OSC 52). Terminals that do not "
        "support it ignore it, and no clipboard tool was found here; /export saves the "
        "conversation to a file.",
    )


def _reason(error: Exception) -> str:
    if isinstance(error, subprocess.CalledProcessError):
        stderr = error.stderr.decode(errors="replace").strip().splitlines()
        return stderr[0] if stderr else f"exit code {error.returncode}"
    if isinstance(error, subprocess.TimeoutExpired):
        return f"no answer in {TIMEOUT_S:g} s"
    return str(error)
