"""Ports for the processes the tests and `make dev` start (Postgres, the rig's control plane, the
operator's endpoints): free now, and below the kernel's ephemeral range. A port the kernel hands
out for `bind(0)` comes from the range every outbound connection takes its local port from, so
between choosing it and the server's bind a client connection could take it (CI saw an operator
fail with EADDRINUSE on its ledger endpoint)."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_LOWEST = 10000
_handed_out: set[int] = set()  # never the same port twice in one process


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    """A port no socket holds now (bindable on every address), outside the ephemeral range and
    not handed out before by this process."""
    start = _ephemeral_start()
    candidates = list(range(_LOWEST, start)) if start > _LOWEST else []
    random.shuffle(candidates)
    for port in candidates:
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("0.0.0.0", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError(f"no free port between {_LOWEST} and the ephemeral range's start {start}")
