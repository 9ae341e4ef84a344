"""Builds the C++ kernels of the CPU levels below this machine's that the suite runs into
$TORCH_EXTENSIONS_DIR: the baseline's weight products (tests/core/test_int4_layer.py), and on
a CPU above AVX2 both kernels at AVX2 (the Makefile's second run of the level tests). `make
test` runs it beside the package check, whose pip installs leave a core idle, so that no test
waits for a compiler.

Usage: TORCH_EXTENSIONS_DIR=FOLDER python tests/build_lower_levels.py
"""

from __future__ import annotations

import os
import sys

from kvchat.core import cpu_ops
from kvchat.kv import cpu_kernel
from kvchat.native.cpu import LEVEL_ENV, CpuLevel, cpu_level, machine_level


def main() -> int:
    builds = {CpuLevel.BASELINE: [cpu_ops.build]}
    if machine_level().rank > CpuLevel.AVX2.rank:
        builds[CpuLevel.AVX2] = [cpu_ops.build, cpu_kernel.load.__wrapped__]
    for level, builders in builds.items():
        if level is machine_level():  # a baseline CPU: its own build is the package check's
            continue
        os.environ[LEVEL_ENV] = level.value
        cpu_level.cache_clear()
        for build in builders:
            if build() is None:
                print(f"build_lower_levels: no build at {level.value}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
