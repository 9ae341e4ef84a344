"""The exceptions that mean bad input or an unsuitable machine, not a bug in kvchat.

Front ends report these as one readable line (CLI: exit code 2; app: a notification) and
let anything else surface as the bug it is.
"""

from __future__ import annotations

from kvchat.client.http import ServerError
from kvchat.config import ConfigError
from kvchat.native.cpu import CpuLevelError

from .documents import DocumentError
from .history import HistoryError
from .model_config import UnsupportedModelError
from .plan import PlanRefusedError
from .snapshot import SnapshotError
from .tokenizer import TokenizerError
from .weights import WeightsError

USER_ERRORS: tuple[type[Exception], ...] = (
    ConfigError,
    DocumentError,
    PlanRefusedError,
    WeightsError,
    UnsupportedModelError,
    TokenizerError,
    SnapshotError,
    CpuLevelError,
    HistoryError,
    ServerError,
)
