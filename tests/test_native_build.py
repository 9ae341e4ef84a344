"""Kernel builds: named for their sources and CPU level, reported while they run, never
blocked by a build that was killed, never in a folder another user could write to, and a
failed build says what falls back."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from kvchat import native
from kvchat.native import build_extension, build_lock, build_name, build_reports
from kvchat.native.cpu import CpuLevel, CpuLevelError, cpu_level, machine_level

# A child that takes the build lock, leaves torch's lock file as a build in progress does,
# says so, and waits to be killed.
HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from kvchat.native import build_lock
    folder = Path(sys.argv[1])
    with build_lock(folder):
        (folder / "lock").touch()
        print("holding", flush=True)
        time.sleep(600)
    """
)


def _holder(folder) -> subprocess.Popen:
    child = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "holding"
    return child


def test_a_build_killed_halfway_does_not_block_the_next(tmp_path):
    child = _holder(tmp_path)
    child.kill()
    child.wait()
    assert (tmp_path / "lock").exists()  # torch would wait on this file forever
    with build_lock(tmp_path):
        assert not (tmp_path / "lock").exists()


def test_a_live_build_is_waited_for(tmp_path):
    child = _holder(tmp_path)
    acquired = threading.Event()

    def take() -> None:
        with build_lock(tmp_path):
            acquired.set()

    thread = threading.Thread(target=take)
    thread.start()
    try:
        assert not acquired.wait(1.0)  # the child still builds
    finally:
        child.kill()
        child.wait()
    assert acquired.wait(120)
    thread.join()


def test_a_header_beside_the_sources_names_a_new_build(tmp_path):
    source, header = tmp_path / "ops.cpp", tmp_path / "ops.h"
    source.write_text('#include "ops.h"\n')
    header.write_text("int f();\n")
    first = build_name("kvchat_test", [source])
    assert build_name("kvchat_test", [source]) == first
    header.write_text("int f(int);\n")
    assert build_name("kvchat_test", [source]) != first


def test_a_lower_cpu_level_is_another_build_with_its_own_march(tmp_path, at_level):
    if machine_level() is CpuLevel.BASELINE:
        pytest.skip("this CPU runs no level below baseline")
    source = tmp_path / "ops.cpp"
    source.write_text("int f();\n")
    with at_level("baseline"):
        assert "-march=x86-64-v2" in native.flags()
        lowered = build_name("kvchat_test", [source])
    with at_level(None):
        assert "-march=native" in native.flags()
        assert build_name("kvchat_test", [source]) != lowered


def test_a_build_is_reported_while_it_runs_and_when_it_is_done(twice_source, monkeypatch):
    # Reports every 20 ms: a compile and a link through ninja take several times that.
    monkeypatch.setattr(native, "REPORT_INTERVAL_S", 0.02)
    source = twice_source
    seen = []
    with build_reports(seen.append):
        module = build_extension("kvchat_test", [source], "doubling", "nothing doubles")
    assert module is not None and module.twice(21) == 42
    assert seen and seen[-1].done and seen[-1].compiled == 1 and seen[-1].sources == 1
    assert not any(p.done for p in seen[:-1])
    assert "built the C++ kernels for doubling" in seen[-1].line()
    # Loading the cached build compiles nothing and reports nothing.
    monkeypatch.setattr(native, "REPORT_INTERVAL_S", 1.0)
    seen.clear()
    with build_reports(seen.append):
        assert build_extension("kvchat_test", [source], "doubling", "nothing doubles") is not None
    assert seen == []


def test_the_same_sources_in_another_folder_load_the_finished_build(twice_source):
    # A checkout and an installed wheel hold the same sources in different folders.
    first = build_extension("kvchat_test", [twice_source], "doubling", "nothing doubles")
    assert first is not None
    build_dir = native.build_root() / build_name("kvchat_test", [twice_source])

    def files() -> dict[str, int]:
        # The lock file is opened (and so touched) by every load.
        return {
            p.name: p.stat().st_mtime_ns for p in build_dir.iterdir() if p.name != "kvchat.lock"
        }

    before = files()
    moved = twice_source.parent / "installed" / twice_source.name
    moved.parent.mkdir()
    moved.write_text(twice_source.read_text())
    seen = []
    with build_reports(seen.append):
        module = build_extension("kvchat_test", [moved], "doubling", "nothing doubles")
    assert module is not None and module.twice(21) == 42
    # Nothing compiled, linked or rewritten: torch's loader would have rebuilt for the new paths.
    assert files() == before
    assert seen == []


def test_a_failed_build_says_what_falls_back(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    source = tmp_path / "broken.cpp"
    source.write_text("this is not C++\n")
    with caplog.at_level(logging.WARNING, logger="kvchat.native"):
        assert build_extension("kvchat_test", [source], "breaking", "torch runs instead") is None
    assert "the C++ kernels for breaking could not be built" in caplog.text
    assert "torch runs instead" in caplog.text


@pytest.mark.parametrize(
    ("flags", "machine", "level"),
    [
        # AMD EPYC Zen 3
        ("fma avx2 f16c bmi2 sse4_2", "x86_64", CpuLevel.AVX2),
        # AMD EPYC Zen 4
        (
            "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_bf16 avx512_vnni",
            "x86_64",
            CpuLevel.AVX512_BF16,
        ),
        # Intel Xeon with AMX
        (
            "avx2 fma f16c avx512f avx512bw avx512vl avx512dq amx_bf16 avx512_vnni",
            "x86_64",
            CpuLevel.AVX512_BF16,
        ),
        # Intel Skylake-SP
        ("avx2 fma f16c avx512f avx512bw avx512vl avx512dq", "x86_64", CpuLevel.AVX512),
        ("sse4_2 avx", "x86_64", CpuLevel.BASELINE),
        ("fp asimd sve bf16", "aarch64", CpuLevel.BASELINE),
    ],
)
def test_the_level_follows_the_cpu_flags(flags, machine, level):
    from kvchat.native.cpu import detect_level

    assert detect_level(frozenset(flags.split()), machine) is level


@pytest.mark.parametrize("value", ["avx3", "AVX-512"])
def test_a_bad_level_is_one_clear_error(value, at_level):
    with at_level(value), pytest.raises(CpuLevelError, match="names no CPU level"):
        cpu_level()


def test_a_level_above_the_cpu_is_refused(at_level):
    above = [lv for lv in CpuLevel if lv.rank > machine_level().rank]
    if not above:
        pytest.skip("this CPU runs the highest level")
    with at_level(above[0].value), pytest.raises(CpuLevelError, match="above what this"):
        cpu_level()


def test_a_build_folder_others_may_write_to_is_refused(twice_source, caplog):
    build_dir = twice_source.parent / "builds" / build_name("kvchat_test", [twice_source])
    build_dir.mkdir(parents=True)
    build_dir.chmod(0o777)  # anyone could plant a module there for this user to load
    with pytest.raises(PermissionError, match=f"{build_dir} is writable by other users"):
        with build_lock(build_dir):
            pass
    with caplog.at_level(logging.WARNING, logger="kvchat.native"):
        assert build_extension("kvchat_test", [twice_source], "doubling", "torch doubles") is None
    (warning,) = caplog.messages
    assert f"{build_dir} is writable by other users (mode 777)" in warning
    assert warning.endswith("; torch doubles")
    assert list(build_dir.iterdir()) == []  # refused before anything is written there


@pytest.mark.skipif(os.geteuid() != 0, reason="only root gives a folder to another user")
def test_a_build_folder_of_another_user_is_refused(tmp_path):
    os.chown(tmp_path, 65534, 65534)
    with pytest.raises(PermissionError, match=f"{tmp_path} belongs to another user"):
        with build_lock(tmp_path):
            pass


# A child that builds the one-function extension and prints what it computes.
BUILDER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from kvchat.native import build_extension
    module = build_extension("kvchat_test", [Path(sys.argv[1])], "doubling", "none")
    print(module.twice(21) if module is not None else "no module", flush=True)
    """
)


@pytest.mark.slow
def test_two_processes_building_at_once_both_load_the_module(twice_source):
    children = [
        subprocess.Popen(
            [sys.executable, "-c", BUILDER, str(twice_source)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    results = [child.communicate(timeout=300) for child in children]
    assert [out.strip() for out, _ in results] == ["42", "42"], [err for _, err in results]


def test_the_sources_besides_the_modules_own_compile_as_one_unit(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    binds = tmp_path / "module.cpp"
    binds.write_text(  # pybind11's module macro names the file that binds the module
        "#include <pybind11/pybind11.h>\n"
        "int one(int x);\nint two(int x);\n"
        "int three(int x) { return two(one(x)); }\n"
        'PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("three", &three); }\n'
    )
    (tmp_path / "one.cpp").write_text("int one(int x) { return x + 1; }\n")
    (tmp_path / "two.cpp").write_text("int two(int x) { return x + 2; }\n")
    sources = [binds, tmp_path / "one.cpp", tmp_path / "two.cpp"]
    module = build_extension("kvchat_test", sources, "adding", "nothing adds")
    assert module is not None and module.three(1) == 4
    build_dir = native.build_root() / build_name("kvchat_test", sources)
    assert sorted(p.name for p in build_dir.glob("*.o")) == ["kernels_unit.o", "module.o"]
