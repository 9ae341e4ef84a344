"""What the benchmarks report about the machine they ran on."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.native.cpu import cpu_name


def test_cpu_name_is_the_model_name_of_proc_cpuinfo():
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo on this system")
    names = [
        line.split(":", 1)[1].strip()
        for line in cpuinfo.read_text().splitlines()
        if line.startswith("model name")
    ]
    if not names:
        pytest.skip("this kernel's /proc/cpuinfo names no model")
    assert cpu_name() == names[0]
