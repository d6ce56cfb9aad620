"""The bootstrap server's error log (engine/bootstrap/server.py): what aiohttp and the event loop report
about a request, one line each, at most a few lines a second.

aiohttp logs a malformed request (`GET / HTTP/9.9`, a body its Content-Encoding does not decode)
as an error with its traceback, about 1 KB a request. Any local client can send thousands; a parent
that reads the server's stderr late (or a terminal that scrolls) would then hold the server's event
loop on a write. Here a client's protocol error is one line naming the client and the error, an
error of pdo's own one line saying so, and past RATE_PER_S lines a second (BURST at once) the rest
are counted and the count is logged with the next line that goes out.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time

from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

RATE_PER_S = 5.0
BURST = 20
LOGGER_NAME = "pdo.bootstrap"

# What a client can cause by what it sends, or by leaving: never a bug in the server.
CLIENT_ERRORS = (HttpProcessingError, RequestPayloadError, ConnectionError, asyncio.TimeoutError)


def describe(exc: BaseException) -> str:
    """`Type: message` of an exception and of what caused it, on one line."""
    parts = []
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = getattr(exc, "message", None) or str(exc)
        parts.append(f"{type(exc).__name__}: {text}" if text else type(exc).__name__)
        exc = exc.__cause__ or exc.__context__
    return " ".join("; caused by ".join(parts).split())


class OneLine(logging.Formatter):
    """The record's message and its exception on one line, never a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        exc = record.exc_info[1] if record.exc_info else None
        if exc is not None:
            kind = (
                "client error"
                if isinstance(exc, CLIENT_ERRORS)
                else "internal error (a bug in pdo)"
            )
            msg = f"{msg}: {kind}: {describe(exc)}"
        dropped = getattr(record, "pdo_dropped", 0)
        if dropped:
            msg += f" ({dropped} more line(s) dropped by the rate limit before this one)"
        line = " ".join(f"pdo bootstrap: {msg}".split())
        return line if len(line) <= 500 else line[:497] + "..."


class RateLimit(logging.Filter):
    """A token bucket: BURST lines at once, RATE_PER_S a second after that. A dropped line is
    counted; the next line let through carries the count."""

    def __init__(self, rate_per_s: float = RATE_PER_S, burst: int = BURST, clock=time.monotonic):
        super().__init__()
        self.rate, self.burst, self.clock = rate_per_s, burst, clock
        self.tokens = float(burst)
        self.last = clock()
        self.dropped = 0
        self.lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        with self.lock:
            now = self.clock()
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
            if self.tokens < 1:
                self.dropped += 1
                return False
            self.tokens -= 1
            record.pdo_dropped, self.dropped = self.dropped, 0
        return True


class _Stderr(logging.StreamHandler):
    """A handler on whatever sys.stderr is when a line is written (a test may replace it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


_SETUP_LOCK = threading.Lock()


def server_log() -> logging.Logger:
    """The logger every bootstrap server of this process hands aiohttp and its event loop."""
    log = logging.getLogger(LOGGER_NAME)
    with _SETUP_LOCK:
        if not log.handlers:
            handler = _Stderr()
            handler.setFormatter(OneLine())
            handler.addFilter(RateLimit())
            log.addHandler(handler)
            log.setLevel(logging.INFO)  # aiohttp's debug lines (a client's stray bytes) stay out
            log.propagate = False
    return log


def loop_exception_handler(log: logging.Logger):
    """An event loop's exception handler that logs through `log` (one line) instead of asyncio's
    default, which logs a traceback."""

    def handle(_loop: asyncio.AbstractEventLoop, context: dict) -> None:
        exc = context.get("exception")
        log.error(context.get("message", "event loop error"), exc_info=exc)

    return handle
