"""Data files inside installed packages, found without importing them: a package that only
carries data may fail on import, and importing runs its code."""

from __future__ import annotations

import importlib.util
from pathlib import Path


def installed_file(package: str, *parts: str) -> Path | None:
    """The file at `parts` inside the installed top-level `package`, or None."""
    spec = importlib.util.find_spec(package)
    folders = spec.submodule_search_locations if spec is not None else None
    path = Path(folders[0]).joinpath(*parts) if folders else None
    return path if path is not None and path.is_file() else None
