"""A free local TCP port, for tests that start a server or a process group (gloo's rendezvous)."""

import socket


def free_port() -> int:
    """A port the OS just handed out on 127.0.0.1 (closed again, so the caller can bind it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
