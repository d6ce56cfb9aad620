"""Part 4 of issue 28: the early cached-prefix send's wait event, through each real KV backend's
sender, manager and transfer worker (engine/sglang/conform/backends.py)."""

from __future__ import annotations

import pytest

from engine.sglang import SGLangUnavailable, load


@pytest.fixture(scope="module")
def backends():
    try:
        load()
    except SGLangUnavailable as e:
        pytest.skip(str(e))
    from engine.sglang.conform import backends

    return backends


# What 0.5.23 does, per backend: mooncake, mori and ascend (mooncake's manager) wait on the event in
# the worker before reading; NIXL's add_transfer_request does not pass it on (finding 2, confirmed).
EXPECTED = {"mooncake": "waits", "mori": "waits", "ascend": "waits", "nixl": "dropped"}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_wait_event_reaches_the_transfer_worker(backends, name):
    out = backends.check(name)
    assert out.outcome == EXPECTED[name], out
    # the stand-ins only replace a missing native package's import, and only mori's is missing here
    assert set(out.stubbed) <= {"mori", "mori.cpp", "mori.io"}


def test_a_worker_that_skips_the_wait_is_reported(backends):
    """Mooncake's worker with its wait removed (the 0.5.16-0.5.21 bug class, by an AST rewrite of
    the real method) reads the chunk without waiting on the event it carries."""
    from engine.sglang import mutate
    from engine.sglang.conform.mutants import _DropIf, _make

    conn, _ = backends._import("mooncake")
    with mutate.mutation(
        conn.MooncakeKVManager,
        "transfer_worker",
        _make(_DropIf, "kv_chunk.wait_event is not None")(),
    ):
        out = backends.check("mooncake")
    assert out.outcome == "ignored", out
    assert backends.check("mooncake").outcome == "waits"  # the real method is back


def test_a_manager_that_drops_the_event_is_reported(backends):
    """Mooncake's add_transfer_request without `wait_event=wait_event` (NIXL's shape): dropped."""
    import ast

    from engine.sglang import mutate

    class DropKeyword(ast.NodeTransformer):
        def visit_Call(self, node):
            self.generic_visit(node)
            node.keywords = [k for k in node.keywords if k.arg != "wait_event"]
            return node

    conn, _ = backends._import("mooncake")
    with mutate.mutation(conn.MooncakeKVManager, "add_transfer_request", DropKeyword()):
        out = backends.check("mooncake")
    assert out.outcome == "dropped", out


# ---- older releases, side by side -------------------------------------------------------------------
def _expected(version: str) -> dict[str, str]:
    """Per backend, what the check finds on `version` (measured on each release 0.5.13-0.5.23):
    before 0.5.16 the prefill scheduler parks no event on the sender (S5: 0.5.15's early send has
    none); mooncake's sender passes it on from 0.5.22 (S6), ascend through mooncake's manager."""
    from packaging.version import Version

    v = Version(version)
    if v < Version("0.5.16"):
        return dict.fromkeys(EXPECTED, "no-event")
    if v < Version("0.5.22"):
        return {"mooncake": "dropped", "mori": "waits", "ascend": "dropped", "nixl": "dropped"}
    return dict(EXPECTED)


@pytest.mark.parametrize("which", ["oldest", "0.5.21", "0.5.22"])
def test_each_release_reports_per_backend(which):
    """`python -m engine.sglang.conform.backends --sglang-version V`: the oldest release CI
    installs, and the last release of mooncake's bug and the first without it where installed."""
    import subprocess
    import sys
    from pathlib import Path

    from engine.sglang import versions

    version = versions.RELEASES[0] if which == "oldest" else which
    if version not in versions.installed():
        pytest.skip(f"SGLang {version} is not installed side by side")
    root = Path(__file__).resolve().parents[3]
    out = subprocess.run(
        [sys.executable, "-m", "engine.sglang.conform.backends", "--sglang-version", version],
        cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[0] == f"SGLang {version}"
    found = dict(line.split(": ")[:2] for line in lines[1:])
    assert found == _expected(version)
