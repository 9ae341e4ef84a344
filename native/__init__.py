"""Builds the C++ CPU kernels (kv/csrc/, core/csrc/) on first use and caches them.

They are compiled with the C++ compiler torch's extension builder finds, for the CPU level
kvchat runs at (kvchat.native.cpu: `-march=native`, or a lower level's -march), and cached
where torch caches extensions ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions) under a
name that hashes the sources, the CPU and the level, so only the first process on a machine
pays the build. ninja compiles a build's sources in parallel. Where one cannot be built its
caller keeps a torch path and the warning says what that costs.

A build holds an flock on its folder: the kernel drops it when the process ends, however it
ends, so a build killed halfway never blocks the next one (torch's own lock file, which a
killed build leaves behind, is removed by whoever holds the flock). A folder of another user,
or one that others may write to, is refused: torch loads whatever module it finds there, so a
module planted by someone else would run as this user.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from .cpu import cpu_flags, cpu_level, march

log = logging.getLogger(__name__)

INCLUDE = Path(__file__).with_name("include")
# How often a build in progress is reported.
REPORT_INTERVAL_S = 1.0


@dataclass(frozen=True)
class BuildProgress:
    """A kernel build under way: which, for which CPU level, sources compiled so far."""

    name: str  # what the kernels do, e.g. "decode attention and block selection"
    level: str
    compiled: int
    sources: int
    elapsed_s: float
    done: bool = False

    def line(self) -> str:
        state = "built" if self.done else "building"
        return (
            f"{state} the C++ kernels for {self.name} ({self.level}; first start only): "
            f"{self.compiled}/{self.sources} sources, {self.elapsed_s:.0f} s"
        )


BuildReporter = Callable[[BuildProgress], None]
_reporters: list[BuildReporter] = []


@contextmanager
def build_reports(reporter: BuildReporter) -> Iterator[None]:
    """Send the progress of every kernel build inside the block to `reporter` (from a
    watcher thread, about once a second, and once when each build ends)."""
    _reporters.append(reporter)
    try:
        yield
    finally:
        _reporters.remove(reporter)


def flags() -> list[str]:
    """The compiler flags of a build at this CPU level."""
    return ["-O3", f"-march={march(cpu_level())}", "-ffast-math", "-fopenmp"]


def build_extension(
    prefix: str, sources: Sequence[Path], purpose: str, fallback: str
) -> ModuleType | None:
    """The module compiled from `sources` (with native/include on the include path), or None
    with a warning logged when it cannot be built. `purpose`: what the kernels do, for the
    progress line and the warning; `fallback`: what running without them costs."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        # torch runs `ninja` from PATH; the ninja wheel puts it next to the interpreter, which
        # is not on PATH when the virtual environment is not activated (as under `make test`).
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    name = build_name(prefix, sources)
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()
    build_dir = Path(root) / name
    try:
        # 0755 even under a umask of 0, whose 0777 folder build_lock would refuse.
        build_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        with build_lock(build_dir), _watch(build_dir, purpose, len(sources)):
            return cpp_extension.load(
                name=name,
                sources=[str(path) for path in sources],
                extra_cflags=flags(),
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(INCLUDE)],
                build_directory=str(build_dir),
            )
    except (OSError, RuntimeError, ImportError) as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        log.warning("the C++ kernels for %s could not be built (%s); %s", purpose, reason, fallback)
        return None


def build_name(prefix: str, sources: Sequence[Path]) -> str:
    """The cached build's name: a hash of the sources, the headers they may include (the
    shared ones and any beside them), this torch and Python, this CPU and the level it is
    built for (a home directory shared with another CPU model must not load it)."""
    headers = sorted(
        {*INCLUDE.glob("*.h"), *(h for src in sources for h in src.parent.glob("*.h"))}
    )
    text = b"".join(path.read_bytes() for path in [*sources, *headers])
    machine = " ".join(sorted(cpu_flags()))
    versions = f"{torch.__version__} {sys.version_info[:2]} {machine} {' '.join(flags())}"
    return f"{prefix}_{hashlib.sha256(text + versions.encode()).hexdigest()[:12]}"


@contextmanager
def build_lock(build_dir: Path) -> Iterator[None]:
    """Hold the build folder's flock (waiting for a live builder to finish); then torch's own
    lock file, if there is one, is a dead build's and is removed. Raises PermissionError for
    a folder this user may not trust (see _check_build_dir)."""
    _check_build_dir(build_dir)
    with open(build_dir / "kvchat.lock", "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                log.warning("removing the lock of a build that did not finish: %s", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _check_build_dir(build_dir: Path) -> None:
    """Raise PermissionError, in one line naming the folder, unless this user owns
    `build_dir` and no one else may write to it."""
    info = build_dir.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(
            f"{build_dir} belongs to another user (uid {info.st_uid}); not building in it"
        )
    if info.st_mode & 0o022:
        raise PermissionError(
            f"{build_dir} is writable by other users (mode {stat.S_IMODE(info.st_mode):o});"
            " not building in it"
        )


@contextmanager
def _watch(build_dir: Path, purpose: str, n_sources: int) -> Iterator[None]:
    """Report the build in build_dir to the registered reporters while the block runs, when
    it compiles anything (a cached build loads without a report)."""
    if not _reporters:
        yield
        return
    start = time.perf_counter()
    stop = threading.Event()
    reported = False

    def report(done: bool) -> None:
        compiled = min(len(list(build_dir.glob("*.o"))), n_sources)
        progress = BuildProgress(
            purpose, cpu_level().value, compiled, n_sources, time.perf_counter() - start, done
        )
        for reporter in list(_reporters):
            reporter(progress)

    def watch() -> None:
        nonlocal reported
        # A cached build loads in well under a second: report only one that takes longer.
        while not stop.wait(REPORT_INTERVAL_S):
            reported = True
            report(False)

    thread = threading.Thread(target=watch, name="kvchat-build-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        if reported:
            report(True)
