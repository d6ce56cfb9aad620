"""Decode-instance knobs. Defaults follow SGLang where it has a counterpart (named in the comment)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError, EngineError
from spec.vocabulary import DECODE_LOOPS


@dataclass
class DecodeConfig:
    loop: str = "overlap"  # event_loop_normal_disagg_decode | event_loop_overlap_disagg_decode
    prefetch: bool = True  # PR #35071; False is the synchronous baseline (--no-prefetch)
    polling_interval: int = 1  # --disaggregation-decode-polling-interval
    # Request intake's wait per iteration: SGLang's recv_requests broadcasts new requests to the attention
    # TP group every iteration, blocking (GIL released) between the loop top and the consumption point.
    recv_wait_us: float = 0.0
    max_running: int = 16  # requests decoded together (max_running_requests)
    num_pages: int = 512
    max_slots: int = 64
    # Bootstrap queries. One query is the client's call: `query_retries` retries with backoff inside it.
    query_timeout_s: float = 5.0  # SGLang: 5 s on every bootstrap request
    query_retries: int = 2
    query_failure_budget: int = (
        50  # consecutive failed consumption points per address, then abort its requests
    )
    # Prefill parallel info (GET /route): retried at an interval, then the address's requests are aborted.
    info_retry_interval_s: float = 0.02
    info_max_retries: int = 250
    bootstrap_timeout_s: float = (
        30.0  # a room the server still does not know after this: abort the request
    )
    kv_timeout_s: float = 30.0  # KV still incomplete this long after receiver init: abort
    executor_workers: int = 2

    def __post_init__(self):
        if self.loop not in DECODE_LOOPS:
            raise ConfigError(
                f"unknown decode loop {self.loop!r}; choose one of {', '.join(DECODE_LOOPS)}"
            )
        if self.polling_interval < 1:
            raise ConfigError("polling_interval must be >= 1")
        if self.max_running < 1:
            raise ConfigError("max_running must be >= 1")


ROUTERS = ("round_robin", "random")


class PDError(EngineError):
    """A PD run that cannot start or did not finish; the CLI prints it on one line (exit 1)."""


class PDStartupError(PDError, ConfigError):
    """A PD run that cannot start as configured (a bootstrap URL nothing answers): bad input, 2."""
