"""Fixtures shared by the weight-loading tests: the bundled SmolLM2 GGUF, loaded once."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.core.model_files import load_weights, resolve_model_path
from kvchat.core.weights import ModelWeights


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model_path("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_weights() -> ModelWeights:
    return load_weights("smollm2-135m")
