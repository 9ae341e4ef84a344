"""The steps of an engine's long work, and the hook it calls after each one.

A document is tokenized in batches, prefilled in chunks and answered a token at a time; the
engine's thread calls `Engine.on_step` after each of those steps, before it looks at its
cancel event again. Whoever drives the engine can act there, or hold the thread there for as
long as it likes: the tests do, so "while a document prefills" is a state they choose, not a
moment they hope to catch on a machine of a given speed.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum


class EngineStep(StrEnum):
    TOKENIZED = "tokenized"  # a batch of the document's text became ids
    PREFILLED = "prefilled"  # a chunk of the prompt is cached
    SAMPLED = "sampled"  # a reply token is sampled, before it is handed out


StepHook = Callable[[EngineStep], None]
