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


def wire_matches(sgl) -> bool:
    """Whether `pdo bootstrap` speaks this release's wire: the decode side builds its
    PrefillServerInfo from the /route answer with `PrefillServerInfo(**answer)`, so every field pdo
    sends must be one the release's dataclass has (releases before 0.5.23 lack some)."""
    import dataclasses  # lazy: with the rest of SGLang's side

    from engine.bootstrap.state import INFO_DECODE_SIDE, INFO_FIELDS, INFO_OMITTED_WHEN_NULL

    sent = (set(INFO_FIELDS) - set(INFO_OMITTED_WHEN_NULL)) | set(INFO_DECODE_SIDE)
    return sent <= {f.name for f in dataclasses.fields(sgl.conn.PrefillServerInfo)}
