"""Builds the C++ CPU kernels (kv/csrc/, core/csrc/) on first use and caches them.

They are compiled with the C++ compiler torch's extension builder finds, for the CPU level
kvchat runs at (kvchat.native.cpu: `-march=native`, or a lower level's -march), and cached
where torch caches extensions ($TORCH_EXTENSIONS_DIR, else ~/.cache/torch_extensions) under a
name that hashes the sources, the CPU and the level, so only the first process on a machine
pays the build. A finished build loads straight from its folder, wherever its sources are now:
a checkout and an installed wheel of the same sources share one build. The sources compile as
two units, the one that binds the module and the rest together (ATen's headers parse once),
in parallel under ninja. Where one cannot be built its
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
import importlib.util
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

from .cpu import cpu_flags, cpu_level, march

log = logging.getLogger(__name__)

INCLUDE = Path(__file__).with_name("include")
# How often a build in progress is reported.
REPORT_INTERVAL_S = 1.0
# Written into a build's folder once its module has loaded: the module there is complete.
BUILT = "kvchat.built"


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
    name = build_name(prefix, sources)
    build_dir = build_root() / name
    try:
        # 0755 even under a umask of 0, whose 0777 folder build_lock would refuse.
        build_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
        with build_lock(build_dir):
            built = _load_built(name, build_dir)
            if built is not None:
                return built
            units = _units(sources, build_dir)
            with _watch(build_dir, purpose, len(units)):
                module = _compile(name, units, build_dir)
            (build_dir / BUILT).write_text(Path(module.__file__).name + "\n")
            return module
    except (OSError, RuntimeError, ImportError) as err:
        reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
        log.warning("the C++ kernels for %s could not be built (%s); %s", purpose, reason, fallback)
        return None


def _units(sources: Sequence[Path], build_dir: Path) -> list[Path]:
    """What the build compiles: a source that defines the module (with pybind11's headers)
    alone, the others as one translation unit that includes them. Each file alone parses
    ATen's headers again, ~9 s on a 2-core AVX2 machine: kv/csrc's seven take 76 s of CPU
    as seven units and 28 s as one (one core; the module's own file beside it on the other)."""
    binds = [src for src in sources if "PYBIND11_MODULE" in src.read_text()]
    rest = [src for src in sources if src not in binds]
    paths = [str(src.resolve()) for src in rest]
    if len(rest) < 2 or any('"' in path or "\n" in path for path in paths):
        return list(sources)
    unit = build_dir / "kernels_unit.cpp"
    unit.write_text("".join(f'#include "{path}"\n' for path in paths))
    return [*binds, unit]


def _compile(name: str, sources: Sequence[Path], build_dir: Path) -> ModuleType:
    # Imported only to compile: it imports setuptools, which a process that imported the
    # standard library's distutils first (pip does) cannot import.
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:
        # torch runs `ninja` from PATH; the ninja wheel puts it next to the interpreter, which
        # is not on PATH when the virtual environment is not activated (as under `make test`).
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return cpp_extension.load(
        name=name,
        sources=[str(path) for path in sources],
        extra_cflags=flags(),
        extra_ldflags=["-fopenmp"],
        extra_include_paths=[str(INCLUDE)],
        build_directory=str(build_dir),
    )


def build_root() -> Path:
    """Where the builds are cached: $TORCH_EXTENSIONS_DIR, else torch's default folder."""
    if root := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(root)
    from torch.utils import cpp_extension

    return Path(cpp_extension.get_default_build_root())


def _load_built(name: str, build_dir: Path) -> ModuleType | None:
    """The module of a finished build in build_dir, or None where there is none. Its name
    hashes the sources' contents, so it is theirs whichever folder they were compiled from,
    and it loads without running the compiler or ninja."""
    marker = build_dir / BUILT
    if not marker.is_file():
        return None
    file_name = marker.read_text().strip()
    library = build_dir / file_name
    if Path(file_name).name != file_name or not library.is_file():
        return None
    # Its own name: torch adds a version (name_v1) to a second build of one name in a process.
    spec = importlib.util.spec_from_file_location(file_name.partition(".")[0], library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_name(prefix: str, sources: Sequence[Path]) -> str:
    """The cached build's name: a hash of the sources, the headers they may include (the
    shared ones and any beside them), this torch and Python, this CPU and the level it is
    built for (a home directory shared with another CPU model must not load it)."""
    headers = sorted(
        {*INCLUDE.glob("*.h"), *(h for src in sources for h in src.parent.glob("*.h"))}
    )
    text = b"".join(path.read_bytes() for path in [*sources, *headers])
    import torch  # here, not at import: the CLI's first lines must not wait for torch

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
