"""The engine's exception for a configuration a user got wrong (a flag, a setting, a spec file).

The engine core imports nothing above it, so it cannot raise the front's BadInput (spec/errors.py);
`pdo` classifies ConfigError as bad input explicitly (exit 2), as any other exception is a bug."""

from __future__ import annotations


class ConfigError(ValueError):
    """The message names the setting (as its flag where there is one) and what is wrong with it."""


class EngineError(RuntimeError):
    """A run that failed or can never finish (stuck requests, a failed KV transfer): `pdo` prints
    its message on one line and exits 1 (FAILED), as for any failed run."""
