"""`python -m engine.sglang.launch --trace-dir DIR -- <sglang.launch_server arguments>`: an SGLang
server with the pdo adapter in every process (docs/sglang.md, "Tracing a GPU SGLang server")."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

BOOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def traced_env(trace_dir: str, env: dict | None = None) -> dict:
    """The environment that installs the adapter in a process and every process it starts."""
    env = dict(os.environ if env is None else env)
    path = [BOOT, ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(path)
    env["PDO_SGLANG_TRACE_DIR"] = os.path.abspath(trace_dir)
    return env


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.sglang.launch", description=__doc__)
    p.add_argument("--trace-dir", required=True, help="one trace file per SGLang process goes here")
    p.add_argument(
        "--module", default="sglang.launch_server", help="the module to run (default: %(default)s)"
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for it, after --")
    a = p.parse_args(argv)
    os.makedirs(a.trace_dir, exist_ok=True)
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    return subprocess.call([sys.executable, "-m", a.module, *args], env=traced_env(a.trace_dir))


if __name__ == "__main__":
    sys.exit(main())
