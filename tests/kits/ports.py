"""Free TCP ports on the loopback for servers a test starts."""

from __future__ import annotations

import random
import socket


def free_ports(n: int) -> list[int]:
    """Free ports below Linux's ephemeral range (32768+), so an outgoing connection of some other process
    (health probes, HTTP clients) cannot take one between this check and the server's bind."""
    rng = random.Random()
    ports: list[int] = []
    while len(ports) < n:
        port = rng.randrange(20000, 32000)
        if port not in ports and port_free(port):
            ports.append(port)
    return ports


def port_free(port: int) -> bool:
    """Nothing listens, and a server could bind it again (SO_REUSEADDR, as servers do: TIME_WAIT is fine)."""
    with socket.socket() as c:
        if c.connect_ex(("127.0.0.1", port)) == 0:
            return False
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def consecutive_free(n: int, avoid: tuple[int, ...] | list[int] = ()) -> int:
    """The first of n free ports in a row (a router's replicas take the ports after its own), none of them in
    `avoid` (ports already given out but not bound yet)."""
    while True:
        base = free_ports(1)[0]
        if all(base + i not in avoid and port_free(base + i) for i in range(n)):
            return base


def free_port() -> int:
    """One port the kernel picks (ephemeral range), free when this returns."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
