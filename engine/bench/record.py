"""What every benchmark result records and how it is written: the machine it ran on, the local
time, and the JSON output (`--json FILE`, or `-` for stdout)."""

from __future__ import annotations

import datetime
import json
import os
import platform


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


def write_json(path: str | None, res: dict) -> None:
    if not path:
        return
    text = json.dumps(res, indent=1, default=str)
    if path == "-":
        print(text)
    else:
        with open(path, "w") as f:
            f.write(text + "\n")
