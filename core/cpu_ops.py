"""The decoder's C++ ops on the CPU (core/csrc/decoder_ops.cpp, core/csrc/int4_layer.cpp).

The small ones replace several torch ops of a decode step with one call computing the same
bf16 values but for rare last-bit roundings (RMSNorm: ~2 us here against eight ops' ~38 us;
SiLU-and-multiply: three); `int8_linear` runs a GGUF's Q8_0, Q5_0 and Q6_K weights as
stored; the int4 ones run Q4_0 / Q4_1 / Q4_K products on packed weights
(core/int4_layer.py). Built on first use by kvchat.native; where they cannot be built the
model keeps its torch code.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from types import ModuleType

from kvchat.native import build_extension

SOURCES = [
    Path(__file__).with_name("csrc") / name for name in ("decoder_ops.cpp", "int4_layer.cpp")
]


def build() -> ModuleType | None:
    """The ops' module built for the CPU level now in force, or None (with a warning logged)
    when it cannot be built."""
    return build_extension(
        "kvchat_decoder_ops",
        SOURCES,
        "the int4 and int8 weight products",
        "the weights run through torch's int4 kernel and the output layer in bf16 "
        "(a decode step ~2x slower)",
    )


# The process's module: built (or loaded from the cache) once.
load = cache(build)
