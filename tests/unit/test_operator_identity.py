"""The operator runs in its image as uid 65532, which has no account there (no /etc/passwd entry),
as in any image run under an arbitrary uid. kopf names itself from the account unless it is given
an identity (kopf's peering.detect_own_id → getpass.getuser()), which raised KeyError and stopped
every replica as soon as it led (seen on kind)."""

from __future__ import annotations

import subprocess
import sys

# A stand-in Runtime (pure: the leading check and the election's identity) around the real
# _operate and kopf; kopf then fails to log in (no cluster), after the point that matters.
PROGRAM = """
import asyncio, logging, types
logging.basicConfig(level=logging.DEBUG)
from retex.operator import main
from retex.operator.handlers import Runtime  # registers the handlers, as main() does
runtime = types.SimpleNamespace(may_write=lambda: True, leadership=types.SimpleNamespace(
    identity="retex-operator-0_1a2b3c4d", timing=types.SimpleNamespace(retry_period=1.0)))
try:
    asyncio.run(asyncio.wait_for(main._operate(runtime, namespaces=["tenant-a"]), 5))
except BaseException as exc:
    print("operator ended:", type(exc).__name__, exc)
"""


def test_the_operator_starts_kopf_under_a_uid_with_no_account():
    done = subprocess.run(
        ["unshare", "--user", "--map-user=65532", "--map-group=65532",  # uid 65532, no passwd entry
         "env", "-i", "PATH=/usr/bin:/bin", sys.executable, "-c", PROGRAM],
        capture_output=True, text=True, timeout=60)
    output = done.stdout + done.stderr
    assert "uid not found: 65532" not in output
    assert "Initial authentication has been initiated" in output, output[-3000:]  # kopf went past naming itself
