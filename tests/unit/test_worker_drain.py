"""The pod's SIGTERM begins the drain from a signal handler, which runs between two bytecodes of
whatever the worker's main thread is doing — possibly while it waits on the drain itself."""

import subprocess
import sys

PROGRAM = """
import os, signal, sys
from retex.worker.drain import Drain

for k in range(1, 40):
    drain, lines = Drain(30), 0
    signal.signal(signal.SIGTERM, lambda *_: drain.begin())
    def trace(frame, event, arg):
        global lines
        if event == "line":
            lines += 1
            if lines == k:
                os.kill(os.getpid(), signal.SIGTERM)
        return trace
    sys.settrace(trace)
    while not drain.requested.wait(0.2):
        pass
    sys.settrace(None)
    print('drained after line', k, flush=True)
"""


def test_a_sigterm_landing_on_any_line_of_a_wait_on_the_drain_ends_the_wait():
    """The SIGTERM is made pending at the k-th traced line of the wait, for every k over its loop:
    a handler that took a lock the wait can be holding (an Event's) deadlocked at one of them."""
    done = subprocess.run([sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == [f"drained after line {k}" for k in range(1, 40)], done.stdout + done.stderr
