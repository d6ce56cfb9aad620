"""What every benchmark result records and how it is written: the machine it ran on, the local
time, and the JSON output: `--json` prints it on stdout instead of the table (as every `pdo`
sub-command's `--json`), `--json-out FILE` also writes it to a file."""

from __future__ import annotations

import datetime
import json
import os
import platform

from spec.domains import path


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch  # lazy: torch is slow to import, and every pdo command loads this module

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "cpus": os.cpu_count(),
        "cpu": cpu,
        "gpu": gpu,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "host": platform.node(),
        "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }


def now() -> str:
    return datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")


def add_json_arguments(p) -> None:
    p.add_argument(
        "--json", action="store_true", help="print the results as JSON on stdout (no table)"
    )
    p.add_argument(
        "--json-out", type=path(), metavar="FILE", help="also write the results as JSON to FILE"
    )


def write_json(a, res: dict) -> None:
    """Print `res` for --json and write it for --json-out FILE (both may be given)."""
    text = json.dumps(res, indent=1, default=str)
    if getattr(a, "json_out", None):
        with open(a.json_out, "w") as f:
            f.write(text + "\n")
    if getattr(a, "json", False):
        print(text)
