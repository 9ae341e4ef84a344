"""Test-wide environment: interpreter Triton, no hub access, a private KVCHAT_HOME."""

from __future__ import annotations

import os
import tempfile

# Must be set before any @triton.jit kernel runs, i.e. before kvchat.kv kernels are imported.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
# Never read or write the developer's own ~/.kvchat from a test.
os.environ["KVCHAT_HOME"] = tempfile.mkdtemp(prefix="kvchat-test-home-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_flush_denormal(True)


@pytest.fixture(scope="session")
def smollm_path():
    from kvchat.core.weights import resolve_model_path

    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def settings_fp32():
    """Default settings with exact fp32 compute, for comparisons against references."""
    from kvchat.config import load_settings

    return load_settings(overrides=["model.dtype=float32"]).settings


@pytest.fixture(scope="session")
def engine_fp32(settings_fp32):
    from kvchat.core.engine import Engine

    return Engine.load(settings_fp32)
