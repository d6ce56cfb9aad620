"""The bootstrap server under a hostile local client (on 127.0.0.1 only): a body its encoding does
not decode is a 4xx, every integer of the wire has a domain (docs/decode.md, "The wire"), and a
flood of malformed requests is logged one line each, rate-limited, never stalling the server."""

from __future__ import annotations

import gzip
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import zlib

import pytest
import requests

from engine.bootstrap import client as bootstrap_client
from engine.bootstrap.log import BURST, RATE_PER_S, OneLine, RateLimit
from engine.bootstrap.server import BootstrapServer
from tests.engine.bootstrap.fixtures import REPO, T, rank

BODY_ENDPOINTS = [("POST", "/query_dp_ranks"), ("PUT", "/route"), ("POST", "/register_dp_rank")]


@pytest.fixture
def server():
    with BootstrapServer(expected_ranks=None) as s:
        yield s


@pytest.mark.parametrize("method, path", BODY_ENDPOINTS)
@pytest.mark.parametrize(
    "encoding, body",
    [
        ("gzip", b"not gzip at all"),
        ("gzip", b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xffbroken"),  # a header, then garbage
        ("deflate", b"not deflate"),
    ],
)
def test_a_body_its_encoding_does_not_decode_is_a_400(server, method, path, encoding, body):
    r = requests.request(
        method, server.url + path, data=body, headers={"Content-Encoding": encoding}, timeout=T
    )
    assert r.status_code == 400, (r.status_code, r.text)
    # one line; a stream that decodes to garbage is then not JSON
    assert "\n" not in r.text and ("could not be read" in r.text or "not valid JSON" in r.text)
    assert bootstrap_client.health(server.url, timeout=T)  # still serving


def test_a_body_that_decodes_is_read_as_json(server):
    body = gzip.compress(b'{"bootstrap_room": 5, "dp_rank": 0}')
    r = requests.post(
        server.url + "/register_dp_rank", data=body, headers={"Content-Encoding": "gzip"}, timeout=T
    )
    assert r.status_code == 200, r.text
    deflated = zlib.compress(b'{"bootstrap_rooms": [5]}')
    r = requests.post(
        server.url + "/query_dp_ranks",
        data=deflated,
        headers={"Content-Encoding": "deflate"},
        timeout=T,
    )
    assert r.status_code == 200 and r.json() == {"5": 0}


@pytest.mark.parametrize(
    "path, body, reason",
    [
        ("/register_dp_rank", {"bootstrap_room": 2**64, "dp_rank": 0}, "bootstrap_room"),
        ("/register_dp_rank", {"bootstrap_room": 2**70, "dp_rank": 0}, "bootstrap_room"),
        # before any rank registered, with no expected ranks: the wire's int64 bound
        ("/register_dp_rank", {"bootstrap_room": 1, "dp_rank": 2**70}, "dp_rank"),
        ("/register_dp_rank", {"bootstrap_room": 1, "dp_rank": 2**63}, "dp_rank"),
        ("/query_dp_ranks", {"bootstrap_rooms": [2**64]}, "bootstrap_rooms"),
        ("/query_dp_ranks", {"bootstrap_rooms": [1, -1]}, "bootstrap_rooms"),
    ],
)
def test_room_and_rank_out_of_domain_are_refused(server, path, body, reason):
    r = requests.post(server.url + path, json=body, timeout=T)
    assert r.status_code == 400 and reason in r.text, (r.status_code, r.text)
    assert not server._rooms  # nothing stored


def test_room_domain_bounds_are_accepted(server):
    for room in (0, 2**63, 2**64 - 1):
        bootstrap_client.register_dp_rank(server.url, room, 0)
    got = bootstrap_client.query_prefill_dp_ranks(server.url, [0, 2**63, 2**64 - 1])
    assert got == {0: 0, 2**63: 0, 2**64 - 1: 0}


def test_dp_rank_before_registration_is_bounded_by_the_expected_ranks():
    with BootstrapServer(expected_ranks=2) as s:
        r = requests.post(
            s.url + "/register_dp_rank", json={"bootstrap_room": 1, "dp_rank": 2}, timeout=T
        )
        assert r.status_code == 400 and "expected ranks" in r.text, r.text
        bootstrap_client.register_dp_rank(s.url, 1, 1)


def test_a_room_registered_early_with_a_rank_the_topology_lacks_is_never_answered(server):
    bootstrap_client.register_dp_rank(server.url, 1, 5)  # no topology yet: stored
    bootstrap_client.register_dp_rank(server.url, 2, 0)
    bootstrap_client.register_prefill_rank(server.url, rank())  # dp_size 1
    assert bootstrap_client.query_prefill_dp_ranks(server.url, [1, 2]) == {2: 0}


@pytest.mark.parametrize(
    "field, value",
    [
        ("prefill_http_port", 65536),
        ("prefill_http_port", 0),
        ("rank_port", 65536),
        ("attn_tp_size", 2**63),
        ("page_size", 2**70),
    ],
)
def test_registration_values_out_of_domain_are_refused(server, field, value):
    r = requests.put(server.url + "/route", json=rank(**{field: value}), timeout=T)
    assert r.status_code == 400 and field in r.text, (r.status_code, r.text)
    assert not server._ranks and server._topology is None


# ---- the log of malformed requests ---------------------------------------------------------------


def _bad_requests(port: int, n: int) -> None:
    """`n` requests aiohttp cannot parse, each answered (400) before the next is sent."""
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=T) as c:
            c.sendall(b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n")
            assert c.recv(100)[8:13] == b" 400 ", "no answer to a malformed request"


def test_malformed_requests_are_logged_one_line_each_and_rate_limited(server, capfd):
    t0 = time.monotonic()
    _bad_requests(server.port, 60)
    elapsed = time.monotonic() - t0
    lines = capfd.readouterr().err.splitlines()
    assert lines and all(x.startswith("pdo bootstrap: ") for x in lines), lines[:3]
    assert not any("Traceback" in x for x in lines)
    assert all("client error: BadStatusLine" in x for x in lines), lines[:3]
    assert len(lines) <= BURST + RATE_PER_S * elapsed + 1, (len(lines), elapsed)


def test_the_rate_limit_counts_what_it_dropped():
    now = [0.0]
    limit = RateLimit(rate_per_s=1.0, burst=2, clock=lambda: now[0])
    records = [logging.makeLogRecord({"msg": f"m{i}"}) for i in range(6)]
    assert [limit.filter(r) for r in records[:4]] == [True, True, False, False]
    now[0] = 1.0
    assert limit.filter(records[4]) and records[4].pdo_dropped == 2
    assert "2 more line(s) dropped" in OneLine().format(records[4])


def test_an_internal_error_says_so_on_one_line():
    try:
        raise KeyError("x")
    except KeyError as exc:
        record = logging.makeLogRecord(
            {"msg": "Unhandled exception", "exc_info": (None, exc, None)}
        )
    line = OneLine().format(record)
    assert "internal error (a bug in pdo): KeyError" in line and "\n" not in line


def test_pdo_bootstrap_whose_stderr_nobody_reads_keeps_answering():
    """A parent that never reads the server's stderr (a pipe of 64 KiB): 300 malformed requests
    used to log a traceback each and fill it; the server then blocked on the write."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "bootstrap", "--port", "0"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        box: dict = {}
        reader = threading.Thread(target=lambda: box.update(line=proc.stdout.readline()))
        reader.daemon = True
        reader.start()
        reader.join(30)
        url = box.get("line", "").split()[-1]
        _bad_requests(int(url.rsplit(":", 1)[1]), 300)
        assert bootstrap_client.health(url, timeout=T)
    finally:
        proc.kill()
        proc.wait(timeout=10)
        proc.stdout.close()
        proc.stderr.close()
