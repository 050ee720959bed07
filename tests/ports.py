"""A free TCP port on the loopback for the tests' rendezvous, servers and refused connections."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A loopback port nothing listens on now (the OS's pick for a bind to port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
