"""Fixtures of the wire tests (tests/engine/sglang/wire.py): SGLang's conn module, a pair of servers."""

from __future__ import annotations

import logging
import warnings

import pytest

from engine.sglang import SGLangUnavailable, load

from .wire import SGLANG_VERSION, Pair, pdo_server, sglang_server


@pytest.fixture(scope="module")
def conn():
    """sglang.srt.disaggregation.common.conn (SGLang's bootstrap server and clients), or a skip."""
    try:
        with warnings.catch_warnings():
            # SGLang's import-time "only CUDA supports ..." warnings
            warnings.simplefilter("ignore")
            ns = load()
    except SGLangUnavailable as e:
        pytest.skip(str(e))
    except ImportError as e:
        pytest.skip(f"SGLang is not importable: {e}")
    if ns.version != SGLANG_VERSION:
        pytest.skip(f"these tests pin SGLang {SGLANG_VERSION}, found {ns.version}")
    # Refused requests are the point of several tests: SGLang's clients log them (logger.error),
    # and aiohttp logs each 500 of SGLang's server with a traceback.
    quiet = [logging.getLogger(n) for n in (ns.conn.__name__, "aiohttp.server", "aiohttp.web")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.CRITICAL + 1)
    yield ns.conn
    for lg, level in zip(quiet, levels):
        lg.setLevel(level)


@pytest.fixture
def pair(conn):
    with pdo_server() as p, sglang_server(conn) as s:
        yield Pair(p, s)
