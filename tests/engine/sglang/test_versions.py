"""SGLang across releases: the supported range, hooks that attach per release, releases side by side.

The two ends of the range run in the default suite (`bash scripts/setup.sh --test` installs the
newest in .venv and the oldest in .sglang/); PDO_SGLANG_MATRIX=1 runs the whole conformance on every
release installed side by side (`bash scripts/sglang-matrix.sh` installs them all first).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.sglang import hooks, versions

ROOT = Path(__file__).resolve().parents[3]


def _pdo(*args, env=None, timeout=600):
    return subprocess.run(
        [sys.executable, "-m", "engine.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# ---- the hooks attach where their targets are --------------------------------------------------
class _Target:
    def present(self, req, is_retracted=False):
        return req

    def renamed(self, request):
        return request


def _noop(sink, wrapped, instance, args, kwargs):
    return wrapped(*args, **kwargs)


def test_a_hook_attaches_only_to_a_target_with_the_parameters_it_reads():
    # the adapter's own hooks may be installed in this process: set them aside, and undo only ours
    attached, installed = dict(hooks.attached), len(hooks._installed)
    hooks.attached.clear()
    try:
        assert hooks.wrap(_Target, "present", _noop, ("req",))
        assert not hooks.wrap(_Target, "absent", _noop)
        assert not hooks.wrap(_Target, "renamed", _noop, ("req",))
        assert hooks.attached["_Target.present"] == "attached"
        assert hooks.attached["_Target.absent"] == "absent"
        assert hooks.attached["_Target.renamed"] == "signature (request)"
        line = hooks.report()
        assert line.startswith("hooks: 1/3 attached; not attached: ")
        assert "_Target.absent (absent)" in line and "_Target.renamed (signature (request))" in line
        assert _Target().present(7) == 7  # the wrapper passes the call through
    finally:
        while len(hooks._installed) > installed:
            owner, name, original = hooks._installed.pop()
            setattr(owner, name, original)
        hooks.attached.clear()
        hooks.attached.update(attached)
    assert "present" in _Target.__dict__ and not hasattr(_Target.present, "__wrapped__")


# ---- the range ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "version, where",
    [("0.5.12.post1", "below"), ("0.5.13", "within"), ("0.5.23", "within"), ("0.5.24", "above")],
)
def test_the_declared_range(version, where):
    assert versions.position(version) == where


def test_a_release_below_the_range_is_refused_in_one_line():
    out = _pdo("conform", "sglang", "--sglang-version", "0.5.12", timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == (
        "pdo conform: SGLang 0.5.12 is below the supported range (0.5.13 to 0.5.23)"
    )


@pytest.mark.parametrize("bad", ["latest", "0.5.x"])
def test_a_version_that_is_not_one_is_bad_input(bad):
    out = _pdo("conform", "sglang", "--sglang-version", bad, timeout=60)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert repr(bad) in out.stderr


def test_a_release_not_installed_names_the_install_command(tmp_path):
    out = _pdo(
        "conform",
        "sglang",
        "--sglang-version",
        "0.5.17",
        env={"PDO_SGLANG_HOME": str(tmp_path)},
        timeout=60,
    )
    assert out.returncode == 2
    assert "engine.sglang.versions install 0.5.17" in out.stderr


# ---- releases that run ----------------------------------------------------------------------------
def _venv_sglang() -> str | None:
    from engine.sglang import installed_version

    return installed_version()


def _runnable() -> list[str]:
    found = set(versions.installed())
    if _venv_sglang():
        found.add(_venv_sglang())
    return sorted(found, key=versions.Version)


def _ends() -> list[str]:
    found = _runnable()
    return found if len(found) <= 2 else [found[0], found[-1]]


def _decode_run(version: str, *extra, env=None):
    return _pdo(
        "conform",
        "sglang",
        "--sglang-version",
        version,
        "--scenario",
        "decode-arrivals",
        "--scenario",
        "decode-abort-after-prefetch",
        *extra,
        env=env,
    )


@pytest.mark.skipif(not _runnable(), reason="no SGLang release installed (setup.sh --test)")
@pytest.mark.parametrize("version", _ends())
def test_each_end_of_the_range_conforms_and_reports_its_hooks(version):
    out = _decode_run(version)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert sum(line.startswith("ok  decode-") for line in lines) == 4
    assert any(line.startswith(f"SGLang {version};") for line in lines)
    attach = [line for line in lines if line.startswith("hooks: ")]
    assert len(attach) == 1
    if versions.Version(version) < versions.Version("0.5.19"):
        # no prefetch before 0.5.19: its hooks do not attach, and the line says so
        assert "prefetch_prefill_dp_rank_queries (absent)" in attach[0]


@pytest.mark.skipif(_venv_sglang() is None, reason="SGLang is not installed (setup.sh --test)")
def test_a_release_above_the_range_runs_with_a_warning(tmp_path):
    """A release newer than the range (made here by labelling the installed one 0.5.99) runs: one
    warning line, and the hooks attach where their targets exist."""
    import importlib.metadata

    dist = importlib.metadata.distribution("sglang")
    folder = tmp_path / "0.5.99"
    folder.mkdir()
    (folder / "sglang").symlink_to(Path(dist.locate_file("sglang")))
    info = folder / "sglang-0.5.99.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: sglang\nVersion: 0.5.99\n")
    out = _pdo(
        "conform", "sglang", "--sglang-version", "0.5.99", "--list",
        env={"PDO_SGLANG_HOME": str(tmp_path)},
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    warning = [line for line in out.stderr.splitlines() if "newer than the supported range" in line]
    assert warning == [
        "pdo conform: warning: SGLang 0.5.99 is newer than the supported range (0.5.13 to 0.5.23): "
        "hooks attach where their targets still exist"
    ]
    assert any(line.startswith("hooks: ") for line in out.stdout.splitlines())


_MATRIX = os.environ.get("PDO_SGLANG_MATRIX") == "1"


@pytest.mark.skipif(not _MATRIX, reason="the whole release matrix: PDO_SGLANG_MATRIX=1")
@pytest.mark.parametrize("version", _runnable() if _MATRIX else [])
def test_every_installed_release_conforms(version):
    out = _pdo("conform", "sglang", "--sglang-version", version)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]


_OLDEST_CELL = "decode-life/transferring/poll-failed/normal"


@pytest.mark.skipif(not _runnable(), reason="no SGLang release installed (setup.sh --test)")
def test_the_oldest_release_runs_a_lifecycle_cell():
    """The lifecycle x fault matrix builds SGLang's own pools and queues on the oldest release too;
    on 0.5.13 the cell shows bug S1 (#28022: a Failed transfer dropped without clearing its
    receiver), recorded as that release's expected finding."""
    from engine.sglang.conform import driver

    version = _runnable()[0]
    out = _pdo(
        "conform", "sglang", "--sglang-version", version, "--scenario", _OLDEST_CELL, "--json"
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    (result,) = json_results(out.stdout)
    assert result["sglang_version"] == version and result["error"] is None
    assert result["outcome"] == driver.expected_outcome(_OLDEST_CELL, version)
    ran = result["sglang_functions"]  # the hooked SGLang functions that ran
    assert any(f.endswith("DecodeMixin.event_loop_normal_disagg_decode") for f in ran)
    assert any(f.endswith("DecodePreallocQueue.add") for f in ran)
    if versions.Version(version) <= versions.Version("0.5.13.post1"):
        assert result["rules"] == {"oracle:cleared-once": 1}


def json_results(stdout: str) -> list[dict]:
    import json

    return json.loads(stdout[stdout.find("[") :])
