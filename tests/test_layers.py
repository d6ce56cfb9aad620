"""The layers of tests/layers.py hold: no import goes against them, no two modules import each other
(directly or round a loop, at module level or inside a function), and no module outgrows one job."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

from tests.layers import LAYERS, back_edges, layer_of

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "layout_metrics", ROOT / "scripts" / "layout_metrics.py"
)
metrics = importlib.util.module_from_spec(_spec)
sys.modules["layout_metrics"] = metrics
_spec.loader.exec_module(metrics)

# 500 lines is the mark scripts/layout_metrics.py reports (files_over_500): a module past it is one to
# read for a second job, not one to split by count (issue #30). This ceiling stops runaway growth.
MAX_LINES = 600
GENERATED: set[str] = set()


def _edges() -> dict[str, set[str]]:
    return metrics.graph(metrics.tracked_python())


def test_every_module_has_a_layer():
    # engine/__init__.py is empty: the engine is its packages, each a layer of its own
    assert (ROOT / "engine" / "__init__.py").read_text() == ""
    code = [m for m in _edges() if m.split(".")[0] in metrics.PACKAGES and m != "engine"]
    assert [m for m in code if layer_of(m) is None] == []


def test_no_import_goes_against_the_layers():
    assert back_edges(_edges()) == []


def test_the_checker_of_the_layers_sees_a_back_edge():
    edges = {
        "engine.runtime.model": {"checker.linear", "engine.trace.tracer"},
        "checker.linear": {"engine.trace.tracer"},
    }
    assert back_edges(edges) == [
        "checker.linear -> engine.trace.tracer (checker -> trace)",
        "engine.runtime.model -> checker.linear (runtime -> checker)",
        "engine.runtime.model -> engine.trace.tracer (runtime -> trace)",
    ]


def test_no_import_cycles():
    assert metrics.cycles(_edges()) == []


def test_a_cycle_is_seen_round_a_loop():
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert metrics.cycles(edges) == [["a", "b", "c"]]


def test_layers_name_known_layers():
    for layer, (_, allowed) in LAYERS.items():
        assert set(allowed) <= set(LAYERS), layer


def test_no_module_outgrows_one_job():
    sizes = {
        str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in metrics.tracked_python()
    }
    assert {f: n for f, n in sizes.items() if n > MAX_LINES and f not in GENERATED} == {}


def test_the_four_packages_are_this_checkout():
    """The generic top-level names import from here, not from another installed package."""
    for name in metrics.PACKAGES:
        found = importlib.util.find_spec(name)
        assert found is not None and found.origin is not None, name
        assert Path(found.origin).resolve().is_relative_to(ROOT), (name, found.origin)


def test_ruff_lint_and_format_hold():
    """The tree passes `ruff check` and `ruff format --check` (pyproject.toml: 100 columns)."""
    ruff = Path(sys.executable).parent / "ruff"
    for argv in (["check", "--quiet", "."], ["format", "--check", "--quiet", "."]):
        out = subprocess.run([str(ruff), *argv], cwd=ROOT, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-1000:]
