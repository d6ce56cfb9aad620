"""Bootstrap server for PD disaggregation, wire-compatible with SGLang's.

Prefill ranks register their parallel layout and KV endpoint here; decode
learns the prefill topology, each rank's endpoint and (when prefill has
several DP ranks) which DP rank took a given bootstrap room.

Endpoints (status codes and JSON bodies as SGLang 0.5.23's CommonKVBootstrapServer;
tests/engine/sglang/test_wire.py runs both side by side, docs/decode.md "The wire" lists
the differences kept on purpose):
  PUT  /route                 register one prefill rank             -> 200 "OK"
  GET  /route?<all -1>        prefill parallel info                 -> 200 JSON | 503
  GET  /route?<rank coords>   one rank's {"rank_ip", "rank_port"}   -> 200 | 404 | 503
  POST /register_dp_rank      {"bootstrap_room", "dp_rank"}         -> 200 "OK"
  POST /query_dp_ranks        {"bootstrap_rooms": [...]}            -> 200 {"<room>": rank}
  GET|HEAD /health                                                  -> 200 "OK"
  GET|POST /_faults, GET /_stats   TEST-ONLY admin (never delayed or failed): off unless
                              test_routes=True (`pdo bootstrap --test-routes`), and then they
                              answer loopback clients only (403 to others) unless
                              test_routes_from_anywhere=True; off, they are 404 as in SGLang.
                              POST /_faults can make every query_dp_ranks fail: never expose it.

GET /route takes either SGLang's current coordinates (prefill_dp_rank,
prefill_cp_rank, target_tp_rank, target_pp_rank) or the older ones
(engine_rank, target_dp_group, target_pp_rank).  Bad input gets a 4xx with a
one-line plain-text reason (SGLang answers most bad input with a 500).

This module runs the server (its thread and event loop, the aiohttp app, fault injection,
counters); engine/bootstrap/state.py holds its tables and answers, engine/bootstrap/faults.py
the fault settings, engine/cli/bootstrap.py the `pdo bootstrap` command.

In-process (``start_inproc()``, URL ``inproc://<name>``): the same handlers called
directly by engine/bootstrap/client.py, no socket; injected latency is a
``sync.sleep`` in the caller (virtual time under a schedule controller). Used by
controlled schedule fuzzing of PD runs (docs/fuzzing.md). Under a controller the server belongs to
that run: only the threads of the same controller reach it, and its room TTL reads virtual time.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import json
import random
import signal
import threading
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from engine import sync
from engine.bootstrap.faults import Faults
from engine.bootstrap.log import describe, loop_exception_handler, server_log
from engine.bootstrap.state import BootstrapState, bad_request, int_field

# Endpoint names, as counted; the admin ones and unknown paths are never delayed or failed.
_ENDPOINTS = {
    ("PUT", "/route"): "route_put",
    ("GET", "/route"): "route_get",
    ("POST", "/register_dp_rank"): "register_dp_rank",
    ("POST", "/query_dp_ranks"): "query_dp_ranks",
    ("GET", "/health"): "health",
    ("HEAD", "/health"): "health",
    ("GET", "/_faults"): "faults",
    ("POST", "/_faults"): "faults",
    ("GET", "/_stats"): "stats",
}
_NEVER_FAULTED = ("faults", "stats", "other")


async def _json_object(request: web.Request) -> dict:
    try:
        body = await request.read()
    except RequestPayloadError as e:  # a body its Content-Encoding does not decode (not gzip)
        raise bad_request(f"request body could not be read: {describe(e.__cause__ or e)}") from None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError) as e:  # JSONDecodeError and bad UTF-8 are ValueErrors
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise bad_request(f"request body is not valid JSON: {first_line}") from None
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    return data


# ---- in-process serving ----------------------------------------------------------------------

# (name, owner) -> server; owner: the controller of the run that started it (sync.owner()), None
# outside control. A thread left over from an earlier controlled run has another owner (None), so
# it cannot reach a later run's server of the same name, and the URL (which the trace records)
# stays `inproc://bootstrap` in every run.
_INPROC: dict[tuple[str, object], BootstrapServer] = {}
_INPROC_LOCK = threading.Lock()


def inproc_server(name: str) -> BootstrapServer | None:
    """The in-process server `name` of the calling thread's run (its controller, or none)."""
    with _INPROC_LOCK:
        return _INPROC.get((name, sync.owner()))


class InProcResponse:
    """What the client reads of an answer: status_code, text, json()."""

    def __init__(self, status_code: int, text: str):
        self.status_code, self.text = status_code, text

    def json(self) -> Any:
        return json.loads(self.text)


def _inproc_body(payload: Any) -> dict:
    """The JSON round trip an HTTP body makes (so keys and types are what the handlers see over
    HTTP)."""
    data = json.loads(json.dumps(payload))
    if not isinstance(data, dict):
        raise bad_request(f"request body must be a JSON object, got {type(data).__name__}")
    return data


# ---- the server ------------------------------------------------------------------------------


class BootstrapServer(BootstrapState):
    """The bootstrap server on its own event loop in a daemon thread.

    State lives on the loop thread only; handlers never await while touching it,
    so no asyncio lock is needed.  ``counters`` and ``set_faults`` are safe to
    call from any thread.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        latency_s: float = 0.0,
        latency_scope: str = "all",
        failure_rate: float = 0.0,
        failure_status: int = 503,
        seed: int = 0,
        expected_ranks: int | None = None,
        room_ttl_s: float | None = 120.0,
        test_routes: bool = False,
        test_routes_from_anywhere: bool = False,
    ):
        super().__init__(expected_ranks, room_ttl_s)
        self._test_routes = test_routes
        self._test_routes_from_anywhere = test_routes_from_anywhere
        self._host = host
        self._port = port
        self._faults = Faults(latency_s, latency_scope, failure_rate, failure_status).validated()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()  # guards _faults, _rng, _counters across threads
        self._counters: collections.Counter[str] = collections.Counter()

        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._start_error: BaseException | None = None
        # (name, owner) under which start_inproc() registered this server
        self._inproc: tuple[str, object] | None = None
        self._state_lock = threading.Lock()  # in-process calls come from many threads

    # ---- lifecycle -------------------------------------------------------

    def start(self) -> BootstrapServer:
        if self._thread is not None:
            raise RuntimeError("bootstrap server already started")
        ready = threading.Event()
        self._start_error = None
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="bootstrap-server", daemon=True
        )
        self._thread.start()
        ready.wait()
        if self._start_error is not None:
            self._thread.join()
            self._thread = None
            raise self._start_error
        return self

    def start_inproc(self, name: str = "bootstrap") -> BootstrapServer:
        """Serve in-process instead of over HTTP, at `inproc://<name>`: the client functions of
        engine/bootstrap/client.py call the same handlers directly (same state, status codes, bodies
        and fault injection; injected latency is a sync.sleep in the caller, virtual time under a
        schedule controller). For controlled, replayable runs (checker/fuzz/); docs/fuzzing.md."""
        if self._thread is not None or self._inproc is not None:
            raise RuntimeError("bootstrap server already started")
        key = (name, sync.owner())
        with _INPROC_LOCK:
            if key in _INPROC:
                raise RuntimeError(
                    f"an in-process bootstrap server named {name!r} is already running"
                )
            _INPROC[key] = self
        self._inproc = key
        if key[1] is not None:  # under a controller: the room TTL in virtual time, as every wait
            self.use_clock(sync.now)
        return self

    def handle_inproc(
        self,
        method: str,
        path: str,
        *,
        params: dict | None = None,
        payload: Any = None,
        timeout: float,
    ) -> InProcResponse:
        """One request, as the HTTP server would answer it. Raises TimeoutError when the injected
        latency reaches `timeout` (the caller waited that long, as an HTTP client would)."""
        name = _ENDPOINTS.get((method, path), "other")
        self._count(name)
        delay, failure = (0.0, None) if name in _NEVER_FAULTED else self._fault_plan(name)
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
                resp = self._answer_inproc(name, method, query, payload)
        except web.HTTPException as exc:
            resp = exc
        return InProcResponse(resp.status, resp.text or "")

    def _answer_inproc(self, name: str, method: str, query: dict, payload: Any) -> web.Response:
        if name == "health":
            return web.Response(text="" if method == "HEAD" else "OK")
        if name == "route_put":
            return self._do_route_put(_inproc_body(payload))
        if name == "route_get":
            return self._do_route_get(query)
        if name == "register_dp_rank":
            return self._do_register_dp_rank(_inproc_body(payload))
        if name == "query_dp_ranks":
            return self._do_query_dp_ranks(_inproc_body(payload))
        if name == "stats":
            return web.json_response(self._stats_body())
        return web.HTTPNotFound(text="404: Not Found")

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

    def __enter__(self) -> BootstrapServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        log = server_log()  # a client's malformed request: one line, rate-limited
        loop.set_exception_handler(loop_exception_handler(log))
        # Short shutdown_timeout: stop() should not hang on a request stuck in injected latency.
        runner = web.AppRunner(
            self._make_app(),
            access_log=None,
            handle_signals=False,
            shutdown_timeout=0.5,
            logger=log,
        )
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
            return f"inproc://{self._inproc[0]}"
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self._host, self._host)
        if ":" in host:
            host = f"[{host}]"
        return f"http://{host}:{self._port}"

    # ---- faults and counters ----------------------------------------------

    def set_faults(self, *, seed: int | None = None, **changes: Any) -> Faults:
        """Change fault injection at run time; unknown keys raise TypeError, bad values
        ValueError."""
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

    def _fault_plan(self, name: str) -> tuple[float, int | None]:
        """(delay in s, injected failure status or None) for one request to endpoint `name`."""
        with self._lock:
            faults = self._faults
            # Draw for every query, whatever the rate, so a seed fixes the whole failure sequence.
            draw = self._rng.random() if name == "query_dp_ranks" else 1.0
        delayed = faults.latency_scope == "all" or name == "query_dp_ranks"
        delay = faults.latency_s if faults.latency_s > 0 and delayed else 0.0
        if draw < faults.failure_rate:
            self._count("query_dp_ranks_injected_failures")
            return delay, faults.failure_status
        return delay, None

    def _stats_body(self) -> dict[str, Any]:
        return {
            "counters": self.counters,
            "registered_ranks": len(self._ranks),
            "expected_ranks": self.expected_ranks,
            "known_rooms": len(self._rooms),
        }

    # ---- the HTTP app ----------------------------------------------------

    def _make_app(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware])
        app.router.add_put("/route", self._route_put)
        app.router.add_get("/route", self._route_get, allow_head=False)
        app.router.add_post("/register_dp_rank", self._register_dp_rank)
        app.router.add_post("/query_dp_ranks", self._query_dp_ranks)
        app.router.add_get("/health", self._health)  # HEAD too, as SGLang (load-balancer probes)
        if self._test_routes:  # test-only: off by default, so absent (404) as in SGLang
            app.router.add_get("/_faults", self._faults_get, allow_head=False)
            app.router.add_post("/_faults", self._faults_post)
            app.router.add_get("/_stats", self._stats, allow_head=False)
        return app

    def _refuse_admin(self, request: web.Request) -> None:
        if not admin_client_allowed(request.remote, self._test_routes_from_anywhere):
            raise web.HTTPForbidden(text="test routes answer loopback clients only")

    @web.middleware
    async def _middleware(self, request: web.Request, handler):
        name = _ENDPOINTS.get((request.method, request.path), "other")
        self._count(name)
        if name in _NEVER_FAULTED:
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

    async def _route_get(self, request: web.Request) -> web.Response:
        return self._do_route_get(request.query)

    async def _register_dp_rank(self, request: web.Request) -> web.Response:
        return self._do_register_dp_rank(await _json_object(request))

    async def _query_dp_ranks(self, request: web.Request) -> web.Response:
        return self._do_query_dp_ranks(await _json_object(request))

    async def _faults_get(self, request: web.Request) -> web.Response:
        self._refuse_admin(request)
        return web.json_response(dataclasses.asdict(self._faults))

    async def _faults_post(self, request: web.Request) -> web.Response:
        self._refuse_admin(request)
        data = await _json_object(request)
        allowed = {f.name for f in dataclasses.fields(Faults)} | {"seed"}
        unknown = sorted(set(data) - allowed)
        if unknown:
            raise bad_request(f"unknown fault field(s) {unknown}; allowed: {sorted(allowed)}")
        seed = int_field(data, "seed", default=None)
        changes = {k: v for k, v in data.items() if k != "seed"}
        try:
            faults = self.set_faults(seed=seed, **changes)
        except ValueError as e:
            raise bad_request(str(e)) from None
        return web.json_response(dataclasses.asdict(faults))

    async def _stats(self, request: web.Request) -> web.Response:
        self._refuse_admin(request)
        return web.json_response(self._stats_body())


def admin_client_allowed(peer: str | None, from_anywhere: bool = False) -> bool:
    """Whether a client at address `peer` (aiohttp's request.remote) may use the test routes:
    loopback only, unless the server was told to answer any client. An address that does not
    parse (a Unix socket, none) is refused."""
    if from_anywhere:
        return True
    try:
        return ipaddress.ip_address((peer or "").split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def serve_forever(host: str = "127.0.0.1", port: int = 8998, **options: Any) -> int:
    """Run a BootstrapServer until SIGINT or SIGTERM; options go to BootstrapServer. Returns the
    number of the signal that stopped it."""
    server = BootstrapServer(host, port, **options)  # validate before touching signal handlers
    stop = threading.Event()
    got: list[int] = []
    previous = {}

    def handler(signum, _frame):
        got.append(signum)
        stop.set()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
    try:
        with server:
            # One parseable line, so a parent started with --port 0 can learn the port.
            print(f"bootstrap server listening on {server.url}", flush=True)
            while not stop.wait(0.5):  # a timed wait lets the signal handler run promptly
                pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return got[0]
