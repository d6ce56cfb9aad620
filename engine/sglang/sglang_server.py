"""SGLang's own bootstrap server (CommonKVBootstrapServer of 0.5.23) on a free loopback port."""

from __future__ import annotations

import socket
import time

import requests


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(sgl, timeout_s: float = 10.0):
    """Start it (its constructor starts its own thread and event loop) and wait until it answers;
    `close()` stops it."""
    port = free_port()
    server = sgl.conn.CommonKVBootstrapServer("127.0.0.1", port)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            requests.get(f"http://127.0.0.1:{port}/health", timeout=1)
            return server
        except requests.ConnectionError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"SGLang's bootstrap server did not start on port {port}"
                ) from None
            time.sleep(0.02)
