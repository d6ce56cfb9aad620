"""The launchers' children (engine/runs/child_process.py): their output goes to a file, so a child
that writes much never blocks on a pipe nobody reads; the parent reads the line it waits for and
the last line of a failed child from that file. And `pdo launch` under a flood of malformed
requests to its bootstrap server (PDO_SLOW=1)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.bench.decode import _Bootstrap
from engine.bootstrap import client as bootstrap_client
from engine.runs.child_process import children_of, spawn, stop

ROOT = Path(__file__).resolve().parents[3]
SLOW = pytest.mark.skipif(os.environ.get("PDO_SLOW") != "1", reason="PDO_SLOW=1 runs it")

# 4 MiB on each stream, far past a pipe's 64 KiB, then a last line on stderr and a failure
CHATTY = (
    "import sys\n"
    "for _ in range(4096):\n"
    "    sys.stdout.write('o' * 1023 + '\\n'); sys.stderr.write('e' * 1023 + '\\n')\n"
    "print('ready', flush=True)\n"
    "sys.stderr.write('the last word\\n'); sys.exit(3)\n"
)


def test_a_child_that_writes_much_never_blocks(tmp_path):
    child = spawn("chatty", [sys.executable, "-c", CHATTY], tmp_path)
    try:
        assert child.proc.wait(timeout=30) == 3  # it never waited for a reader
        assert child.wait_for_line("ready", timeout_s=1) == "ready"
        assert child.last_line() == "the last word"
        assert child.log == tmp_path / "chatty.log"
    finally:
        stop([child])


def test_wait_for_line_gives_up_when_the_child_exits(tmp_path):
    child = spawn("quiet", [sys.executable, "-c", "print('no marker here')"], tmp_path)
    assert child.wait_for_line("listening on ", timeout_s=30) is None
    assert child.last_line() == "no marker here"
    assert child.last_line(skip="marker") == "exited with status 0"


def test_stop_ends_a_child_that_ignores_sigterm(tmp_path):
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    child = spawn("stubborn", [sys.executable, "-c", code], tmp_path)
    assert child.wait_for_line("up", timeout_s=30) == "up"
    assert child.proc.pid in children_of(os.getpid())
    t0 = time.monotonic()
    stop([child], grace_s=0.5)
    assert child.proc.returncode == -9 and time.monotonic() - t0 < 10


def _flood(url: str, n: int) -> None:
    port = int(url.rsplit(":", 1)[1])
    for _ in range(n):
        with socket.create_connection(("127.0.0.1", port), timeout=2) as c:
            c.sendall(b"GET /health HTTP/9.9\r\nHost: x\r\n\r\n")
            assert c.recv(100)[8:13] == b" 400 ", "the server stopped answering"


def test_the_bench_bootstrap_server_keeps_answering_a_flood():
    server = _Bootstrap(0.0, "all", 1)
    try:
        _flood(server.url, 300)
        assert bootstrap_client.health(server.url, timeout=2)
    finally:
        server.close()


@SLOW
def test_launch_survives_a_flood_of_malformed_requests(tmp_path):
    """The issue's reproduction: 300 malformed requests to the bootstrap server of a running
    `pdo launch` used to fill its unread stderr pipe and stall the run until --timeout-s."""
    out = tmp_path / "run"
    p = subprocess.Popen(
        [sys.executable, "-m", "engine.cli", "launch", "--dp", "2", "--requests", "40"]
        + ["--rate", "4", "--arrival", "poisson", "--trace-dir", str(out), "--timeout-s", "200"]
        + ["--json"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        log = out / "bootstrap.log"
        deadline = time.monotonic() + 120
        while not (log.exists() and "listening on " in log.read_text()):
            assert p.poll() is None and time.monotonic() < deadline, p.communicate()
            time.sleep(0.05)
        _flood(log.read_text().split("listening on ", 1)[1].split()[0], 300)
        stdout, stderr = p.communicate(timeout=200)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, stderr
    s = json.loads(stdout)
    assert s["finished"] == 40 and s["launch_wall_s"] < 150, s["launch_wall_s"]
    lines = log.read_text().splitlines()
    assert not any("Traceback" in x for x in lines) and len(lines) < 300
