"""Named entries of one kind, added by a decorator: the one registry idiom of the project.

CLI sub-commands, bench sub-commands, the checker's template kinds and the z3 encoders each keep one
`Registry`; it lives in `spec` because that layer is below every layer that keeps one.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from .errors import UnknownName

Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Entry] = {}

    def register(self, name: str) -> Callable[[Entry], Entry]:
        def add(entry: Entry) -> Entry:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is registered twice")
            self._entries[name] = entry
            return entry

        return add

    def __getitem__(self, name: str) -> Entry:
        if name not in self._entries:
            raise UnknownName(f"unknown {self.kind} {name!r} (known: {', '.join(self._entries)})")
        return self._entries[name]

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, Entry]]:
        return list(self._entries.items())
