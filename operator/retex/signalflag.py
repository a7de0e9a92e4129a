"""A flag a signal handler may set.

Python runs a signal handler in the main thread between two bytecodes of whatever that thread was
doing. A handler that sets a `threading.Event` takes the Event's lock, and deadlocks the process
when the interrupted code was holding it (waiting on that same Event, as the worker waits on its
drain). Setting this flag is one assignment; waiting on it polls."""

from __future__ import annotations

import time

_POLL_SECONDS = 0.05


class SignalFlag:
    def __init__(self) -> None:
        self._set = False

    def set(self) -> None:
        self._set = True

    def clear(self) -> None:
        self._set = False

    def is_set(self) -> bool:
        return self._set

    def wait(self, timeout: float | None = None) -> bool:
        """True once set; False when `timeout` seconds passed first (None: no limit)."""
        end = None if timeout is None else time.monotonic() + timeout
        while not self._set:
            left = _POLL_SECONDS if end is None else end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, _POLL_SECONDS))
        return True
