"""What every background loop of the operator shares: a thread body that runs rounds, can be
woken early and stopped, and survives a failed round (counted, logged, retried a second later)."""

from __future__ import annotations

import logging
import threading

from retex.ledger import LedgerError
from retex.operator.metrics import count_failure

log = logging.getLogger(__name__)

RETRY_AFTER_FAILURE_SECONDS = 1.0


class Loop:
    name = "loop"

    def __init__(self) -> None:
        self.wake = threading.Event()  # set it to run the next round now rather than at its interval
        self._stop = threading.Event()

    def round(self) -> float:
        """One pass; returns how long to wait before the next (unless woken)."""
        raise NotImplementedError

    def run(self) -> None:
        delay = 0.0
        while not self.stopping:
            self.pause(delay)
            if self.stopping:
                return
            try:
                delay = self.round()
            except LedgerError as exc:
                count_failure(self.name, exc)
                log.warning("%s: ledger unavailable: %s", self.name, exc)
                delay = RETRY_AFTER_FAILURE_SECONDS
            except Exception as exc:  # the API server down or refusing, or a bug: try again soon
                count_failure(self.name, exc)
                log.exception("%s: round failed; retrying", self.name)
                delay = RETRY_AFTER_FAILURE_SECONDS

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
