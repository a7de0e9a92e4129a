"""The ports tests start servers on: free, outside the kernel's ephemeral range (which outbound
connections take their local ports from, so one could take a port chosen there before the server
binds it), and never the same twice in one run."""

import socket
from pathlib import Path

from e2e.ports import free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range():
    ephemeral_start = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(10000 <= port < ephemeral_start for port in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))
