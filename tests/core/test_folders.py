"""A folder read as a code base: its files in order under header lines, and what is left out
(ignored, hidden, binary, too large, links out, FIFOs), named with the reason."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from kvchat.core.documents import DocumentError, DocumentTooLongError
from kvchat.core.folders import MAX_FILE_BYTES, skip_summary
from kvchat.core.sources import read_sources

SAMPLE_REPO = Path(__file__).parents[1] / "fixtures" / "sample-repo"


def tree(root: Path, files: dict[str, str | bytes]) -> Path:
    """Write `files` (path under root: text or bytes) and return root."""
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)
    return root


def skipped(root: Path) -> dict[str, str]:
    return {s.path: s.reason for s in read_sources([root]).skipped}


def test_every_file_under_a_header_line_in_order_of_path(tmp_path: Path) -> None:
    root = tree(
        tmp_path / "proj",
        {"b.py": "B = 2\n", "a/z.py": "Z = 26", "a/b.txt": "bee\n", "README.md": "# Proj\n"},
    )
    doc = read_sources([root])
    assert doc.text == (
        "==> README.md <==\n# Proj\n\n"
        "==> a/b.txt <==\nbee\n\n"
        "==> a/z.py <==\nZ = 26\n\n"
        "==> b.py <==\nB = 2\n"
    )
    assert doc.files == ("README.md", "a/b.txt", "a/z.py", "b.py")
    assert doc.name == "proj/" and doc.skipped == () and doc.size_bytes == len(doc.text.encode())
    assert read_sources([root]).sha256 == doc.sha256  # the same folder reads the same
    (root / "b.py").write_text("B = 3\n")
    assert read_sources([root]).sha256 != doc.sha256


def test_the_sample_repo_leaves_out_its_ignored_log() -> None:
    doc = read_sources([SAMPLE_REPO])
    assert doc.files == (".gitignore", "README.md", "src/keeper.py", "src/lamp.py")
    assert skipped(SAMPLE_REPO) == {"debug.log": ".gitignore"}
    assert "Ada Fenwick" in doc.text and "a log file, ignored" not in doc.text


def test_gitignored_files_and_folders_are_skipped_and_named(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            ".gitignore": "build/\n*.log\n!keep.log\n# a comment\n!\n",  # "!" alone: invalid
            "build/out.js": "generated",
            "debug.log": "noise",
            "keep.log": "kept",
            "src/trace.log": "noise",
            "src/main.py": "print()",
        },
    )
    doc = read_sources([root])
    assert doc.files == (".gitignore", "keep.log", "src/main.py")
    assert skipped(root) == {
        "build/": ".gitignore",
        "debug.log": ".gitignore",
        "src/trace.log": ".gitignore",
    }
    assert skip_summary(doc.skipped) == "skipped 3 (.gitignore 3)"


def test_a_nested_gitignore_applies_below_its_folder_and_overrides_the_outer(
    tmp_path: Path,
) -> None:
    root = tree(
        tmp_path,
        {
            ".gitignore": "*.tmp\n",
            "secret.txt": "top",
            "sub/.gitignore": "secret.txt\n/local.md\n!keep.tmp\n",
            "sub/secret.txt": "s",
            "sub/deeper/secret.txt": "s",  # unanchored: ignored at any depth below sub/
            "sub/deeper/local.md": "l",  # anchored to sub/: kept
            "sub/keep.tmp": "k",
            "sub/other.tmp": "o",
        },
    )
    assert read_sources([root]).files == (
        ".gitignore",
        "secret.txt",
        "sub/.gitignore",
        "sub/deeper/local.md",
        "sub/keep.tmp",
    )
    assert skipped(root) == {
        "sub/deeper/secret.txt": ".gitignore",
        "sub/other.tmp": ".gitignore",
        "sub/secret.txt": ".gitignore",
    }


def test_hidden_folders_and_git_are_skipped_hidden_files_read(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {".git/config": "[core]", ".venv/lib.py": "x", ".editorconfig": "root = true", "a.py": ""},
    )
    assert read_sources([root]).files == (".editorconfig", "a.py")
    assert skipped(root) == {".git/": "hidden", ".venv/": "hidden"}


def test_binary_and_non_utf8_files_are_skipped(tmp_path: Path) -> None:
    root = tree(
        tmp_path,
        {
            "logo.png": b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR",
            "latin1.txt": "caf\xe9".encode("latin-1"),
            "ok.txt": "café",
        },
    )
    assert read_sources([root]).files == ("ok.txt",)
    assert skipped(root) == {"latin1.txt": "binary", "logo.png": "binary"}


def test_a_file_over_the_size_limit_is_skipped_unread(tmp_path: Path) -> None:
    root = tree(tmp_path, {"small.txt": "small"})
    with (root / "huge.csv").open("wb") as f:
        f.truncate(MAX_FILE_BYTES + 1)  # sparse, all NUL: read, it would be "binary"
    assert read_sources([root]).files == ("small.txt",)
    assert skipped(root) == {"huge.csv": "too large"}


def test_links_out_of_the_folder_or_to_a_folder_are_skipped(tmp_path: Path) -> None:
    outside = tree(tmp_path / "outside", {"secret.txt": "not in the folder"})
    root = tree(tmp_path / "root", {"a.txt": "A", "sub/b.txt": "B"})
    (root / "out.txt").symlink_to(outside / "secret.txt")
    (root / "out-dir").symlink_to(outside)
    (root / "in-dir").symlink_to(root / "sub")
    (root / "in.txt").symlink_to(root / "a.txt")
    (root / "broken.txt").symlink_to(root / "missing.txt")
    doc = read_sources([root])
    assert doc.files == ("a.txt", "in.txt", "sub/b.txt")
    assert "not in the folder" not in doc.text
    assert skipped(root) == {
        "broken.txt": "unreadable",
        "in-dir": "link",
        "out-dir": "link",
        "out.txt": "link",
    }


def test_a_fifo_in_the_folder_is_skipped_without_blocking(tmp_path: Path) -> None:
    root = tree(tmp_path, {"a.txt": "A"})
    os.mkfifo(root / "pipe.txt")  # no writer: opening it to read would wait forever
    result: list[object] = []
    reader = threading.Thread(target=lambda: result.append(read_sources([root])), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert not reader.is_alive(), "reading the folder blocked on its FIFO"
    [doc] = result
    assert doc.files == ("a.txt",)
    assert {s.path: s.reason for s in doc.skipped} == {"pipe.txt": "not a file"}


def test_a_folder_with_nothing_to_read_is_refused_in_one_line(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DocumentError) as e:
        read_sources([empty])
    assert str(e.value) == f"{empty}: no file to read in it"
    only_ignored = tree(tmp_path / "ignored", {".gitignore": "*\n", "x.log": "x"})
    with pytest.raises(DocumentError) as e:
        read_sources([only_ignored])
    assert str(e.value) == f"{only_ignored}: no file to read in it; skipped 2 (.gitignore 2)"
    assert "\n" not in str(e.value)


def test_reading_stops_once_the_text_passes_the_bound(tmp_path: Path) -> None:
    root = tree(tmp_path, {f"{i}.txt": "x" * 1000 + "\n" for i in range(10)})
    assert len(read_sources([root], max_bytes=20_000).files) == 10
    with pytest.raises(DocumentTooLongError) as e:
        read_sources([root], max_bytes=5_000)
    assert e.value.path == root and 5_000 < e.value.size_bytes < 6_200  # stopped at the 5th
