"""The engine's errors, in pdo's one tree (spec/errors.py): a configuration a user got wrong, and a
run that failed."""

from __future__ import annotations

from spec.errors import BadInput, RunFailed


class ConfigError(BadInput, ValueError):
    """The message names the setting (as its flag where there is one) and what is wrong with it."""


class EngineError(RunFailed, RuntimeError):
    """A run that failed or can never finish (stuck requests, a failed KV transfer): `pdo` prints
    its message on one line and exits 1 (FAILED), as for any failed run."""
