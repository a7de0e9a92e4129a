"""Keeping the worker's own secrets from the step code it runs as the same user."""

from __future__ import annotations

import ctypes

_PR_SET_DUMPABLE = 4


def refuse_same_user_inspection() -> None:
    """Make /proc/<worker>/environ, /proc/<worker>/mem and ptrace unavailable to other processes
    of our user (step code runs as the same user and must not read the ledger DSN from us).
    Children get the default back when they exec. Linux only; a no-op elsewhere."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    except (OSError, AttributeError):
        pass
