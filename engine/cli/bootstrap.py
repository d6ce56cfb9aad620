"""`pdo bootstrap`: the PD bootstrap server alone (engine/bootstrap/server.py), until SIGINT or SIGTERM."""

from __future__ import annotations

import argparse

from engine.bootstrap.faults import FAILURE_STATUSES, LATENCY_SCOPES
from spec import domains as d


def register(sub) -> None:
    p = sub.add_parser(
        "bootstrap",
        help="run the bootstrap HTTP server alone",
        description="Run the PD bootstrap server.",
    )
    p.add_argument("--host", type=d.text(), default="127.0.0.1")
    p.add_argument(
        "--port",
        type=d.integer(0, 65535),
        default=8998,
        help="0 picks a free port (default: 8998, as SGLang)",
    )
    p.add_argument(
        "--latency-ms", type=d.number(0, 60_000), default=0.0, help="delay added to requests"
    )
    p.add_argument("--latency-scope", choices=LATENCY_SCOPES, default="all")
    p.add_argument(
        "--failure-rate", type=d.ratio(), default=0.0, help="fraction of query_dp_ranks that fail"
    )
    p.add_argument("--failure-status", type=int, choices=FAILURE_STATUSES, default=503)
    p.add_argument("--seed", type=d.seed(), default=0)
    p.add_argument(
        "--expected-ranks",
        type=d.integer(1, 1024),
        default=None,
        help="ranks to wait for before publishing parallel info (default: from topology)",
    )
    p.add_argument(
        "--room-ttl-s",
        type=d.number(0, 1e7),
        default=120.0,
        help="forget a room's dp_rank after this long; 0 keeps them (default: 120, as SGLang)",
    )
    p.add_argument(
        "--test-routes",
        action="store_true",
        help="TEST-ONLY: serve GET/POST /_faults and GET /_stats (fault injection, counters), "
        "to loopback clients only; never on a reachable server (any caller can make every "
        "query fail)",
    )
    p.add_argument(
        "--test-routes-from-anywhere",
        action="store_true",
        help="TEST-ONLY: with --test-routes, answer them to clients on any address",
    )
    # Unrecognized arguments are reported with this usage, not pdo's.
    p.set_defaults(fn=cmd_bootstrap, error=p.error)


def cmd_bootstrap(args: argparse.Namespace) -> int:
    """Bad settings and a port in use end in `pdo`'s one-line error, exit status 2. The server
    runs until a signal stops it: exit 130 for SIGINT (README, "Exit codes"), 143 for SIGTERM."""
    from engine.bootstrap.server import serve_forever  # lazy: start-up time (aiohttp)

    signum = serve_forever(
        args.host,
        args.port,
        latency_s=args.latency_ms / 1000.0,
        latency_scope=args.latency_scope,
        failure_rate=args.failure_rate,
        failure_status=args.failure_status,
        seed=args.seed,
        expected_ranks=args.expected_ranks,
        room_ttl_s=args.room_ttl_s or None,
        test_routes=args.test_routes or args.test_routes_from_anywhere,
        test_routes_from_anywhere=args.test_routes_from_anywhere,
    )
    return 128 + signum
