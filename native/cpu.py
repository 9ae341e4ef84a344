"""What this CPU runs: the instruction-set level every compute choice of kvchat follows.

The level is read once from the CPU's flags. It sets the flags the C++ kernels are built with
(each kernel has a path per level) and whether bf16 matrix products run in hardware, which
decides how the model's large products are computed (core/linear.py, kv/attention.py).
KVCHAT_CPU_LEVEL (read here and nowhere else) lowers it, so that one machine can build and
test the paths of a smaller CPU: `KVCHAT_CPU_LEVEL=avx2` on an AVX-512 machine builds the
kernels for x86-64-v3 and makes every choice an AVX2-only CPU makes.
"""

from __future__ import annotations

import enum
import os
import platform
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

LEVEL_ENV = "KVCHAT_CPU_LEVEL"


class CpuLevel(enum.Enum):
    """Instruction-set levels, lowest first."""

    BASELINE = "baseline"  # any CPU (aarch64, x86 without AVX2): compiler-vectorised C++
    AVX2 = "avx2"  # x86-64-v3: AVX2, FMA, F16C
    AVX512 = "avx512"  # x86-64-v4: AVX-512 F, BW, VL, DQ
    AVX512_BF16 = "avx512-bf16"  # and bf16 products in hardware (AVX512-BF16 or AMX)

    @property
    def rank(self) -> int:
        return list(CpuLevel).index(self)

    @property
    def bf16_products(self) -> bool:
        """Whether bf16 matrix products run in hardware; elsewhere torch emulates them, and
        kvchat multiplies the bf16 values widened to fp32 instead (exact products)."""
        return self is CpuLevel.AVX512_BF16


# The -march of each level when it is below the machine's own (the machine's is `native`).
_MARCH = {
    CpuLevel.AVX2: "x86-64-v3",
    CpuLevel.AVX512: "x86-64-v4",
}
_X86_BASELINE_MARCH = "x86-64-v2"


class CpuLevelError(ValueError):
    """KVCHAT_CPU_LEVEL names no level, or one this CPU cannot run."""


@cache
def cpuinfo() -> str:
    """The text of /proc/cpuinfo ("" where there is none): the CPU's flags and model name."""
    try:
        return Path("/proc/cpuinfo").read_text(encoding="ascii", errors="ignore")
    except OSError:
        return ""


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo gives none)."""
    for line in cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def detect_level(flags: frozenset[str], machine: str) -> CpuLevel:
    """The highest level a CPU with these flags runs."""
    if machine not in ("x86_64", "AMD64"):
        return CpuLevel.BASELINE
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        bf16 = "avx512_bf16" in flags or "amx_bf16" in flags
        return CpuLevel.AVX512_BF16 if bf16 else CpuLevel.AVX512
    if {"avx2", "fma", "f16c"} <= flags:
        return CpuLevel.AVX2
    return CpuLevel.BASELINE


@cache
def machine_level() -> CpuLevel:
    """The highest level this CPU runs."""
    return detect_level(cpu_flags(), platform.machine())


@cache
def cpu_level() -> CpuLevel:
    """The level kvchat runs at: the machine's, or the lower one KVCHAT_CPU_LEVEL asks for."""
    text = os.environ.get(LEVEL_ENV, "").strip().lower()
    machine = machine_level()
    if not text:
        return machine
    try:
        level = CpuLevel(text)
    except ValueError:
        names = ", ".join(lv.value for lv in CpuLevel)
        raise CpuLevelError(
            f"{LEVEL_ENV}={text!r} names no CPU level; choose one of {names}"
        ) from None
    if level.rank > machine.rank:
        raise CpuLevelError(
            f"{LEVEL_ENV}={level.value} is above what this CPU runs ({machine.value})"
        )
    return level


def widened_products(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether products in `dtype` on `device` run in fp32 on the widened values: bf16 on a CPU
    without bf16 products in hardware, where torch emulates them (its oneDNN path refuses and
    its fallback runs at a fraction of fp32's speed). The products are exact either way.
    torch's own check (the CPU's cpuid) must agree too: an emulator may pass the host's
    /proc/cpuinfo through while offering fewer instructions."""
    import torch  # here, not at import: the CLI's first lines must not wait for torch

    if device.type != "cpu" or dtype != torch.bfloat16:
        return False
    return not (cpu_level().bf16_products and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def march(level: CpuLevel) -> str:
    """The -march the C++ kernels are built with for `level` on this machine."""
    if level is machine_level():
        return "native"
    if level is CpuLevel.BASELINE:
        return _X86_BASELINE_MARCH
    return _MARCH[level]


def cpu_name() -> str:
    """The CPU's model name ("AMD EPYC ...", "Intel(R) Xeon(R) ..."), for benchmark reports:
    speed differs by machine class, so every result says which one it ran on."""
    for line in cpuinfo().splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and value.strip():
            return value.strip()
    return platform.processor() or platform.machine()
