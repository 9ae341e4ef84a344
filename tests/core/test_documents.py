"""Documents a user points kvchat at: what is not a text file, or cannot fit, is refused
before it is read (or, for text, as soon as tokenizing shows it cannot fit)."""

from __future__ import annotations

import os
import threading
from dataclasses import replace
from importlib import resources

import pytest

from kvchat.core.documents import DocumentError, check_document, read_document
from kvchat.core.memory import peak_rss, reset_peak_rss
from kvchat.core.plan import PlanRefusedError


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
    assert "4,294,967,296 bytes hold at least" in message and "max_seq_len is 8,192" in message


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
    assert "holds more than long_context.max_seq_len (8,192) tokens" in str(e.value)
