"""docs/screenshot.svg: the app mid-answer over a long document, as an SVG.

    python -m kvchat.tui.screenshot docs/screenshot.svg [--copies 20]

Runs the real app and model headless with the default settings (not the user's file): loads
the bundled sample text repeated `--copies` times as the document (20 copies: about 31K tokens,
four times the model's trained context), asks a question and saves `App.save_screenshot` once
part of the answer has streamed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

from textual.pilot import Pilot

from kvchat.config import Settings, apply_overrides

from .app import KvchatApp

SIZE = (150, 46)
QUESTION = "Who designed the Harrow Point Lighthouse, and why was it built?"
OVERRIDES = ["generation.max_new_tokens=160"]
STREAMED_CHARS = 120  # the answer so far when the picture is taken


async def _until(pilot: Pilot, condition: Callable[[], bool], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("the app did not get there in time")
        await pilot.pause(0.05)


def take_screenshot(out: Path, copies: int) -> None:
    sample = resources.files("kvchat.core").joinpath("data/sample.txt").read_text("utf-8")
    app = KvchatApp(apply_overrides(Settings(), OVERRIDES))

    async def drive(pilot: Pilot) -> None:
        with tempfile.TemporaryDirectory() as folder:
            doc = Path(folder) / "harrow-point.txt"
            doc.write_text("\n\n".join([sample] * copies), encoding="utf-8")
            await _until(pilot, lambda: app.engine is not None and not app.busy)
            app.load_document(doc)
            await _until(pilot, lambda: app.document is not None and not app.busy)
        app.query_one("#prompt").focus()
        await pilot.press(*QUESTION, "enter")
        await _until(pilot, lambda: app.reply is None or len(app.reply.text) >= STREAMED_CHARS)
        app.refresh_stats()
        await pilot.pause(0.3)
        app.save_screenshot(filename=out.name, path=str(out.parent))
        app.exit()

    app.run(headless=True, size=SIZE, auto_pilot=drive)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvchat.tui.screenshot", description=__doc__)
    parser.add_argument("out", type=Path, help="the SVG file to write")
    parser.add_argument("--copies", type=int, default=20, help="sample texts in the document")
    args = parser.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    take_screenshot(args.out, args.copies)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
