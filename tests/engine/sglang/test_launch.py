"""The adapter inside a real SGLang process tree: `python -m engine.sglang.launch` installs the hooks
in the child processes SGLang starts, one trace per process, flushed as it goes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sglang_adapter = pytest.importorskip("engine.sglang")
try:
    sglang_adapter.check_version()
except sglang_adapter.SGLangUnavailable as exc:
    pytest.skip(str(exc), allow_module_level=True)

from checker.linear import check_files  # noqa: E402
from engine.sglang import launch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def test_spawned_scheduler_process_is_traced(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "engine.sglang.launch",
            "--trace-dir",
            str(tmp_path),
            "--module",
            "tests.engine.sglang.child_server",
            "--",
            "overlap",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    traces = sorted(tmp_path.glob("sglang-*.jsonl"))
    assert len(traces) == 1  # the scheduler child; the launcher never imported SGLang
    header = json.loads(traces[0].read_text().splitlines()[0])
    assert (
        header["role"] == "decode" and header["mode"] == "overlap" and header["engine"] == "sglang"
    )
    [result] = check_files([str(traces[0])])
    assert result.ok and result.events > 20


def test_traced_env_keeps_the_users_pythonpath(tmp_path):
    env = launch.traced_env(str(tmp_path), {"PYTHONPATH": "/x"})
    parts = env["PYTHONPATH"].split(os.pathsep)
    assert parts[0] == launch.BOOT and "/x" in parts
    assert env["PDO_SGLANG_TRACE_DIR"] == str(tmp_path)


def test_an_untraced_process_imports_nothing(tmp_path):
    env = launch.traced_env(str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print('sglang' in sys.modules)"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.strip() == "False" and not list(tmp_path.iterdir())
