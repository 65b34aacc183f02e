"""A free TCP port for a single-machine process group's rendezvous (the demo, the tests and the
benchmarks start their ranks on one: ``MASTER_PORT``).

A port from ``bind(0)`` is an ephemeral one, from the range the kernel also draws the local ends
of outgoing connections from: between the pick and rank 0's listen, another process's connection
(another job's ranks talking to their store) can take it, and rank 0 fails with EADDRINUSE while
the other ranks wait for a store that never comes (seen once in a run of the test suite,
2026-11-27). So the port is drawn at random outside that range and checked free by binding it.
"""

from __future__ import annotations

import random
import socket

_LINUX_DEFAULT = (32768, 60999)


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives the local ends of outgoing connections (and ``bind(0)``)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = map(int, f.read().split())
    except (OSError, ValueError):
        return _LINUX_DEFAULT
    return lo, hi


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on ``host`` now, outside :func:`ephemeral_range` where one is (else the
    kernel's choice)."""
    lo, hi = ephemeral_range()
    pick = random.Random()  # (not the global generator, which callers may seed)
    for _ in range(200):
        port = pick.randrange(10000, 65536)
        if lo <= port <= hi:
            continue
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:  # in use
                continue
            return port
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
