"""The one exception class for input a user got wrong: a command-line value, an input file.

`pdo` (engine/cli) reports it as one line and exit 2 (BAD_INPUT); any exception that is not
classified as bad input is a bug in pdo (exit 70). It lives in spec/, the layer both the checker
and the command-line front may import."""

from __future__ import annotations


class BadInput(Exception):
    """The message is the whole report: it names the file, line and field where there is one."""


class UnknownName(BadInput, KeyError):
    """A name looked up in a registry (a mutant, a strategy, a sub-command) that is not there."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""
