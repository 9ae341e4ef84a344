"""Test-wide environment: interpreter Triton, no hub access, a private KVCHAT_HOME."""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

# Must be set before any @triton.jit kernel runs, i.e. before kvchat.kv kernels are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Never read or write the developer's own ~/.kvchat from a test; nor leave the tests' behind.
os.environ["KVCHAT_HOME"] = tempfile.mkdtemp(prefix="kvchat-test-home-")
atexit.register(shutil.rmtree, os.environ["KVCHAT_HOME"], ignore_errors=True)
# The suite runs on the small bundled model: the default, Qwen2.5-Coder-0.5B, takes ~3.6x the
# compute a token. Tests of the default model itself unset this.
os.environ["KVCHAT_MODEL"] = "smollm2-135m"


def _own_share_of_the_cores() -> None:
    """Under pytest-xdist each worker computes on its own share of the cores, as on a smaller
    machine: two processes' torch threads on the same cores slow both many times over. Set
    before torch loads, so its thread pool and the engine count only this share."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker is None:
        return
    cores = sorted(os.sched_getaffinity(0))
    index, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.sched_setaffinity(0, cores[index % len(cores) :: count])


_own_share_of_the_cores()

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_flush_denormal(True)


@contextmanager
def level_set_to(value: str | None) -> Iterator[None]:
    """KVCHAT_CPU_LEVEL set to `value` (None: unset) inside the block, as a new process would
    read it; the level before is back after. Kernels already built stay loaded: what changes
    is every choice made from the level inside the block."""
    from kvchat.native.cpu import LEVEL_ENV, cpu_level

    before = os.environ.get(LEVEL_ENV)
    cpu_level.cache_clear()
    os.environ.pop(LEVEL_ENV, None)
    if value is not None:
        os.environ[LEVEL_ENV] = value
    try:
        yield
    finally:
        os.environ.pop(LEVEL_ENV, None)
        if before is not None:
            os.environ[LEVEL_ENV] = before
        cpu_level.cache_clear()


@pytest.fixture
def at_level():
    """level_set_to, for tests that make choices at another CPU level."""
    return level_set_to


def one_function_module(name: str, expression: str, declarations: str = "") -> str:
    """A C++ extension's source with one function, `name`(x) = `expression` for an int x, on
    Python's C API (it compiles in under a second; pybind11's headers take seconds)."""
    return f"""#include <Python.h>
#define JOIN2(a, b) a##b
#define JOIN(a, b) JOIN2(a, b)
#define TEXT2(x) #x
#define TEXT(x) TEXT2(x)
{declarations}
static PyObject* {name}(PyObject*, PyObject* arg) {{
  long x = PyLong_AsLong(arg);
  return PyLong_FromLong({expression});
}}
static PyMethodDef methods[] = {{{{"{name}", {name}, METH_O, nullptr}}, {{}}}};
static PyModuleDef module = {{
    PyModuleDef_HEAD_INIT, TEXT(TORCH_EXTENSION_NAME), nullptr, -1, methods}};
PyMODINIT_FUNC JOIN(PyInit_, TORCH_EXTENSION_NAME)() {{ return PyModule_Create(&module); }}
"""


@pytest.fixture
def twice_source(tmp_path, monkeypatch):
    """A one-function C++ extension's source, built into this test's own folder (a kernel
    build without the torch headers' minutes)."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "builds"))
    source = tmp_path / "twice.cpp"
    source.write_text(one_function_module("twice", "2 * x"))
    return source


@pytest.fixture(
    params=[
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
        ),
    ]
)
def device(request) -> str:
    """The CPU, and a CUDA GPU where there is one: code whose tensors live on both the host
    and the compute device mixes them up only where the two differ."""
    return request.param


@pytest.fixture(scope="session")
def smollm_path():
    from kvchat.core.model_files import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session", autouse=True)
def tokenizer_cache(smollm_path) -> Path:
    """The bundled model's tokenizer converted once into this process's data folder, where
    every process a test starts finds it as a user's does after the first start (converting
    it takes ~10 s; tests/core/test_tokenizer.py checks the conversion itself)."""
    from kvchat.config.home import Place, folder_for
    from kvchat.core.tokenizer import load_tokenizer

    load_tokenizer(smollm_path)
    return folder_for(Place.CACHE) / "tokenizers"


@pytest.fixture(scope="session")
def new_home(tokenizer_cache: Path) -> Callable[[Path], str]:
    """A fresh $KVCHAT_HOME at a path, for another process: empty but for the converted
    tokenizers."""

    def make(home: Path) -> str:
        shutil.copytree(tokenizer_cache, home / "cache" / "tokenizers")
        return str(home)

    return make


@pytest.fixture(scope="session")
def settings_fp32():
    """Default settings with exact fp32 compute, for comparisons against references."""
    from kvchat.config import load_settings

    return load_settings(overrides=["model.dtype=float32"]).settings


@pytest.fixture(scope="session")
def engine_fp32(settings_fp32):
    from kvchat.core.engine import Engine

    return Engine.load(settings_fp32)


@pytest.fixture
def fake_cgroups(tmp_path, monkeypatch):
    """fake_cgroups(proc_line, files): point kvchat.core.memory at a /proc/self/cgroup and a
    cgroup tree written here (file name under the tree -> its text)."""
    from kvchat.core import memory

    def write(proc_line: str, files: dict[str, str]) -> None:
        proc = tmp_path / "cgroup"
        proc.write_text(proc_line + "\n")
        root = tmp_path / "sys-fs-cgroup"
        for name, text in files.items():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            (root / name).write_text(text + "\n")
        monkeypatch.setattr(memory, "PROC_CGROUP", proc)
        monkeypatch.setattr(memory, "CGROUP_ROOT", root)

    return write


# Seconds each test file took in a full run (tests/durations.py writes it from a JUnit XML
# report); a file not listed counts a second a test.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest files first, each file's tests in their own order: pytest-xdist hands out
    whole files in this order (make test turns off its own reordering), so the last files
    handed out are short and the workers finish together."""
    seconds = json.loads(DURATIONS.read_text())
    root = Path(__file__).parent.parent
    files = Counter(item.path for item in items)
    cost = {
        path: seconds.get(path.relative_to(root).as_posix(), count)
        for path, count in files.items()
    }
    # A stable sort of the items themselves: a file's tests stay together, in their order.
    items.sort(key=lambda item: -cost[item.path])


def pytest_sessionstart(session: pytest.Session) -> None:
    """The C++ kernels are built (or loaded from the cache) before the first test, on every
    core: a build takes minutes on some CPUs, and no test's own waiting should include it.
    Under pytest-xdist this runs in the controller before the workers start, so a worker on
    its share of the cores only loads them."""
    if os.environ.get("PYTEST_XDIST_WORKER") is not None:
        return
    from kvchat.core import cpu_ops
    from kvchat.kv import cpu_kernel

    cpu_ops.load()
    cpu_kernel.load()
