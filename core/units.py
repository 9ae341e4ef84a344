"""Byte counts as people read them (no torch here: the CLI's listings import it)."""

from __future__ import annotations


def format_size(n_bytes: int) -> str:
    """A size in the largest unit it reaches, one decimal: "1.5 GiB", "312.0 KiB", "17 B"."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes} B"
