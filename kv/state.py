"""A backend's committed cache as plain data, so it can be written out and read back (snapshots).

Every backend exports a `CacheState` (small integers plus tensors, sliced to what is in use and
kept in the dtype they are stored in) and loads one into a freshly made cache of the same
layout. The file format lives in core/snapshot.py; this module only moves tensors in and out
and refuses a state whose tensors do not fit the cache they are loaded into.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


def _copy(dest: torch.Tensor, src: torch.Tensor) -> None:
    dest.copy_(src)


class StateMismatchError(ValueError):
    """A saved state does not fit the cache it is loaded into (other layout, dtype or size)."""


@dataclass(frozen=True)
class CacheState:
    """The committed part of a cache: scalars (positions, counts) and named tensors.

    Tensors may be views of the live cache (no copy is made to export a state), so a state is
    to be written out before the cache changes again.
    """

    scalars: dict[str, int]
    tensors: dict[str, torch.Tensor]
    # How a saved tensor goes into the cache: a snapshot maps its file's pages where it can.
    copy_into: Callable[[torch.Tensor, torch.Tensor], None] = _copy

    def scalar(self, name: str) -> int:
        if name not in self.scalars:
            raise StateMismatchError(f"the saved cache state has no {name!r} value")
        return self.scalars[name]

    def restore(self, views: dict[str, torch.Tensor]) -> None:
        """Copy every saved tensor into the cache view of the same name (with `copy_into`),
        after checking that the names, shapes and dtypes are exactly the cache's."""
        if set(views) != set(self.tensors):
            missing = sorted(set(views) - set(self.tensors))
            extra = sorted(set(self.tensors) - set(views))
            raise StateMismatchError(
                f"the saved cache state has other tensors than the cache "
                f"(missing {_few(missing)}, unexpected {_few(extra)})"
            )
        for name, dest in views.items():
            src = self.tensors[name]
            if src.dtype != dest.dtype or src.shape != dest.shape:
                raise StateMismatchError(
                    f"tensor {name!r} is {_describe(src)} in the saved state but the cache "
                    f"needs {_describe(dest)}"
                )
        for name, dest in views.items():
            self.copy_into(dest, self.tensors[name])


def _few(names: list[str]) -> str:
    if not names:
        return "none"
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
