"""The graceful stop (SIGTERM): no new step starts; the running one has until the deadline."""

from __future__ import annotations

import time

from retex.signalflag import SignalFlag


class Drain:
    def __init__(self, seconds: float):
        self.seconds = seconds
        self.requested = SignalFlag()  # set by the SIGTERM handler
        self._deadline: float | None = None

    def begin(self) -> None:
        """Called from the signal handler; the deadline counts from the first call."""
        if self._deadline is None:
            self._deadline = time.monotonic() + self.seconds
        self.requested.set()

    @property
    def deadline(self) -> float | None:
        """Monotonic time by which the running step must have ended; None while not draining."""
        return self._deadline
