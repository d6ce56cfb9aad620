"""Bootstrap server for PD disaggregation, wire-compatible with SGLang's.

Prefill ranks register their parallel layout and KV endpoint here; decode
learns the prefill topology, each rank's endpoint and (when prefill has
several DP ranks) which DP rank took a given bootstrap room.

Endpoints (status codes and JSON bodies as SGLang 0.5.23's CommonKVBootstrapServer;
tests/sglang/test_wire.py runs both side by side, docs/decode.md "The wire" lists
the differences kept on purpose):
  PUT  /route                 register one prefill rank             -> 200 "OK"
  GET  /route?<all -1>        prefill parallel info                 -> 200 JSON | 503
  GET  /route?<rank coords>   one rank's {"rank_ip", "rank_port"}   -> 200 | 404 | 503
  POST /register_dp_rank      {"bootstrap_room", "dp_rank"}         -> 200 "OK"
  POST /query_dp_ranks        {"bootstrap_rooms": [...]}            -> 200 {"<room>": rank}
  GET|HEAD /health                                                  -> 200 "OK"
  GET|POST /_faults, GET /_stats   test/benchmark admin (never delayed or failed)

GET /route takes either SGLang's current coordinates (prefill_dp_rank,
prefill_cp_rank, target_tp_rank, target_pp_rank) or the older ones
(engine_rank, target_dp_group, target_pp_rank).  Bad input gets a 4xx with a
one-line plain-text reason (SGLang answers most bad input with a 500).

In-process (``start_inproc()``, URL ``inproc://<name>``): the same handlers called
directly by engine/bootstrap_client.py, no socket; injected latency is a
``sync.sleep`` in the caller (virtual time under a schedule controller). Used by
controlled schedule fuzzing of PD runs (docs/fuzzing.md).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import json
import math
import random
import signal
import sys
import threading
import time
from typing import Any

from aiohttp import web

_LATENCY_SCOPES = ("all", "query_dp_ranks")
_FAILURE_STATUSES = (500, 503)
_MAX_LATENCY_S = 3600.0  # bounds asyncio.sleep; more is a typo, not a test

# Query parameter sets accepted by GET /route; the first is SGLang's current
# client, the second its older (pre context-parallel) one.
_ROUTE_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
_LEGACY_ROUTE_PARAMS = ("engine_rank", "target_dp_group", "target_pp_rank")

# The parallel info body: every field of SGLang 0.5.23's PrefillServerInfo, which its
# server serialises whole (dataclasses.asdict) and its decode rebuilds with
# PrefillServerInfo(**body), so a key it lacks would break the decode and a key missing
# here silently takes its default (skipping, e.g., the kv_layout check or the
# decode_allocation_policy one).  The last six are the decode's own rank mapping, always
# null from the server.  kv_layout and dsv41_spec_layout are left out when null, as SGLang.
_INFO_FIELDS = ("attn_tp_size", "attn_cp_size", "dp_size", "pp_size", "page_size", "kv_cache_dtype",
                "follow_bootstrap_room", "enable_dsa_cache_layer_split", "dsv41_spec_layout", "kv_layout",
                "decode_allocation_policy", "enable_kv_cache_sharding", "prefill_http_port")
_INFO_DECODE_SIDE = ("target_tp_rank", "target_tp_ranks", "target_cp_ranks", "target_pp_ranks",
                     "required_dst_info_num", "required_prefill_response_num")
_INFO_OMITTED_WHEN_NULL = ("dsv41_spec_layout", "kv_layout")


@dataclasses.dataclass(frozen=True)
class Faults:
    latency_s: float = 0.0
    latency_scope: str = "all"  # "all" requests, or "query_dp_ranks" only
    failure_rate: float = 0.0  # fraction of query_dp_ranks answered with failure_status
    failure_status: int = 503

    def validated(self) -> "Faults":
        if isinstance(self.latency_s, bool) or not isinstance(self.latency_s, (int, float)) \
                or not 0 <= self.latency_s <= _MAX_LATENCY_S:
            raise ValueError(f"latency_s must be a number in [0, {_MAX_LATENCY_S}], got {self.latency_s!r}")
        if self.latency_scope not in _LATENCY_SCOPES:
            raise ValueError(f"latency_scope must be one of {_LATENCY_SCOPES}, got {self.latency_scope!r}")
        if isinstance(self.failure_rate, bool) or not isinstance(self.failure_rate, (int, float)) \
                or not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError(f"failure_rate must be a number in [0, 1], got {self.failure_rate!r}")
        if type(self.failure_status) is not int or self.failure_status not in _FAILURE_STATUSES:
            raise ValueError(f"failure_status must be one of {_FAILURE_STATUSES}, got {self.failure_status!r}")
        return self


def _bad(reason: str) -> web.HTTPBadRequest:
    # Reasons may quote client input; keep them one short line.
    reason = " ".join(reason.split())
    return web.HTTPBadRequest(text=reason if len(reason) <= 200 else reason[:197] + "...")


async def _json_object(request: web.Request) -> dict:
    body = await request.read()
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        raise _bad(f"request body is not valid JSON: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
    if not isinstance(data, dict):
        raise _bad(f"request body must be a JSON object, got {type(data).__name__}")
    return data


_MISSING = object()


def _int_field(data: dict, key: str, *, minimum: int | None = None, default: Any = _MISSING) -> Any:
    value = data.get(key, _MISSING)
    if value is _MISSING or (value is None and default is not _MISSING):
        if default is _MISSING:
            raise _bad(f"missing field '{key}'")
        return default
    # bool is an int subclass; a JSON true is never a valid rank or size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(f"field '{key}' must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise _bad(f"field '{key}' must be >= {minimum}, got {value}")
    return value


def _str_field(data: dict, key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise _bad(f"field '{key}' must be a string or null")
    return value


def _query_int(query, key: str) -> int:
    raw = query.get(key)
    if raw is None or raw == "":
        raise _bad(f"missing query parameter '{key}'")
    try:
        return int(raw)
    except ValueError:
        raise _bad(f"query parameter '{key}' must be an integer, got {raw!r}") from None


_INPROC: dict[str, "BootstrapServer"] = {}
_INPROC_LOCK = threading.Lock()


def inproc_server(name: str) -> "BootstrapServer | None":
    with _INPROC_LOCK:
        return _INPROC.get(name)


class InProcResponse:
    """What the client reads of an answer: status_code, text, json()."""

    def __init__(self, status_code: int, text: str):
        self.status_code, self.text = status_code, text

    def json(self) -> Any:
        return json.loads(self.text)


def _inproc_body(payload: Any) -> dict:
    """The JSON round trip an HTTP body makes (so keys and types are what the handlers see over HTTP)."""
    data = json.loads(json.dumps(payload))
    if not isinstance(data, dict):
        raise _bad(f"request body must be a JSON object, got {type(data).__name__}")
    return data


class BootstrapServer:
    """The bootstrap server on its own event loop in a daemon thread.

    State lives on the loop thread only; handlers never await while touching it,
    so no asyncio lock is needed.  ``counters`` and ``set_faults`` are safe to
    call from any thread.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, latency_s: float = 0.0,
                 latency_scope: str = "all", failure_rate: float = 0.0, failure_status: int = 503,
                 seed: int = 0, expected_ranks: int | None = None, room_ttl_s: float | None = 120.0):
        if expected_ranks is not None and (isinstance(expected_ranks, bool) or expected_ranks < 1):
            raise ValueError(f"expected_ranks must be a positive int or None, got {expected_ranks!r}")
        if room_ttl_s is not None and not room_ttl_s > 0:
            raise ValueError(f"room_ttl_s must be > 0 or None, got {room_ttl_s!r}")
        self._host = host
        self._port = port
        self._faults = Faults(latency_s, latency_scope, failure_rate, failure_status).validated()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # guards _faults, _rng, _counters across threads
        self._counters: collections.Counter[str] = collections.Counter()
        self._expected_ranks = expected_ranks
        # As SGLang (SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL, 120 s), forget
        # room -> dp_rank entries after a while so the table stays bounded; None keeps them.
        self._room_ttl_s = room_ttl_s
        self._last_prune = time.monotonic()

        self._topology: dict[str, Any] | None = None  # from the first registered rank
        self._ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}  # (dp, cp, tp, pp) -> endpoint
        self._rooms: dict[int, tuple[int, float]] = {}  # room -> (dp_rank, registered at)

        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_error: BaseException | None = None
        self._inproc: str | None = None  # name under which start_inproc() registered this server
        self._state_lock = threading.Lock()  # in-process calls come from many threads

    # ---- lifecycle -------------------------------------------------------

    def start(self) -> "BootstrapServer":
        if self._thread is not None:
            raise RuntimeError("bootstrap server already started")
        ready = threading.Event()
        self._start_error = None
        self._thread = threading.Thread(target=self._run, args=(ready,), name="bootstrap-server", daemon=True)
        self._thread.start()
        ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._thread = None
            raise self._start_error
        return self

    def start_inproc(self, name: str = "bootstrap") -> "BootstrapServer":
        """Serve in-process instead of over HTTP, at `inproc://<name>`: the client functions of
        engine/bootstrap_client.py call the same handlers directly (same state, status codes, bodies
        and fault injection; injected latency is a sync.sleep in the caller, virtual time under a
        schedule controller). For controlled, replayable runs (checker/fuzz.py); docs/fuzzing.md."""
        if self._thread is not None or self._inproc is not None:
            raise RuntimeError("bootstrap server already started")
        with _INPROC_LOCK:
            if name in _INPROC:
                raise RuntimeError(f"an in-process bootstrap server named {name!r} is already running")
            _INPROC[name] = self
        self._inproc = name
        return self

    def handle_inproc(self, method: str, path: str, *, params: dict | None = None, payload: Any = None,
                      timeout: float) -> "InProcResponse":
        """One request, as the HTTP server would answer it. Raises TimeoutError when the injected
        latency reaches `timeout` (the caller waited that long, as an HTTP client would)."""
        from . import sync

        name = self._ENDPOINTS.get((method, path), "other")
        self._count(name)
        delay, failure = (0.0, None) if name in ("faults", "stats", "other") else self._fault_plan(name)
        if delay:
            if delay >= timeout:
                sync.sleep(timeout)
                raise TimeoutError(f"no answer within {timeout} s")
            sync.sleep(delay)
        if failure is not None:
            return InProcResponse(failure, "injected failure")
        query = {k: str(v) for k, v in (params or {}).items()}
        try:
            with self._state_lock:
                if name == "health":
                    resp = web.Response(text="" if method == "HEAD" else "OK")
                elif name == "route_put":
                    resp = self._do_route_put(_inproc_body(payload))
                elif name == "route_get":
                    resp = self._do_route_get(query)
                elif name == "register_dp_rank":
                    resp = self._do_register_dp_rank(_inproc_body(payload))
                elif name == "query_dp_ranks":
                    resp = self._do_query_dp_ranks(_inproc_body(payload))
                elif name == "stats":
                    resp = web.json_response({"counters": self.counters, "registered_ranks": len(self._ranks),
                                              "expected_ranks": self.expected_ranks, "known_rooms": len(self._rooms)})
                else:
                    resp = web.HTTPNotFound(text="404: Not Found")
        except web.HTTPException as exc:
            resp = exc
        return InProcResponse(resp.status, resp.text or "")

    def stop(self) -> None:
        if self._inproc is not None:
            with _INPROC_LOCK:
                _INPROC.pop(self._inproc, None)
            self._inproc = None
            return
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return
        try:
            loop.call_soon_threadsafe(loop.stop)
        except RuntimeError:  # loop already closed
            pass
        thread.join(timeout=10)
        self._thread = None
        self._loop = None

    def __enter__(self) -> "BootstrapServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        # Short shutdown_timeout: stop() should not hang on a request stuck in injected latency.
        runner = web.AppRunner(self._make_app(), access_log=None, handle_signals=False, shutdown_timeout=0.5)
        try:
            loop.run_until_complete(runner.setup())
            site = web.TCPSite(runner, self._host, self._port)
            loop.run_until_complete(site.start())
            self._port = runner.addresses[0][1]
            self._loop = loop
        except BaseException as e:  # e.g. port in use: report it from start()
            self._start_error = e
            loop.run_until_complete(runner.cleanup())
            loop.close()
            ready.set()
            return
        ready.set()
        try:
            loop.run_forever()
        finally:
            loop.run_until_complete(runner.cleanup())
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

    @property
    def port(self) -> int:
        return self._port

    @property
    def url(self) -> str:
        if self._inproc is not None:
            return f"inproc://{self._inproc}"
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self._host, self._host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self._port}"

    # ---- faults and counters ----------------------------------------------

    def set_faults(self, *, seed: int | None = None, **changes: Any) -> Faults:
        """Change fault injection at run time; unknown keys raise TypeError, bad values ValueError."""
        with self._lock:
            new = dataclasses.replace(self._faults, **changes).validated()
            self._faults = new
            if seed is not None:
                self._rng.seed(seed)
        return new

    @property
    def faults(self) -> Faults:
        return self._faults

    @property
    def counters(self) -> dict[str, int]:
        """Requests seen per endpoint (route_put, route_get, register_dp_rank, query_dp_ranks,
        health, faults, stats, other) plus query_dp_ranks_injected_failures."""
        with self._lock:
            return dict(self._counters)

    def reset_counters(self) -> None:
        with self._lock:
            self._counters.clear()

    def _count(self, name: str) -> None:
        with self._lock:
            self._counters[name] += 1

    # ---- state helpers --------------------------------------------------

    @property
    def expected_ranks(self) -> int | None:
        if self._expected_ranks is not None:
            return self._expected_ranks
        t = self._topology
        if t is None:
            return None
        return t["dp_size"] * t["attn_cp_size"] * t["attn_tp_size"] * t["pp_size"]

    @property
    def is_ready(self) -> bool:
        expected = self.expected_ranks
        return expected is not None and len(self._ranks) >= expected

    def _not_ready(self) -> web.HTTPServiceUnavailable:
        expected = self.expected_ranks
        return web.HTTPServiceUnavailable(
            text=f"prefill server not fully registered yet ({len(self._ranks)}/{expected or '?'} ranks)")

    # ---- app ------------------------------------------------------------

    def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_put("/route", self._route_put)
        app.router.add_get("/route", self._route_get, allow_head=False)
        app.router.add_post("/register_dp_rank", self._register_dp_rank)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
        app.router.add_get("/health", self._health)  # HEAD too, as SGLang (load-balancer probes)
        app.router.add_get("/_faults", self._faults_get, allow_head=False)
        app.router.add_post("/_faults", self._faults_post)
        app.router.add_get("/_stats", self._stats, allow_head=False)
        return app

    _ENDPOINTS = {
        ("PUT", "/route"): "route_put", ("GET", "/route"): "route_get",
        ("POST", "/register_dp_rank"): "register_dp_rank", ("POST", "/query_dp_ranks"): "query_dp_ranks",
        ("GET", "/health"): "health", ("HEAD", "/health"): "health",
        ("GET", "/_faults"): "faults", ("POST", "/_faults"): "faults", ("GET", "/_stats"): "stats",
    }

    def _fault_plan(self, name: str) -> tuple[float, int | None]:
        """(delay in s, injected failure status or None) for one request to endpoint `name`."""
        with self._lock:
            faults = self._faults
            # Draw for every query, whatever the rate, so a seed fixes the whole failure sequence.
            draw = self._rng.random() if name == "query_dp_ranks" else 1.0
        delay = faults.latency_s if faults.latency_s > 0 and (faults.latency_scope == "all" or name == "query_dp_ranks") else 0.0
        if draw < faults.failure_rate:
            self._count("query_dp_ranks_injected_failures")
            return delay, faults.failure_status
        return delay, None

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        name = self._ENDPOINTS.get((request.method, request.path), "other")
        self._count(name)
        if name in ("faults", "stats", "other"):
            return await handler(request)
        delay, failure = self._fault_plan(name)
        if delay:
            await asyncio.sleep(delay)
        if failure is not None:
            return web.Response(status=failure, text="injected failure")
        return await handler(request)

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="OK")

    async def _route_put(self, request: web.Request) -> web.Response:
        return self._do_route_put(await _json_object(request))

    def _do_route_put(self, data: dict) -> web.Response:
        role = data.get("role", "Prefill")
        if role != "Prefill":
            raise _bad(f"only role 'Prefill' registers here, got {role!r}")
        tp_size = _int_field(data, "attn_tp_size", minimum=1)
        cp_size = _int_field(data, "attn_cp_size", minimum=1, default=1)  # absent before SGLang had CP
        attn_dp_size = _int_field(data, "attn_dp_size", minimum=1)
        pp_size = _int_field(data, "pp_size", minimum=1)
        sys_dp_size = _int_field(data, "system_dp_size", minimum=1)
        tp_rank = _int_field(data, "attn_tp_rank", minimum=0)
        cp_rank = _int_field(data, "attn_cp_rank", minimum=0, default=0)
        attn_dp_rank = _int_field(data, "attn_dp_rank", minimum=0)
        pp_rank = _int_field(data, "pp_rank", minimum=0)
        sys_dp_rank = _int_field(data, "system_dp_rank", minimum=0)
        rank_port = _int_field(data, "rank_port", minimum=1)
        page_size = _int_field(data, "page_size", minimum=1, default=None)
        prefill_http_port = _int_field(data, "prefill_http_port", minimum=1, default=None)
        rank_ip = data.get("rank_ip")
        if not isinstance(rank_ip, str) or not rank_ip:
            raise _bad("field 'rank_ip' must be a non-empty string")
        if rank_port > 65535:
            raise _bad(f"field 'rank_port' must be <= 65535, got {rank_port}")
        kv_cache_dtype = _str_field(data, "kv_cache_dtype")
        kv_layout = _str_field(data, "kv_layout")
        policy = _str_field(data, "decode_allocation_policy")
        if policy is None:  # absent from older clients, whose only policy was "early"
            policy = "early"
        dsv41_spec_layout = data.get("dsv41_spec_layout")
        if dsv41_spec_layout is not None and not isinstance(dsv41_spec_layout, dict):
            raise _bad("field 'dsv41_spec_layout' must be an object or null")
        for rank, size, what in ((tp_rank, tp_size, "attn_tp"), (cp_rank, cp_size, "attn_cp"),
                                 (attn_dp_rank, attn_dp_size, "attn_dp"), (pp_rank, pp_size, "pp"),
                                 (sys_dp_rank, sys_dp_size, "system_dp")):
            if rank >= size:
                raise _bad(f"{what}_rank {rank} out of range for {what}_size {size}")

        # As in SGLang: with one system DP rank, DP attention ranks are the DP groups.
        single = sys_dp_size == 1
        dp_size, dp_group = (attn_dp_size, attn_dp_rank) if single else (sys_dp_size, sys_dp_rank)
        topology = {"attn_tp_size": tp_size, "attn_cp_size": cp_size, "dp_size": dp_size,
                    "pp_size": pp_size, "page_size": page_size}
        t = self._topology
        if t is not None:
            # Both refused with a 400 by SGLang too: a decode pairs with all prefill ranks
            # under one policy and one DSpark layout.
            if dsv41_spec_layout != t["dsv41_spec_layout"]:
                raise _bad("dsv41_spec_layout differs from the one registered by earlier prefill ranks")
            if policy != t["decode_allocation_policy"]:
                raise _bad(f"decode_allocation_policy={policy!r} conflicts with registered "
                           f"{t['decode_allocation_policy']!r}")
            # SGLang silently keeps the first rank's sizes; a mismatch means a misconfigured
            # deployment, which is better refused than served as a wrong topology.
            for key, value in topology.items():
                known = t[key]
                if value is not None and known is not None and value != known:
                    raise web.HTTPConflict(text=f"{key}={value} conflicts with registered {key}={known}")
        else:
            t = self._topology = {
                **topology,
                "follow_bootstrap_room":
                    data.get("load_balance_method", "follow_bootstrap_room") == "follow_bootstrap_room",
                "enable_dsa_cache_layer_split": bool(data.get("enable_dsa_cache_layer_split", False)),
                "enable_kv_cache_sharding": bool(data.get("enable_kv_cache_sharding", False)),
                "dsv41_spec_layout": dsv41_spec_layout,
                "decode_allocation_policy": policy,
                "kv_cache_dtype": None, "kv_layout": None, "prefill_http_port": None,
            }
        # SGLang takes these from the first rank that sends one, not from the first rank.
        for key, value in (("page_size", page_size), ("kv_cache_dtype", kv_cache_dtype),
                           ("kv_layout", kv_layout), ("prefill_http_port", prefill_http_port)):
            if t[key] is None:
                t[key] = value
        # Re-registration replaces the endpoint and is not counted twice (SGLang counts PUTs).
        self._ranks[(dp_group, cp_rank, tp_rank, pp_rank)] = {"rank_ip": rank_ip, "rank_port": rank_port}
        return web.Response(text="OK")

    def _parallel_info(self) -> dict[str, Any]:
        t = self._topology
        assert t is not None
        info = {k: t[k] for k in _INFO_FIELDS if not (k in _INFO_OMITTED_WHEN_NULL and t[k] is None)}
        info.update(dict.fromkeys(_INFO_DECODE_SIDE))
        return info

    async def _route_get(self, request: web.Request) -> web.Response:
        return self._do_route_get(request.query)

    def _do_route_get(self, query) -> web.Response:
        # The current client never sends engine_rank; a query with both sets is a current one.
        legacy = "engine_rank" in query and "prefill_dp_rank" not in query
        names = _LEGACY_ROUTE_PARAMS if legacy else _ROUTE_PARAMS
        values = {n: _query_int(query, n) for n in names}
        if all(v == -1 for v in values.values()):
            if not self.is_ready:
                raise self._not_ready()
            info = self._parallel_info()
            if legacy:  # the older client reads these keys instead
                info.update(prefill_attn_tp_size=info["attn_tp_size"], prefill_dp_size=info["dp_size"],
                            prefill_pp_size=info["pp_size"])
            return web.json_response(info)
        if legacy:
            key = (values["target_dp_group"], 0, values["engine_rank"], values["target_pp_rank"])
        else:
            key = tuple(values[n] for n in _ROUTE_PARAMS)
        if not self.is_ready:
            raise self._not_ready()
        endpoint = self._ranks.get(key)
        if endpoint is None:
            coords = " ".join(f"{n}={v}" for n, v in values.items())
            raise web.HTTPNotFound(text=f"no prefill rank registered at {coords}")
        return web.json_response(endpoint)

    def _prune_rooms(self, now: float) -> None:
        if self._room_ttl_s is None or now - self._last_prune < self._room_ttl_s:
            return
        self._last_prune = now
        cutoff = now - self._room_ttl_s
        for room in [r for r, (_, t) in self._rooms.items() if t < cutoff]:
            del self._rooms[room]

    async def _register_dp_rank(self, request: web.Request) -> web.Response:
        return self._do_register_dp_rank(await _json_object(request))

    def _do_register_dp_rank(self, data: dict) -> web.Response:
        room = _int_field(data, "bootstrap_room", minimum=0)
        dp_rank = _int_field(data, "dp_rank", minimum=0)
        if self._topology is not None and dp_rank >= self._topology["dp_size"]:
            raise _bad(f"dp_rank {dp_rank} out of range for dp_size {self._topology['dp_size']}")
        now = time.monotonic()
        self._prune_rooms(now)
        self._rooms[room] = (dp_rank, now)
        return web.Response(text="OK")

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        return self._do_query_dp_ranks(await _json_object(request))

    def _do_query_dp_ranks(self, data: dict) -> web.Response:
        rooms = data.get("bootstrap_rooms", _MISSING)
        if rooms is _MISSING:
            raise _bad("missing field 'bootstrap_rooms'")
        if not isinstance(rooms, list):
            raise _bad(f"field 'bootstrap_rooms' must be a list, got {type(rooms).__name__}")
        for room in rooms:
            if isinstance(room, bool) or not isinstance(room, int):
                raise _bad(f"field 'bootstrap_rooms' must hold integers, got {type(room).__name__}")
        expired_before = -math.inf if self._room_ttl_s is None else time.monotonic() - self._room_ttl_s
        result = {}
        for room in rooms:
            entry = self._rooms.get(room)
            if entry is not None and entry[1] >= expired_before:
                result[str(room)] = entry[0]
        return web.json_response(result)

    async def _faults_get(self, request: web.Request) -> web.Response:
        return web.json_response(dataclasses.asdict(self._faults))

    async def _faults_post(self, request: web.Request) -> web.Response:
        data = await _json_object(request)
        allowed = {f.name for f in dataclasses.fields(Faults)} | {"seed"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise _bad(f"unknown fault field(s) {unknown}; allowed: {sorted(allowed)}")
        seed = _int_field(data, "seed", default=None)
        changes = {k: v for k, v in data.items() if k != "seed"}
        try:
            faults = self.set_faults(seed=seed, **changes)
        except ValueError as e:
            raise _bad(str(e))
        return web.json_response(dataclasses.asdict(faults))

    async def _stats(self, request: web.Request) -> web.Response:
        return web.json_response({"counters": self.counters, "registered_ranks": len(self._ranks),
                                  "expected_ranks": self.expected_ranks, "known_rooms": len(self._rooms)})


def serve_forever(host: str = "127.0.0.1", port: int = 8998, **options: Any) -> None:
    """Run a BootstrapServer until SIGINT or SIGTERM; options go to BootstrapServer."""
    server = BootstrapServer(host, port, **options)  # validate before touching signal handlers
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    try:
        with server:
            # One parseable line, so a parent started with --port 0 can learn the port.
            print(f"bootstrap server listening on {server.url}", flush=True)
            while not stop.wait(0.5):  # a timed wait lets the signal handler run promptly
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    p = parser or argparse.ArgumentParser(prog="pdo bootstrap", description="Run the PD bootstrap server.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8998, help="0 picks a free port (default: 8998, as SGLang)")
    p.add_argument("--latency-ms", type=float, default=0.0, help="delay added to requests")
    p.add_argument("--latency-scope", choices=_LATENCY_SCOPES, default="all")
    p.add_argument("--failure-rate", type=float, default=0.0, help="fraction of query_dp_ranks that fail")
    p.add_argument("--failure-status", type=int, choices=_FAILURE_STATUSES, default=503)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--expected-ranks", type=int, default=None,
                   help="ranks to wait for before publishing parallel info (default: from topology)")
    p.add_argument("--room-ttl-s", type=float, default=120.0,
                   help="forget a room's dp_rank after this long; 0 keeps them (default: 120, as SGLang)")
    return p


def add_cli(subparsers) -> argparse.ArgumentParser:
    """Register `bootstrap` on an argparse subparsers object; sets func=main-style runner."""
    p = _parser(subparsers.add_parser("bootstrap", help="run the PD bootstrap server"))
    p.set_defaults(func=_run_args)
    return p


def _run_args(args: argparse.Namespace) -> int:
    try:
        serve_forever(args.host, args.port, latency_s=args.latency_ms / 1000.0,
                      latency_scope=args.latency_scope, failure_rate=args.failure_rate,
                      failure_status=args.failure_status, seed=args.seed,
                      expected_ranks=args.expected_ranks, room_ttl_s=args.room_ttl_s or None)
    except (ValueError, OSError) as e:
        print(f"pdo bootstrap: error: {e}", file=sys.stderr)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    return _run_args(_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
