"""A gate on the engine's step hook (`Engine.on_step`) for tests that act at a chosen step."""

from __future__ import annotations

import threading

from kvchat.core.steps import EngineStep


class StepGate:
    """Holds the engine's thread after a chosen step until the test lets it go on, so a test
    acts "while a document prefills" or "while a reply runs" on any machine: `arm` chooses
    the step (and which one of its kind), `held` is set once the thread waits there, `release`
    lets it go on (arm the next hold first, if there is one)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: tuple[EngineStep, int] | None = None
        self._go = threading.Event()
        self.held = threading.Event()

    def arm(self, step: EngineStep, nth: int = 1) -> None:
        with self._lock:
            self._armed = (step, nth)

    def __call__(self, step: EngineStep) -> None:
        with self._lock:
            if self._armed is None or self._armed[0] is not step:
                return
            if self._armed[1] > 1:
                self._armed = (step, self._armed[1] - 1)
                return
            self._armed = None
            self._go.clear()
            self.held.set()
        self._go.wait()

    def release(self) -> None:
        self.held.clear()
        self._go.set()

    def close(self) -> None:
        """Hold nothing more and let the thread go on."""
        with self._lock:
            self._armed = None
        self.release()

    # `async with app.run_test() as pilot, gate:` lets the engine go before the app stops: a
    # failing test must not leave the app waiting for a worker the gate holds.
    async def __aenter__(self) -> StepGate:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()
