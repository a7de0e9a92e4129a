"""Named crash points for the crash-point matrix: the process SIGKILLs itself exactly there.

`RETEX_FAILPOINT` names one point, optionally with a step: `after-effect` or `after-effect:charge`.
Read once at import, so an unset variable costs one comparison per point passed.
"""

from __future__ import annotations

import os
import signal
import sys

_ARMED = os.environ.get("RETEX_FAILPOINT", "")
_POINT, _, _STEP = _ARMED.partition(":")


def failpoint(point: str, step: str | None = None) -> None:
    if not _ARMED or point != _POINT or (_STEP and step != _STEP):
        return
    print(f"retex failpoint {_ARMED}: SIGKILL", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
