"""What every background loop of the operator shares: a thread body that can be woken early and
stopped."""

from __future__ import annotations

import threading


class Loop:
    def __init__(self) -> None:
        self.wake = threading.Event()  # set it to run the next round now rather than at its interval
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()
        self.wake.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def pause(self, seconds: float) -> None:
        """Sleep until `seconds` pass, the loop is woken, or it is stopped."""
        self.wake.wait(seconds)
        self.wake.clear()
