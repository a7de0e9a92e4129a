"""Flags set from a signal handler: the pod's SIGTERM begins the worker's drain, and in a python
step's child the tether's SIGTERM sets `context.cancelled`. A handler runs between two bytecodes of
whatever the main thread is doing — possibly while it waits on that very flag."""

import subprocess
import sys

import pytest

FLAGS = {
    "the worker's drain": ("from retex.worker.drain import Drain", "Drain(30)", "begin()", "requested"),
    "a python step's cancelled": ("from retex.worker.context import StepContext",
                                  "StepContext('k', 'u', 's', 1, {}, {})", "cancelled.set()", "cancelled"),
}

PROGRAM = """
import os, signal, sys
{imports}

for k in range(1, 40):
    owner, lines = {make}, 0
    signal.signal(signal.SIGTERM, lambda *_: owner.{set})
    def trace(frame, event, arg):
        global lines
        if event == "line":
            lines += 1
            if lines == k:
                os.kill(os.getpid(), signal.SIGTERM)
        return trace
    sys.settrace(trace)
    while not owner.{flag}.wait(0.2):
        pass
    sys.settrace(None)
    print('set after line', k, flush=True)
"""


@pytest.mark.parametrize("flag", FLAGS)
def test_a_sigterm_landing_on_any_line_of_a_wait_on_the_flag_it_sets_ends_the_wait(flag):
    """The SIGTERM is made pending at the k-th traced line of the wait, for every k over its loop:
    a handler that took a lock the wait can be holding (an Event's) deadlocked at one of them."""
    imports, make, set_it, name = FLAGS[flag]
    program = PROGRAM.format(imports=imports, make=make, set=set_it, flag=name)
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=60)
    assert done.stdout.splitlines() == [f"set after line {k}" for k in range(1, 40)], done.stdout + done.stderr
