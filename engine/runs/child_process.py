"""The child processes of pdo's launchers (`pdo launch`, `pdo bench decode`): every child writes its
stdout and stderr into a log file, never into a pipe.

A pipe the parent does not read fills at 64 KiB, and the child then blocks on its next write: a
bootstrap server that logs each malformed request would stop answering once a client had sent
enough of them. A file never blocks; the parent reads it when it needs to (the URL a server prints
when it listens, the last line of a child that failed).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

TAIL_BYTES = 4096  # enough for the last line of a child's error


@dataclass
class Child:
    """One started child: its name (a role), its process and the file its output goes to."""

    name: str
    proc: subprocess.Popen
    log: Path

    def last_line(self, skip: str | None = None) -> str:
        """The child's last non-empty output line (one holding `skip` aside), or its exit status
        when it wrote none."""
        try:
            with open(self.log, "rb") as f:
                f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
                tail = f.read().decode("utf-8", "replace")
        except OSError:
            tail = ""
        lines = [x.strip() for x in tail.splitlines() if x.strip() and not (skip and skip in x)]
        return lines[-1] if lines else f"exited with status {self.proc.returncode}"

    def wait_for_line(self, marker: str, timeout_s: float) -> str | None:
        """The first output line that holds `marker`, once written; None when the child exits
        first or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            exited = self.proc.poll() is not None  # read once more after an exit: it may be there
            try:
                text = self.log.read_text("utf-8", "replace")
            except OSError:
                text = ""
            for line in text.splitlines(keepends=True):
                if marker in line and line.endswith("\n"):
                    return line.strip()
            if exited or time.monotonic() > deadline:
                return None
            time.sleep(0.02)


def spawn(name: str, argv: list[str], log_dir: str | Path, env: dict | None = None) -> Child:
    """Start `argv` with stdin closed and stdout and stderr both in `log_dir`/`name`.log."""
    log = Path(log_dir) / f"{name}.log"
    with open(log, "wb") as out:  # the child holds its own descriptor
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env
        )
    return Child(name, proc, log)


def children_of(pid: int) -> dict[int, list[str]]:
    """The command line of each running child of process `pid` (Linux /proc): for a test or a
    script that kills one child of a launcher from outside."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == pid:
            found[int(entry.name)] = argv
    return found


def stop(children: list[Child], grace_s: float = 5.0) -> None:
    """SIGTERM each child still running, then SIGKILL what is left after `grace_s`."""
    for c in children:
        if c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + grace_s
    for c in children:
        try:
            c.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
