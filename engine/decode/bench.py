"""`pdo bench decode`: the DP-rank prefetch against the synchronous baseline (being written)."""
from __future__ import annotations


def register(sub) -> None:
    return None
