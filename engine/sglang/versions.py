"""Which SGLang releases the adapter supports, and several of them installed side by side.

The policy follows OpenTelemetry's Python instrumentations, which also wrap methods with wrapt:
- a declared supported range (SUPPORTED);
- each hook attaches only where its target exists with the parameters it reads (hooks.attach), and
  one line says which attached and which did not (hooks.report);
- a release above the range runs, with a warning and that line; one below it is refused.

Side by side: each release lives in its own folder, `<root>/<version>/` (root: $PDO_SGLANG_HOME, else
`.sglang/` at the repository root), holding SGLang's wheel and the few packages whose pins differ from
release to release (transformers, and the tokenizers that transformers accepts), installed with
`--no-deps` over the dependencies .venv shares (scripts/sglang-requirements.txt). `use(version)` puts
that folder first on sys.path before anything imports SGLang.

    python -m engine.sglang.versions install 0.5.13 0.5.23   # or --all: every release in the range
    python -m engine.sglang.versions list
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import InvalidVersion, Version

from spec.errors import BadInput

SUPPORTED = (Version("0.5.13"), Version("0.5.23"))  # inclusive; tested on every release between
RELEASES = (
    "0.5.13", "0.5.13.post1", "0.5.14", "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18",
    "0.5.19", "0.5.20", "0.5.21", "0.5.22", "0.5.23",
)  # fmt: skip
# the packages whose pins move between releases; the rest of the import closure is shared
PINNED = ("transformers", "tokenizers")
REPO = Path(__file__).resolve().parents[2]


class VersionError(BadInput):
    """A release outside the supported range, or not installed (one line, for the user)."""


def root() -> Path:
    return Path(os.environ.get("PDO_SGLANG_HOME") or REPO / ".sglang")


def folder(version: str) -> Path:
    return root() / version


def installed() -> list[str]:
    """The releases installed side by side, oldest first."""
    if not root().is_dir():
        return []
    found = [p.name for p in root().iterdir() if (p / "sglang").is_dir()]
    return sorted(found, key=Version)


def position(version: str) -> str:
    """'below', 'within' or 'above' the supported range."""
    v = Version(version)
    if v < SUPPORTED[0]:
        return "below"
    return "above" if v > SUPPORTED[1] else "within"


def range_text() -> str:
    return f"{SUPPORTED[0]} to {SUPPORTED[1]}"


def use(version: str) -> None:
    """Make `version` the SGLang this process imports: its folder first on sys.path. The venv's own
    SGLang, when it is that version, needs no folder."""
    if "sglang" in sys.modules:
        raise VersionError("SGLang is already imported in this process; choose the version first")
    try:
        below = position(version) == "below"
    except InvalidVersion:
        raise VersionError(f"--sglang-version {version!r} is not a version number") from None
    if below:
        raise VersionError(f"SGLang {version} is below the supported range ({range_text()})")
    path = folder(version)
    if not (path / "sglang").is_dir():
        if _shared("sglang") == version:
            return
        raise VersionError(
            f"SGLang {version} is not installed under {root()} "
            f"(install it: .venv/bin/python -m engine.sglang.versions install {version})"
        )
    sys.path.insert(0, str(path))
    importlib.invalidate_caches()


# ---- installing -----------------------------------------------------------------------------------
def install(version: str, quiet: bool = True) -> Path:
    """SGLang `version` into its own folder, with the pinned packages the shared ones do not meet."""
    target = folder(version)
    if (target / "sglang").is_dir():
        return target
    _pip(["sglang==" + version], target, quiet)
    pins = _pins(target, "sglang")
    wanted = [
        f"{name}=={pins[name]}"
        for name in PINNED
        if name in pins and not _shared_meets(name, pins[name])
    ]
    if wanted:
        _pip(wanted, target, quiet)
    # transformers' own requirement on tokenizers, where the shared one falls outside it
    spec = _requirement(target, "transformers", "tokenizers")
    if spec is not None and not spec.specifier.contains(
        _shared("tokenizers") or "0", prereleases=True
    ):
        _pip([f"tokenizers{spec.specifier}"], target, quiet)
    return target


def _pip(reqs: list[str], target: Path, quiet: bool) -> None:
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--upgrade",
        "--target",
        str(target),
    ]
    subprocess.run([*cmd, *(["-q"] if quiet else []), *reqs], check=True)


def _dist(target: Path, name: str):
    return next(iter(importlib.metadata.distributions(name=name, path=[str(target)])), None)


def _pins(target: Path, name: str) -> dict[str, str]:
    """The exact `==` pins among `name`'s unconditional requirements."""
    dist = _dist(target, name)
    out = {}
    for text in (dist.requires or []) if dist else []:
        req = Requirement(text)
        spec = list(req.specifier)
        if req.marker is None and len(spec) == 1 and spec[0].operator == "==":
            out[req.name.lower()] = spec[0].version
    return out


def _requirement(target: Path, name: str, dep: str) -> Requirement | None:
    dist = _dist(target, name)
    for text in (dist.requires or []) if dist else []:
        req = Requirement(text)
        if req.name.lower() == dep and req.marker is None:
            return req
    return None


def _shared(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _shared_meets(name: str, pin: str) -> bool:
    return _shared(name) == pin


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m engine.sglang.versions", description=__doc__.split("\n")[0]
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    i = sub.add_parser("install", help="install releases side by side")
    i.add_argument("versions", nargs="*", help="releases (default with --all: every supported one)")
    i.add_argument("--all", action="store_true", help=f"every release from {range_text()}")
    i.add_argument("--oldest", action="store_true", help=f"the oldest supported ({RELEASES[0]})")
    sub.add_parser("list", help="the releases installed, and the supported range")
    a = p.parse_args(argv)
    if a.cmd == "list":
        print(
            f"supported: {range_text()}; installed under {root()}: {', '.join(installed()) or 'none'}"
        )
        return 0
    versions = list(RELEASES) if a.all else [RELEASES[0]] if a.oldest else a.versions
    if not versions:
        p.error("name the releases to install, or --all")
    for v in versions:
        if position(v) == "below":
            print(
                f"versions: SGLang {v} is below the supported range ({range_text()})",
                file=sys.stderr,
            )
            return 2
        print(f"SGLang {v}: {install(v)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
