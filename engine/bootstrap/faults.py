"""The fault injection of the bootstrap server (engine/bootstrap/server.py): latency on every request or on
query_dp_ranks only, and a seeded failure rate for query_dp_ranks. No aiohttp here, so that
`pdo bootstrap`'s flags can name the choices without loading the server."""

from __future__ import annotations

import dataclasses

from engine.errors import ConfigError

LATENCY_SCOPES = ("all", "query_dp_ranks")
FAILURE_STATUSES = (500, 503)
MAX_LATENCY_S = 3600.0  # bounds asyncio.sleep; more is a typo, not a test


@dataclasses.dataclass(frozen=True)
class Faults:
    latency_s: float = 0.0
    latency_scope: str = "all"  # "all" requests, or "query_dp_ranks" only
    failure_rate: float = 0.0  # fraction of query_dp_ranks answered with failure_status
    failure_status: int = 503

    def validated(self) -> Faults:
        if (
            isinstance(self.latency_s, bool)
            or not isinstance(self.latency_s, (int, float))
            or not 0 <= self.latency_s <= MAX_LATENCY_S
        ):
            raise ConfigError(
                f"latency_s must be a number in [0, {MAX_LATENCY_S}], got {self.latency_s!r}"
            )
        if self.latency_scope not in LATENCY_SCOPES:
            raise ConfigError(
                f"latency_scope must be one of {LATENCY_SCOPES}, got {self.latency_scope!r}"
            )
        if (
            isinstance(self.failure_rate, bool)
            or not isinstance(self.failure_rate, (int, float))
            or not 0.0 <= self.failure_rate <= 1.0
        ):
            raise ConfigError(f"failure_rate must be a number in [0, 1], got {self.failure_rate!r}")
        if type(self.failure_status) is not int or self.failure_status not in FAILURE_STATUSES:
            raise ConfigError(
                f"failure_status must be one of {FAILURE_STATUSES}, got {self.failure_status!r}"
            )
        return self
