"""Fixtures of the engine tests: a bootstrap server, empty or with one DP rank registered."""

from __future__ import annotations

import pytest

from engine.bootstrap import client as bootstrap_client
from engine.bootstrap.server import BootstrapServer
from tests.engine.bootstrap.fixtures import rank


@pytest.fixture
def server():
    """With the test-only admin routes (/_faults, /_stats) on, as the fault tests use them."""
    with BootstrapServer(test_routes=True) as s:
        yield s


@pytest.fixture
def ready_server():
    """One DP rank with TP 2, fully registered."""
    with BootstrapServer() as s:
        for tp in range(2):
            bootstrap_client.register_prefill_rank(s.url, rank(tp_rank=tp, tp_size=2))
        yield s
