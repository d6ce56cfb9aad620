"""pdo's one error tree. `pdo` (engine/cli) maps an exception to its exit code by its base class:

    PdoError
    ├── BadInput      input a user got wrong (a value, a file, a setting): one line, exit 2
    ├── RunFailed     a run that failed or can never finish: one line, exit 1
    └── InternalError a state pdo's own code should never reach: exit 70

Any exception outside the tree is a bug in pdo too (exit 70); ControlFlow marks the signals that
are not errors at all. It lives alone in its layer
(tests/layers.py), which every other layer may import: the engine core included, which imports
nothing else of spec/."""

from __future__ import annotations


class PdoError(Exception):
    """The message is the whole report: it names the file, line and field where there is one."""


class BadInput(PdoError):
    """Input a user got wrong: a command-line value, an input file, a setting."""


class RunFailed(PdoError):
    """A run that failed or can never finish (a stuck request, a failed transfer, a dead role)."""


class InternalError(PdoError):
    """A state pdo's own code should never reach, detected by that code."""


class ControlFlow(Exception):  # noqa: N818 (a signal, not an error)
    """Not an error: raised to leave a loop or a step, and caught by the code that arranged it. It
    stays outside PdoError on purpose; one that escapes is a bug in pdo (exit 70)."""


class UnknownName(BadInput, KeyError):
    """A name looked up in a registry (a mutant, a strategy, a sub-command) that is not there."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
