"""The block-sparse KV cache: bookkeeping (cache.py), block selection (selector.py) and the
compute paths chosen once per cache (paths.py)."""

from .cache import POSITION_MODES, RETUNABLE, SparseBackend
from .geometry import CacheGeometry, window_capacity
from .paths import AttendPath, CpuKernelPath, FusedCpuPath, TorchPath, TritonPath, choose_path

__all__ = [
    "POSITION_MODES",
    "RETUNABLE",
    "AttendPath",
    "CacheGeometry",
    "CpuKernelPath",
    "FusedCpuPath",
    "SparseBackend",
    "TorchPath",
    "TritonPath",
    "choose_path",
    "window_capacity",
]
