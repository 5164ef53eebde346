"""A port free to listen on now, for a rendezvous or a server (the caller's machine must be `host`)."""
from __future__ import annotations

import socket


def free_address(host: str = "127.0.0.1") -> tuple[str, int]:
    """`host` and a port free on it now (bound and released: free until someone else takes it)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return host, int(s.getsockname()[1])
