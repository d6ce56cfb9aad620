"""The `pdo bench` sub-commands, one `Registry` the CLI builds its sub-parsers from.

A benchmark module registers one `BenchCommand` under its sub-command name; `engine/bench/cli.py`
adds a sub-parser per entry, in the order they were registered.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

from spec.registry import Registry


@dataclass(frozen=True)
class BenchCommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


BENCH: Registry[BenchCommand] = Registry("bench")
