"""Process memory: what this process holds, its peak, and giving freed heap back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
import resource
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

if TYPE_CHECKING:
    import torch


@cache
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None


def release_freed_memory() -> None:
    """Return freed heap pages to the OS (glibc's malloc_trim; nothing elsewhere).

    Loading a model builds fp32 copies of every tensor in MB-sized pieces that glibc keeps in
    its arenas after they are freed: ~0.65 GiB of RSS for SmolLM2-135M that the process never
    uses again but the memory plan would otherwise have to count.
    """
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


# Where Linux shows this process's cgroups, and where it mounts the cgroup file systems.
PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a number near 2^63


def available_memory() -> int:
    """Bytes this process can still take: the host's available memory, or less where a
    cgroup limit (a container's, a systemd slice's) leaves less. psutil alone reads the
    host's numbers, which inside a container approve plans the OOM killer then ends."""
    return min([psutil.virtual_memory().available, *_cgroup_room()])


def _cgroup_room() -> list[int]:
    """limit - usage of every memory cgroup this process is in, with its ancestors (a limit
    anywhere up the tree applies); v2 (memory.max / memory.current) and v1."""
    try:
        lines = PROC_CGROUP.read_text().splitlines()
    except OSError:
        return []
    room = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            base, files = CGROUP_ROOT, ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            base = CGROUP_ROOT / "memory"
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        else:
            continue
        folder = base / path.lstrip("/")
        for group in (folder, *folder.parents):
            if group == base.parent:
                break
            limit, usage = (_read_int(group / name) for name in files[:2])
            if limit is not None and usage is not None and limit < _NO_LIMIT:
                # Usage counts the page cache (the model file just read); its inactive part
                # is given back before the OOM killer acts.
                usage -= _stat(group / "memory.stat", files[2])
                room.append(max(limit - usage, 0))
    return room


def _stat(path: Path, key: str) -> int:
    """One counter of a cgroup's memory.stat; 0 when it cannot be read."""
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _read_int(path: Path) -> int | None:
    """The number in a cgroup file; None for "max", a missing or unreadable file."""
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def process_rss() -> int:
    return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Start a new peak: Linux resets the process's high-water mark (VmHWM) when "5" is
    written to /proc/self/clear_refs. False where that is not possible, and peak_rss() then
    keeps counting from the process's start."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _vm_hwm() is not None


def peak_rss() -> int:
    """The most resident memory since the last reset_peak_rss() (the process's start if none)."""
    hwm = _vm_hwm()
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _vm_hwm() -> int | None:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


@dataclass(frozen=True)
class GpuMemory:
    used_bytes: int
    total_bytes: int


@cache
def _nvml():  # noqa: ANN202 - the pynvml module, initialised once, or None
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no package, no driver, no GPU: no reading
        return None
    return pynvml


def gpu_memory(device: torch.device) -> GpuMemory | None:
    """Memory used on the CUDA `device` by every process, as the driver counts it (NVML,
    from nvidia-ml-py); None on other devices or where NVML cannot be read."""
    if device.type != "cuda" or (nvml := _nvml()) is None:
        return None
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(nvml.nvmlDeviceGetHandleByIndex(device.index or 0))
    except nvml.NVMLError:
        return None
    return GpuMemory(int(info.used), int(info.total))
