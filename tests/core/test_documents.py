"""Documents a user points kvchat at: what is not a text file, or cannot fit, is refused
before it is read (or, for text, as soon as tokenizing shows it cannot fit); standard input
and several paths read as one document."""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import BinaryIO

import pytest

from kvchat.core.documents import (
    DocumentError,
    DocumentTooLongError,
    check_document,
    read_document,
)
from kvchat.core.folders import MAX_FILE_BYTES
from kvchat.core.memory import peak_rss, reset_peak_rss
from kvchat.core.plan import PlanRefusedError
from kvchat.core.sources import read_sources


def _refused_without_blocking(path) -> str:
    """read_document(path)'s refusal, from a thread that must end at once (a FIFO with no
    writer would block a plain open forever)."""
    errors: list[str] = []

    def read() -> None:
        try:
            read_document(path)
        except DocumentError as e:
            errors.append(str(e))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), f"reading {path} blocked"
    assert len(errors) == 1
    return errors[0]


def test_a_fifo_and_a_device_are_refused_without_reading(tmp_path):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        assert "not a regular file" in _refused_without_blocking(path)
        with pytest.raises(DocumentError, match="not a regular file"):
            check_document(path)


@pytest.fixture
def engine_8k(engine_fp32, settings_fp32):
    lc = replace(settings_fp32.long_context, max_seq_len=8192)
    return engine_fp32.with_settings(replace(settings_fp32, long_context=lc))


def test_a_file_too_large_to_fit_is_refused_before_it_is_read(tmp_path, engine_8k):
    huge = tmp_path / "huge.txt"
    with huge.open("wb") as f:
        f.truncate(4 << 30)  # 4 GiB, sparse: reading it would take 4 GiB of memory
    reset_peak_rss()
    before = peak_rss()
    with pytest.raises(PlanRefusedError) as e:
        engine_8k.read_document(huge)
    assert peak_rss() - before < 64 << 20
    message = str(e.value)
    assert (
        "4,294,967,296 bytes hold at least" in message
        and "more than 8,192 (long_context.max_seq_len)" in message
    )


def test_tokenizing_stops_once_the_text_cannot_fit(engine_8k, tmp_path):
    sample = resources.files("kvchat.core").joinpath("data", "sample.txt").read_text("utf-8")
    text = sample * (1 + 600_000 // len(engine_8k.tokenizer.encode(sample)))  # ~70x 8K tokens
    path = tmp_path / "long.txt"
    path.write_text(text)
    doc = engine_8k.read_document(path)  # small enough to read: its size alone proves nothing
    progress: list[tuple[int, int]] = []
    with pytest.raises(PlanRefusedError) as e:
        engine_8k.encode_document(doc, lambda done, total: progress.append((done, total)))
    done, total = progress[-1]
    assert done < total / 4  # stopped early, not after tokenizing the whole text
    assert "holds more than 8,192 tokens (long_context.max_seq_len)" in str(e.value)


def piped(data: bytes) -> BinaryIO:
    """The reading end of a real pipe that a thread fills with `data`, then closes."""
    read_fd, write_fd = os.pipe()

    def write() -> None:
        # A reader that stops at its bound, or reads nothing, closes the pipe early.
        with contextlib.suppress(BrokenPipeError), os.fdopen(write_fd, "wb") as f:
            f.write(data)

    threading.Thread(target=write, daemon=True).start()
    return os.fdopen(read_fd, "rb")


def test_standard_input_is_read_as_the_document() -> None:
    text = "The meeting is on Tuesday. " * 10_000  # more than a pipe holds at once
    doc = read_sources(["-"], stdin=piped(text.encode()))
    assert doc.text == text and doc.name == "stdin" and doc.paths == (Path("-"),)


def test_standard_input_is_bounded_and_refused_empty_or_absent() -> None:
    with pytest.raises(DocumentTooLongError):
        read_sources(["-"], max_bytes=1000, stdin=piped(b"x" * 5000))
    with pytest.raises(DocumentError) as e:
        read_sources(["-"], stdin=piped(b" \n"))
    assert str(e.value) == "-: standard input is empty"
    with pytest.raises(DocumentError, match="no standard input to read here"):
        read_sources(["-"], stdin=None)
    with pytest.raises(DocumentError, match="standard input can be read only once"):
        read_sources(["-", "-"], stdin=piped(b"x"))


def test_several_paths_are_one_document_each_file_under_its_header(tmp_path: Path) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("Notes.\n")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("A = 1\n")
    doc = read_sources([notes, f"{tmp_path}/src/", "-"], stdin=piped(b"Piped."))
    assert doc.text == (
        f"==> {notes} <==\nNotes.\n\n==> {tmp_path}/src/a.py <==\nA = 1\n\n==> stdin <==\nPiped.\n"
    )
    assert doc.name == "notes.txt and 2 more"
    assert doc.files == (str(notes), f"{tmp_path}/src/a.py", "stdin")
    (tmp_path / "empty.txt").write_text("")
    with pytest.raises(DocumentError, match="the file is empty"):
        read_sources([notes, tmp_path / "empty.txt"])  # a file named is refused, not skipped


def test_a_folder_too_large_to_fit_is_refused_naming_it(tmp_path: Path, engine_8k) -> None:
    bound = 8192 * engine_8k.tokenizer.bytes_per_token_bound
    size = MAX_FILE_BYTES // 2  # each file within the limit of one, all of them past the bound
    for i in range(bound // size + 2):
        (tmp_path / f"{i}.txt").write_text("x" * size)
    with pytest.raises(PlanRefusedError) as e:
        engine_8k.read_document(tmp_path)
    assert str(e.value).startswith(
        f"{tmp_path}: "
    ) and "more than 8,192 (long_context.max_seq_len)" in str(e.value)
