"""A TCP port for a test to hand to something that binds it later (a process group's store, a
Ray head): :func:`free_port`."""

from __future__ import annotations

import random
import socket

#: Where :func:`free_port` picks: below Linux's ephemeral range (32768-60999 here,
#: /proc/sys/net/ipv4/ip_local_port_range: the local port of every outgoing connection, Ray's and
#: vLLM's included) and above Ray's worker ports (10002-19999 by default).
PORTS = (20000, 32767)


def free_port() -> int:
    """A TCP port free on every interface now, at random from :data:`PORTS`.

    ``bind(("127.0.0.1", 0))`` hands out an ephemeral port, which any outgoing connection of
    another process may take between this check and the caller's own bind (``EADDRINUSE``: a
    gloo group's store failed so in a clean CI run); outside that range only a listener can."""
    rng = random.SystemRandom()
    for _ in range(500):
        port = rng.randint(*PORTS)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free TCP port in {PORTS[0]}-{PORTS[1]} after 500 tries")
