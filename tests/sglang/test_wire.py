"""pdo bootstrap (engine/bootstrap.py) against SGLang 0.5.23's CommonKVBootstrapServer, on the wire.

Both servers run on 127.0.0.1 and get the same requests; their status codes and JSON bodies must
agree, except where DIFFERENCES below says why pdo answers otherwise. Then SGLang's real client
functions run against pdo, and pdo's client (engine/bootstrap_client.py) against SGLang's server.

The registration payloads are not written here: SGLang's own CommonKVManager.register_to_bootstrap
builds them (its HTTP call captured), so the PUTs carry every field 0.5.23 sends.

SGLang's objects are made with ``Cls.__new__(Cls)`` and given only the attributes the called method
reads, and the runtime-context getters those methods call are patched on the conn module, as
SGLang's own unit tests do. Every test here is skipped unless SGLang 0.5.23 imports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import time
import types
import warnings
from typing import Any
from unittest import mock

import pytest
import requests

from engine import bootstrap_client as bc
from engine.bootstrap import BootstrapServer
from engine.pd import rank_info as pdo_rank_info

SGLANG_VERSION = "0.5.23"  # the version whose server and clients this file pins
T = 5.0  # per-request timeout: loopback answers are immediate


# ---- loading SGLang ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def conn():
    """sglang.srt.disaggregation.common.conn, imported once per module (about 10 s)."""
    try:
        from engine.sglang import SGLangUnavailable, load
    except ImportError as e:
        pytest.skip(f"engine/sglang (the SGLang loader) is not importable: {e}")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # SGLang's import-time "only CUDA supports ..." warnings
            ns = load()
    except SGLangUnavailable as e:
        pytest.skip(str(e))
    except ImportError as e:
        pytest.skip(f"SGLang is not importable: {e}")
    if ns.version != SGLANG_VERSION:
        pytest.skip(f"these tests pin SGLang {SGLANG_VERSION}, found {ns.version}")
    # Refused requests are the point of several tests: SGLang's clients log them (logger.error),
    # and aiohttp logs each 500 of SGLang's server with a traceback.
    quiet = [logging.getLogger(n) for n in (ns.conn.__name__, "aiohttp.server", "aiohttp.web")]
    levels = [lg.level for lg in quiet]
    for lg in quiet:
        lg.setLevel(logging.CRITICAL + 1)
    yield ns.conn
    for lg, level in zip(quiet, levels):
        lg.setLevel(level)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def sglang_server(conn):
    """SGLang's CommonKVBootstrapServer on its own thread and event loop, at a free loopback port."""
    for _ in range(3):  # the free port may be taken between the probe and SGLang's bind
        port = free_port()
        server = conn.CommonKVBootstrapServer("127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while server.thread.is_alive() and time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/health", timeout=T).status_code == 200:
                    break
            except requests.ConnectionError:
                time.sleep(0.01)
        else:
            server.thread.join(timeout=2)
            continue
        try:
            yield types.SimpleNamespace(url=url, port=port, addr=f"127.0.0.1:{port}", server=server)
        finally:
            # close() stops the loop with SGLang's room-cleanup task still pending, which asyncio
            # reports ("Task was destroyed but it is pending!") when the task is collected; cancelled
            # first, it ends during the runner cleanup that close() lets run.
            for task in list(server._background_tasks):
                server._loop.call_soon_threadsafe(task.cancel)
            server.close()
        return
    pytest.fail("SGLang's bootstrap server did not start on three free ports")


@contextlib.contextmanager
def pdo_server(**options):
    with BootstrapServer("127.0.0.1", 0, **options) as s:
        yield types.SimpleNamespace(url=s.url, port=s.port, addr=f"127.0.0.1:{s.port}", server=s)


# ---- SGLang's client objects ----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Prefill:
    """One prefill deployment, as the fields of SGLang's ServerArgs that registration reads."""
    attn_tp_size: int = 2
    attn_cp_size: int = 1
    attn_dp_size: int = 2
    system_dp_size: int = 1
    pp_size: int = 1
    page_size: int = 16
    kv_cache_dtype: str = "auto"
    kv_layout: str | None = None
    dsv41_spec_layout: dict | None = None
    load_balance_method: str = "round_robin"
    enable_dsa_cache_layer_split: bool = False
    enable_kv_cache_sharding: bool = False
    decode_allocation_policy: str = "early"
    http_port: int = 30000

    def ranks(self):
        """(system_dp, attn_dp, cp, tp, pp) of every scheduler rank."""
        return [(s, d, c, t, p) for s in range(self.system_dp_size) for d in range(self.attn_dp_size)
                for c in range(self.attn_cp_size) for t in range(self.attn_tp_size) for p in range(self.pp_size)]

    def rank_port(self, s, d, c, t, p) -> int:
        return 20000 + 1000 * s + 100 * d + 50 * c + 10 * t + p


@contextlib.contextmanager
def sglang_context(conn, prefill: Prefill):
    """The runtime-context reads of conn's functions (get_parallel/get_serving/get_disagg), answered."""
    parallel = types.SimpleNamespace(
        enable_cp_tp_group_sharing=False, load_balance_method=prefill.load_balance_method,
        enable_dsa_cache_layer_split=prefill.enable_dsa_cache_layer_split,
        enable_kv_cache_sharding=prefill.enable_kv_cache_sharding)
    serving = types.SimpleNamespace(port=prefill.http_port)
    disagg = types.SimpleNamespace(disaggregation_decode_allocation_policy=prefill.decode_allocation_policy)
    with mock.patch.object(conn, "get_parallel", lambda: parallel), \
            mock.patch.object(conn, "get_serving", lambda: serving), \
            mock.patch.object(conn, "get_disagg", lambda: disagg):
        yield


def prefill_manager(conn, prefill: Prefill, coords, bootstrap_port: int):
    """A CommonKVManager with just what register_to_bootstrap reads."""
    s, d, c, t, p = coords
    mgr = conn.CommonKVManager.__new__(conn.CommonKVManager)
    mgr.dist_init_addr = None
    mgr.bootstrap_host = "127.0.0.1"
    mgr.bootstrap_port = bootstrap_port
    mgr.attn_tp_size, mgr.attn_tp_rank = prefill.attn_tp_size, t
    mgr.attn_cp_size, mgr.attn_cp_rank = prefill.attn_cp_size, c
    mgr.attn_dp_size, mgr.attn_dp_rank = prefill.attn_dp_size, d
    mgr.pp_size, mgr.pp_rank = prefill.pp_size, p
    mgr.system_dp_size, mgr.system_dp_rank = prefill.system_dp_size, s
    mgr.local_ip = "127.0.0.1"
    mgr.rank_port = prefill.rank_port(*coords)
    mgr.kv_args = types.SimpleNamespace(page_size=prefill.page_size)
    mgr.kv_cache_dtype_str = prefill.kv_cache_dtype
    mgr.kv_layout = prefill.kv_layout
    mgr.dsv41_spec_layout = prefill.dsv41_spec_layout
    return mgr


def sglang_payloads(conn, prefill: Prefill) -> list[dict]:
    """The PUT /route bodies SGLang's prefill ranks send, one per rank, from register_to_bootstrap."""
    sent = []

    def put(url, json, timeout):
        sent.append(json)
        return types.SimpleNamespace(status_code=200, text="OK")

    with sglang_context(conn, prefill), mock.patch.object(conn, "requests", types.SimpleNamespace(put=put)):
        for coords in prefill.ranks():
            prefill_manager(conn, prefill, coords, bootstrap_port=1).register_to_bootstrap()
    return sent


# What 0.5.23's register_to_bootstrap sends; the differential PUTs carry all of it.
REGISTRATION_FIELDS = {
    "attn_tp_size", "attn_tp_rank", "attn_cp_size", "attn_cp_rank", "attn_dp_size", "attn_dp_rank",
    "pp_size", "pp_rank", "system_dp_size", "system_dp_rank", "rank_ip", "rank_port", "page_size",
    "kv_cache_dtype", "kv_layout", "dsv41_spec_layout", "load_balance_method",
    "enable_dsa_cache_layer_split", "enable_kv_cache_sharding", "prefill_http_port",
    "decode_allocation_policy"}


def decode_manager(conn, *, attn_tp_size=2, engine_rank=0, page_size=16, kv_cache_dtype="auto",
                   kv_layout=None, dsv41_spec_layout=None, is_mla_backend=False, pp_size=1):
    """A CommonKVManager with just what try_ensure_parallel_info (and its rank mapping) reads."""
    mgr = conn.CommonKVManager.__new__(conn.CommonKVManager)
    mgr.prefill_info_table = {}
    mgr.kv_args = types.SimpleNamespace(page_size=page_size, engine_rank=engine_rank, state_types=())
    mgr.kv_cache_dtype_str = kv_cache_dtype
    mgr.kv_layout = kv_layout
    mgr.dsv41_spec_layout = dsv41_spec_layout
    mgr.attn_tp_size, mgr.attn_cp_size, mgr.attn_cp_rank = attn_tp_size, 1, 0
    mgr.pp_size, mgr.pp_rank = pp_size, 0
    mgr.dcp_size = 1
    mgr.is_mla_backend, mgr.is_hybrid_mla_backend = is_mla_backend, False
    mgr.enable_all_cp_ranks_for_transfer = False
    return mgr


def receiver(conn, addr: str):
    rx = conn.CommonKVReceiver.__new__(conn.CommonKVReceiver)
    rx.bootstrap_addr = addr
    return rx


def sender(conn, addr: str, room: int, dp_rank: int):
    tx = conn.CommonKVSender.__new__(conn.CommonKVSender)
    tx.bootstrap_server_url = addr
    tx.bootstrap_room = room
    tx.kv_mgr = types.SimpleNamespace(attn_dp_rank=dp_rank)
    return tx


# ---- the differential harness ---------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Diff:
    """A deliberate difference: pdo's and SGLang's status for the probing request, and why."""
    pdo: int
    sglang: int
    why: str


# Every place pdo answers a request otherwise than 0.5.23's server. Each entry is exercised below
# (test_same_sequence_same_answers or test_stateful_difference) with its exact two status codes.
DIFFERENCES = {
    "bad_json": Diff(400, 500,
        "a body that is not JSON is the client's error; SGLang's handler raises and aiohttp answers "
        "500. No SGLang client sends one, and each treats any non-200 alike"),
    "missing_field": Diff(400, 500,
        "a missing required field (KeyError in SGLang's handler) is the client's error, with a reason"),
    "non_integer_query": Diff(400, 500,
        "GET /route with a non-integer coordinate: int() raises in SGLang's handler"),
    "string_integers": Diff(400, 200,
        "SGLang coerces '7' to 7 with int(); pdo takes JSON integers only (SGLang's clients send ints)"),
    "older_payload": Diff(200, 500,
        "pdo still registers payloads from before SGLang sent attn_cp_size/attn_cp_rank, page_size and "
        "kv_cache_dtype (defaults 1, 0, unknown, unknown); 0.5.23 needs them (KeyError, or int(None))"),
    "role": Diff(400, 200,
        "SGLang 0.5.23 reads no 'role'; older clients sent role=Prefill, and pdo refuses a PUT that says "
        "it is not a prefill rank rather than serve it as one"),
    "legacy_route_params": Diff(200, 400,
        "pdo also answers the pre-context-parallel lookup (engine_rank, target_dp_group, target_pp_rank) "
        "of older SGLang decodes; 0.5.23 answers it 'Missing inputs'"),
    "out_of_range_rank": Diff(400, 200,
        "a rank >= its size is a misconfigured prefill: SGLang stores and counts it, so parallel info is "
        "published while an in-range rank is missing and the decode's lookup of that rank then 404s; pdo "
        "refuses it and keeps answering 503 until every in-range rank is there"),
    "duplicate_put": Diff(503, 200,
        "a rank registering twice (a restart, a retry after a lost answer) replaces its endpoint in pdo; "
        "SGLang counts every PUT, so parallel info is published (200) with a rank missing"),
    "topology_conflict": Diff(409, 200,
        "a PUT whose sizes or page_size disagree with the registered ones: SGLang keeps the first "
        "silently (and counts the PUT); pdo refuses it"),
    "out_of_range_dp_rank": Diff(400, 200,
        "POST /register_dp_rank with dp_rank >= dp_size (or a negative room or rank) would send the "
        "decode to a DP rank that does not exist; pdo refuses it, so the room stays unknown and the "
        "decode times it out as with a lost registration"),
    "admin_endpoints": Diff(200, 404,
        "GET/POST /_faults and GET /_stats are pdo's fault injection and counters, for tests and "
        "benchmarks; SGLang has no such routes and no SGLang client asks for them"),
}


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    mimetype: str
    body: Any  # parsed JSON for a 200 JSON answer, else the text

    @classmethod
    def of(cls, resp: requests.Response) -> "Answer":
        mimetype = resp.headers.get("Content-Type", "").split(";")[0].strip()
        ok_json = resp.status_code == 200 and mimetype == "application/json"
        return cls(resp.status_code, mimetype, resp.json() if ok_json else resp.text)


class Pair:
    """A pdo server and an SGLang server, sent the same requests."""

    def __init__(self, pdo, sgl):
        self.pdo, self.sgl = pdo, sgl
        self.seen: set[str] = set()  # DIFFERENCES keys met

    def send(self, method: str, path: str, *, params=None, json=None, data=None) -> tuple[Answer, Answer]:
        kwargs = {"params": params, "timeout": T}
        if data is not None:
            kwargs["data"] = data
        elif json is not None:
            kwargs["json"] = json
        return tuple(Answer.of(requests.request(method, f"{s.url}{path}", **kwargs)) for s in (self.pdo, self.sgl))

    def same(self, method: str, path: str, **kwargs) -> Answer:
        """The two answers agree: status always; media type and body on success (error reasons are
        plain text, worded differently, and SGLang's clients only log them)."""
        p, s = self.send(method, path, **kwargs)
        what = f"{method} {path} {kwargs}"
        assert p.status == s.status, f"{what}: pdo {p.status} {p.body!r}, SGLang {s.status} {s.body!r}"
        if p.status == 200:
            assert (p.mimetype, p.body) == (s.mimetype, s.body), what
        return p

    def differs(self, key: str, method: str, path: str, **kwargs) -> tuple[Answer, Answer]:
        """The two answers differ exactly as DIFFERENCES[key] documents."""
        d = DIFFERENCES[key]
        p, s = self.send(method, path, **kwargs)
        assert (p.status, s.status) == (d.pdo, d.sglang), \
            f"{key}: {method} {path} {kwargs}: pdo {p.status} {p.body!r}, SGLang {s.status} {s.body!r}"
        self.seen.add(key)
        return p, s


@pytest.fixture
def pair(conn):
    with pdo_server() as p, sglang_server(conn) as s:
        yield Pair(p, s)


def info_params(dp=-1, cp=-1, tp=-1, pp=-1) -> dict:
    return {"prefill_dp_rank": dp, "prefill_cp_rank": cp, "target_tp_rank": tp, "target_pp_rank": pp}


def lookup(payload: dict) -> dict:
    """GET /route coordinates of a registered rank (its DP group as SGLang computes it)."""
    dp = payload["attn_dp_rank"] if payload["system_dp_size"] == 1 else payload["system_dp_rank"]
    return info_params(dp, payload["attn_cp_rank"], payload["attn_tp_rank"], payload["pp_rank"])


TOPOLOGIES = {
    # DP attention 2 x TP 2, round robin: the decode queries each room's DP rank.
    "dp2_tp2": Prefill(),
    # System DP 2 x CP 2 x PP 2, and every optional field set: a DSpark layout, a KV layout,
    # KV-cache sharding, prefill_complete allocation, follow_bootstrap_room.
    "sysdp2_cp2_pp2_all_fields": Prefill(
        attn_tp_size=1, attn_cp_size=2, attn_dp_size=1, system_dp_size=2, pp_size=2, page_size=64,
        kv_cache_dtype="fp8_e4m3", kv_layout="dsv4_c4", dsv41_spec_layout={"num_draft_tokens": 4, "x": [1, 2]},
        load_balance_method="follow_bootstrap_room", enable_dsa_cache_layer_split=True,
        enable_kv_cache_sharding=True, decode_allocation_policy="prefill_complete", http_port=31000),
}


# ---- 1. one request sequence, both servers --------------------------------------------------------

def test_registration_payload_is_everything_sglang_sends(conn):
    for prefill in TOPOLOGIES.values():
        payloads = sglang_payloads(conn, prefill)
        assert len(payloads) == len(prefill.ranks())
        assert all(set(p) == REGISTRATION_FIELDS for p in payloads)


def test_parallel_info_keys_are_sglangs_prefill_server_info(conn):
    with pdo_server() as p:
        for payload in sglang_payloads(conn, Prefill(attn_tp_size=1, attn_dp_size=1, kv_layout="x",
                                                     dsv41_spec_layout={"a": 1})):
            requests.put(f"{p.url}/route", json=payload, timeout=T)
        info = bc.get_prefill_info(p.url)
    assert set(info) == {f.name for f in dataclasses.fields(conn.PrefillServerInfo)}


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_same_sequence_same_answers(pair, conn, topology):
    prefill = TOPOLOGIES[topology]
    payloads = sglang_payloads(conn, prefill)
    first, rest = payloads[0], payloads[1:]
    room_rank = {7: 0, 2**62 + 5: prefill.attn_dp_size * prefill.system_dp_size - 1, 0: 0}

    # Health, both methods (HEAD is what load balancers probe with).
    assert pair.same("GET", "/health").body == "OK"
    assert pair.same("HEAD", "/health").status == 200
    pair.same("POST", "/health")  # 405

    # Nothing registered: parallel info and rank lookups are 503.
    assert pair.same("GET", "/route", params=info_params()).status == 503
    assert pair.same("GET", "/route", params=lookup(first)).status == 503
    # A room can be registered before the prefill is (the prefill server answers in any order).
    pair.same("POST", "/register_dp_rank", json={"bootstrap_room": 7, "dp_rank": room_rank[7]})

    # One rank registered, the rest missing: still 503.
    assert pair.same("PUT", "/route", json=first).body == "OK"
    assert pair.same("GET", "/route", params=info_params()).status == 503
    assert pair.same("GET", "/route", params=lookup(first)).status == 503

    for payload in rest:
        assert pair.same("PUT", "/route", json=payload).body == "OK"

    # Fully registered: parallel info, and each rank's endpoint.
    info = pair.same("GET", "/route", params=info_params()).body
    assert info["dp_size"] == prefill.attn_dp_size * prefill.system_dp_size
    assert info.get("kv_layout") == prefill.kv_layout  # left out when null, by both
    for payload in payloads:
        assert pair.same("GET", "/route", params=lookup(payload)).body == \
            {"rank_ip": "127.0.0.1", "rank_port": payload["rank_port"]}
    assert pair.same("GET", "/route", params=info_params(dp=5, cp=0, tp=0, pp=0)).status == 404
    assert pair.same("GET", "/route", params=info_params(dp=0, cp=0, tp=9, pp=0)).status == 404
    assert pair.same("GET", "/route", params=info_params(dp=0)).status == 404  # some -1: a lookup
    # A query with both parameter sets is a current one (older keys ignored).
    assert pair.same("GET", "/route", params={**lookup(first), "engine_rank": 9, "target_dp_group": 9}).status == 200
    pair.differs("legacy_route_params", "GET", "/route",
                 params={"engine_rank": first["attn_tp_rank"], "target_dp_group": 0, "target_pp_rank": 0})
    pair.differs("legacy_route_params", "GET", "/route",
                 params={"engine_rank": -1, "target_dp_group": -1, "target_pp_rank": -1})

    # GET /route input errors.
    for params in ({}, {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1},
                   {**info_params(), "target_pp_rank": ""}):
        assert pair.same("GET", "/route", params=params).status == 400
    pair.differs("non_integer_query", "GET", "/route", params=info_params(tp="x"))
    for method in ("HEAD", "POST", "DELETE"):
        assert pair.same(method, "/route").status == 405

    # Rooms: known, unknown, repeated, none, and a 62-bit room.
    for room, rank in room_rank.items():
        assert pair.same("POST", "/register_dp_rank", json={"bootstrap_room": room, "dp_rank": rank}).body == "OK"
    assert pair.same("POST", "/query_dp_ranks", json={"bootstrap_rooms": [7, 8, 2**62 + 5, 0, 7]}).body == \
        {"7": room_rank[7], str(2**62 + 5): room_rank[2**62 + 5], "0": 0}
    assert pair.same("POST", "/query_dp_ranks", json={"bootstrap_rooms": [123456]}).body == {}
    assert pair.same("POST", "/query_dp_ranks", json={"bootstrap_rooms": []}).body == {}
    # A room registered again moves to the new rank.
    pair.same("POST", "/register_dp_rank", json={"bootstrap_room": 0, "dp_rank": room_rank[2**62 + 5]})
    assert pair.same("POST", "/query_dp_ranks", json={"bootstrap_rooms": [0]}).body == {"0": room_rank[2**62 + 5]}

    # Body errors (none of these changes either server's state).
    for path in ("/route", "/register_dp_rank", "/query_dp_ranks"):
        method = "PUT" if path == "/route" else "POST"
        for body in (b"{not json", b"", b"\xff\xfe"):
            pair.differs("bad_json", method, path, data=body)
    pair.differs("missing_field", "PUT", "/route", json={k: v for k, v in first.items() if k != "rank_ip"})
    pair.differs("missing_field", "POST", "/register_dp_rank", json={"dp_rank": 0})
    pair.differs("missing_field", "POST", "/query_dp_ranks", json={"rooms": [7]})
    pair.differs("string_integers", "POST", "/register_dp_rank", json={"bootstrap_room": "99", "dp_rank": 0})
    pair.differs("string_integers", "POST", "/query_dp_ranks", json={"bootstrap_rooms": ["7"]})
    # A policy or DSpark layout other than the registered one: both refuse (400).
    other_policy = "early" if prefill.decode_allocation_policy != "early" else "prefill_complete"
    assert pair.same("PUT", "/route", json={**first, "decode_allocation_policy": other_policy}).status == 400
    assert pair.same("PUT", "/route", json={**first, "dsv41_spec_layout": {"other": 1}}).status == 400

    # Paths SGLang does not have.
    assert pair.same("GET", "/nope").status == 404
    pair.differs("admin_endpoints", "GET", "/_stats")
    pair.differs("admin_endpoints", "GET", "/_faults")

    # Re-registering every rank as it was changes nothing either server answers.
    for payload in payloads:
        pair.same("PUT", "/route", json=payload)
    assert pair.same("GET", "/route", params=info_params()).body == info
    assert pair.seen == IN_SEQUENCE


def stateful_duplicate_put(pair, conn):
    p0, _p1 = sglang_payloads(conn, Prefill(attn_dp_size=1))
    pair.same("PUT", "/route", json=p0)
    pair.same("PUT", "/route", json=p0)
    pair.differs("duplicate_put", "GET", "/route", params=info_params())
    pdo, sgl = pair.send("GET", "/route", params=info_params(0, 0, 1, 0))  # the missing rank
    assert (pdo.status, sgl.status) == (503, 404)


def stateful_out_of_range_rank(pair, conn):
    p0, _p1 = sglang_payloads(conn, Prefill(attn_dp_size=1))
    pair.differs("out_of_range_rank", "PUT", "/route", json={**p0, "attn_tp_rank": 2, "rank_port": 29999})
    pair.same("PUT", "/route", json=p0)
    pdo, sgl = pair.send("GET", "/route", params=info_params())
    assert (pdo.status, sgl.status) == (503, 200)  # SGLang: 2 PUTs counted for 2 ranks


def stateful_topology_conflict(pair, conn):
    p0, p1 = sglang_payloads(conn, Prefill(attn_dp_size=1))
    pair.same("PUT", "/route", json=p0)
    pair.differs("topology_conflict", "PUT", "/route", json={**p1, "attn_tp_size": 4})
    pair.differs("topology_conflict", "PUT", "/route", json={**p1, "page_size": 32})
    pdo, sgl = pair.send("GET", "/route", params=info_params())
    assert (pdo.status, sgl.status) == (503, 200)
    assert sgl.body["attn_tp_size"] == 2 and sgl.body["page_size"] == 16  # the first rank's, kept


def stateful_out_of_range_dp_rank(pair, conn):
    for payload in sglang_payloads(conn, Prefill()):
        pair.same("PUT", "/route", json=payload)
    pair.differs("out_of_range_dp_rank", "POST", "/register_dp_rank", json={"bootstrap_room": 5, "dp_rank": 2})
    pair.differs("out_of_range_dp_rank", "POST", "/register_dp_rank", json={"bootstrap_room": -5, "dp_rank": 0})
    pair.differs("out_of_range_dp_rank", "POST", "/register_dp_rank", json={"bootstrap_room": 6, "dp_rank": -1})
    pdo, sgl = pair.send("POST", "/query_dp_ranks", json={"bootstrap_rooms": [5, -5, 6]})
    assert pdo.body == {} and sgl.body == {"5": 2, "-5": 0, "6": -1}


def stateful_older_payload(pair, conn):
    p0, p1 = sglang_payloads(conn, Prefill(attn_dp_size=1))
    old = {k: v for k, v in p0.items() if k not in ("attn_cp_size", "attn_cp_rank", "page_size", "kv_cache_dtype")}
    pair.differs("older_payload", "PUT", "/route", json=old)
    pair.differs("older_payload", "PUT", "/route", json={**p0, "page_size": None})
    pair.same("PUT", "/route", json=p1)
    # pdo has both ranks, the page size and dtype from the rank that sent them; SGLang one rank.
    pdo, sgl = pair.send("GET", "/route", params=info_params())
    assert (pdo.status, sgl.status) == (200, 503)
    assert (pdo.body["page_size"], pdo.body["kv_cache_dtype"]) == (16, "auto")


def stateful_role(pair, conn):
    (p0,) = sglang_payloads(conn, Prefill(attn_tp_size=1, attn_dp_size=1))
    pair.differs("role", "PUT", "/route", json={**p0, "role": "Decode"})
    pair.same("PUT", "/route", json={**p0, "role": "Prefill"})  # what older clients sent
    pair.same("GET", "/route", params=info_params())


STATEFUL = {"duplicate_put": stateful_duplicate_put, "out_of_range_rank": stateful_out_of_range_rank,
            "topology_conflict": stateful_topology_conflict, "out_of_range_dp_rank": stateful_out_of_range_dp_rank,
            "older_payload": stateful_older_payload, "role": stateful_role}
IN_SEQUENCE = {"bad_json", "missing_field", "non_integer_query", "string_integers", "legacy_route_params",
               "admin_endpoints"}


@pytest.mark.parametrize("key", STATEFUL)
def test_stateful_difference(pair, conn, key):
    """Differences that change one server's state, each on a fresh pair."""
    STATEFUL[key](pair, conn)
    assert pair.seen == {key}


def test_every_difference_is_exercised():
    assert set(STATEFUL) | IN_SEQUENCE == set(DIFFERENCES) and not set(STATEFUL) & IN_SEQUENCE
    assert all(d.pdo != d.sglang and d.why for d in DIFFERENCES.values())


def test_fields_come_from_the_first_rank_that_sends_them(pair, conn):
    """SGLang takes page_size, kv_cache_dtype, kv_layout and prefill_http_port from the first rank that
    sends one (not from the first rank); pdo does the same."""
    p0, p1 = sglang_payloads(conn, Prefill(attn_dp_size=1, kv_layout="L"))
    pair.same("PUT", "/route", json={**p0, "kv_cache_dtype": None, "kv_layout": None, "prefill_http_port": None})
    pair.same("PUT", "/route", json=p1)
    info = pair.same("GET", "/route", params=info_params()).body
    assert (info["kv_cache_dtype"], info["kv_layout"], info["prefill_http_port"]) == ("auto", "L", 30000)


# ---- 2. SGLang's clients against pdo, pdo's client against SGLang ---------------------------------

@contextlib.contextmanager
def no_backoff(conn):
    """register_to_bootstrap sleeps 1, 2, 4, 8 s between its 5 attempts; record the sleeps instead."""
    sleeps = []
    fake_time = types.SimpleNamespace(sleep=sleeps.append, time=time.time, monotonic=time.monotonic)
    with mock.patch.object(conn, "time", fake_time):
        yield sleeps


def register_all(conn, prefill: Prefill, port: int, coords=None) -> None:
    with sglang_context(conn, prefill):
        for c in coords or prefill.ranks():
            prefill_manager(conn, prefill, c, port).register_to_bootstrap()


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_sglang_clients_against_pdo(conn, topology):
    prefill = TOPOLOGIES[topology]
    n_dp = prefill.attn_dp_size * prefill.system_dp_size
    with pdo_server() as p, sglang_server(conn) as s:
        decode = {srv.addr: decode_manager(conn, attn_tp_size=prefill.attn_tp_size, page_size=prefill.page_size,
                                           kv_cache_dtype=prefill.kv_cache_dtype, kv_layout=prefill.kv_layout,
                                           dsv41_spec_layout=prefill.dsv41_spec_layout,
                                           is_mla_backend=prefill.enable_kv_cache_sharding)
                  for srv in (p, s)}
        ranks = prefill.ranks()
        for srv in (p, s):
            register_all(conn, prefill, srv.port, ranks[:-1])
            assert decode[srv.addr].try_ensure_parallel_info(srv.addr) is False  # 503: not yet
            register_all(conn, prefill, srv.port, ranks[-1:])
            assert decode[srv.addr].try_ensure_parallel_info(srv.addr) is True
        assert len(p.server._ranks) == len(ranks)

        info = decode[p.addr].prefill_info_table[p.addr]
        assert info == decode[s.addr].prefill_info_table[s.addr]  # the whole PrefillServerInfo, mapping included
        assert (info.attn_tp_size, info.attn_cp_size, info.dp_size, info.pp_size) == \
            (prefill.attn_tp_size, prefill.attn_cp_size, n_dp, prefill.pp_size)
        assert (info.page_size, info.kv_cache_dtype, info.kv_layout, info.dsv41_spec_layout) == \
            (prefill.page_size, prefill.kv_cache_dtype, prefill.kv_layout, prefill.dsv41_spec_layout)
        assert info.follow_bootstrap_room == (prefill.load_balance_method == "follow_bootstrap_room")
        assert info.enable_dsa_cache_layer_split == prefill.enable_dsa_cache_layer_split
        assert info.enable_kv_cache_sharding == prefill.enable_kv_cache_sharding
        assert info.decode_allocation_policy == prefill.decode_allocation_policy
        assert info.prefill_http_port == prefill.http_port
        # The decode's rank mapping from those fields: TP rank 0 of equal TP sizes; every prefill CP
        # rank when layers are split across them, else CP rank 0; every PP rank for a PP-1 decode.
        assert (info.target_tp_rank, info.target_tp_ranks) == (0, [0])
        assert info.target_cp_ranks == list(range(prefill.attn_cp_size))
        assert info.target_pp_ranks == list(range(prefill.pp_size))

        rx = receiver(conn, p.addr)
        for (sd, d, c, t, pp) in ranks:
            dp = d if prefill.system_dp_size == 1 else sd
            assert rx._get_bootstrap_info_from_server(dp, c, t, pp) == \
                {"rank_ip": "127.0.0.1", "rank_port": prefill.rank_port(sd, d, c, t, pp), "pp_rank": pp}
        assert rx._get_bootstrap_info_from_server(n_dp, 0, 0, 0) is None  # 404

        rooms = {1000 + i: i % n_dp for i in range(6)}
        for room, dp_rank in rooms.items():
            sender(conn, p.addr, room, dp_rank)._register_prefill_dp_rank()
        assert conn.CommonKVReceiver.query_prefill_dp_ranks(p.addr, [*rooms, 5]) == \
            {str(room): rank for room, rank in rooms.items()}
        assert conn.CommonKVReceiver.query_prefill_dp_ranks(p.addr, [5]) == {}
        assert p.server.counters["register_dp_rank"] == len(rooms)


def test_sglang_decode_checks_now_run_against_pdo(conn):
    """try_ensure_parallel_info refuses a prefill whose page size, KV dtype, KV layout or DSpark layout
    differs from the decode's; with pdo, as with SGLang's server, each mismatch is raised."""
    prefill = Prefill(attn_tp_size=1, attn_dp_size=1, kv_layout="dsv4_c4", dsv41_spec_layout={"n": 4})
    mismatches = {"page_size": {"page_size": 32}, "kv_cache_dtype": {"kv_cache_dtype": "fp8_e5m2"},
                  "kv_layout": {"kv_layout": "dsv4_c128"}, "dsv41_spec_layout": {"dsv41_spec_layout": {"n": 8}}}
    base = {"attn_tp_size": 1, "page_size": 16, "kv_cache_dtype": "auto", "kv_layout": "dsv4_c4",
            "dsv41_spec_layout": {"n": 4}}
    with pdo_server() as p, sglang_server(conn) as s:
        for srv in (p, s):
            register_all(conn, prefill, srv.port)
        for field, change in mismatches.items():
            errors = []
            for srv in (p, s):
                with pytest.raises(RuntimeError) as e:
                    decode_manager(conn, **{**base, **change}).try_ensure_parallel_info(srv.addr)
                errors.append(str(e.value))
            assert errors[0] == errors[1] and "mismatch" in errors[0], field
        assert decode_manager(conn, **base).try_ensure_parallel_info(p.addr)


def test_sglang_receiver_reads_the_allocation_policy_from_pdo(conn):
    """CommonKVReceiver.init fails a request whose decode runs another allocation policy than the
    prefill registered; the policy must be in the parallel info for the check to see it."""
    prefill = Prefill(attn_tp_size=1, attn_dp_size=1, decode_allocation_policy="prefill_complete")
    with pdo_server() as p, sglang_server(conn) as s:
        reasons = []
        for srv in (p, s):
            register_all(conn, prefill, srv.port)
            decode = decode_manager(conn, attn_tp_size=1)
            assert decode.try_ensure_parallel_info(srv.addr)
            failures = []
            rx = receiver(conn, srv.addr)
            rx.bootstrap_room, rx.conclude_state = 42, None
            rx.kv_mgr = types.SimpleNamespace(prefill_info_table=decode.prefill_info_table,
                                              record_failure=lambda room, why: failures.append((room, why)),
                                              update_status=lambda room, status: None)
            with sglang_context(conn, Prefill(decode_allocation_policy="early")):  # the decode's policy
                rx.init(prefill_dp_rank=0)
            assert rx.conclude_state == conn.KVPoll.Failed and len(failures) == 1
            reasons.append(failures[0])
        assert reasons[0] == reasons[1] and "prefill=prefill_complete, decode=early" in reasons[0][1]


def test_sglang_decode_maps_sharded_mla_kv_from_pdo(conn):
    """With KV-cache sharding on an MLA model, each decode rank pulls from every prefill TP rank."""
    prefill = Prefill(attn_tp_size=2, attn_dp_size=1, enable_kv_cache_sharding=True)
    with pdo_server() as p, sglang_server(conn) as s:
        infos = []
        for srv in (p, s):
            register_all(conn, prefill, srv.port)
            decode = decode_manager(conn, attn_tp_size=2, engine_rank=1, is_mla_backend=True)
            assert decode.try_ensure_parallel_info(srv.addr)
            infos.append(decode.prefill_info_table[srv.addr])
        assert infos[0] == infos[1]
        assert (infos[0].target_tp_rank, infos[0].target_tp_ranks, infos[0].required_prefill_response_num) == \
            (None, [0, 1], 2)


def test_sglang_clients_ride_out_pdos_refusals(conn):
    """Where pdo answers 4xx and SGLang 5xx (or 200), SGLang's clients behave as for any non-200:
    a lookup returns None, a room query {}, a registration is retried and then given up."""
    with pdo_server() as p, sglang_server(conn) as s:
        for srv in (p, s):
            rx = receiver(conn, srv.addr)
            assert rx._get_bootstrap_info_from_server("x", 0, 0, 0) is None  # 400 / 500
            assert conn.CommonKVReceiver.query_prefill_dp_ranks(srv.addr, ["x"]) == {}  # 400 / 500
        # A rank out of range: pdo refuses it (400), the prefill retries 5 times as for a 500, then
        # gives up; the decode keeps waiting (503) instead of being told the prefill is complete.
        prefill = Prefill(attn_tp_size=1, attn_dp_size=1)
        with no_backoff(conn) as sleeps, sglang_context(conn, prefill):
            prefill_manager(conn, prefill, (0, 0, 0, 1, 0), p.port).register_to_bootstrap()
        assert len(sleeps) == 4 and p.server.counters["route_put"] == 5 and not p.server._ranks
        assert decode_manager(conn, attn_tp_size=1).try_ensure_parallel_info(p.addr) is False
        register_all(conn, prefill, p.port)
        assert decode_manager(conn, attn_tp_size=1).try_ensure_parallel_info(p.addr) is True


def test_sglang_decode_waits_out_a_duplicate_registration_on_pdo(conn):
    """The duplicate_put difference, seen by SGLang's decode: SGLang's server publishes parallel info
    after a rank registered twice, and the missing rank's lookup then fails the request; pdo's keeps the
    decode waiting until the missing rank registers."""
    prefill = Prefill(attn_dp_size=1)
    with pdo_server() as p, sglang_server(conn) as s:
        for srv in (p, s):
            register_all(conn, prefill, srv.port, [(0, 0, 0, 0, 0), (0, 0, 0, 0, 0)])
        assert decode_manager(conn).try_ensure_parallel_info(s.addr) is True
        assert receiver(conn, s.addr)._get_bootstrap_info_from_server(0, 0, 1, 0) is None  # 404
        assert decode_manager(conn).try_ensure_parallel_info(p.addr) is False  # 503
        register_all(conn, prefill, p.port, [(0, 0, 0, 1, 0)])
        assert decode_manager(conn).try_ensure_parallel_info(p.addr) is True
        assert receiver(conn, p.addr)._get_bootstrap_info_from_server(0, 0, 1, 0)["rank_port"] == 20010


@pytest.mark.parametrize("payloads", ["sglang", "pdo"])
def test_pdo_client_against_sglang_server(conn, payloads):
    """engine/bootstrap_client.py against SGLang's server: the same answers as against pdo's."""
    if payloads == "sglang":
        regs = sglang_payloads(conn, Prefill())
    else:  # what pdo's own prefill ranks send (engine/pd.py)
        regs = [pdo_rank_info(r, 2, 16, 21000 + r) for r in range(2)]
    with pdo_server() as p, sglang_server(conn) as s:
        got = []
        for srv in (p, s):
            assert bc.health(srv.url)
            assert bc.get_prefill_info(srv.url) is None
            for reg in regs[:-1]:
                bc.register_prefill_rank(srv.url, reg)
            assert bc.get_prefill_info(srv.url) is None
            assert bc.get_prefill_rank_info(srv.url, dp_rank=0, tp_rank=0) is None  # 503
            bc.register_prefill_rank(srv.addr, regs[-1])  # SGLang's bare host:port works too
            info = bc.get_prefill_info(srv.url)
            ranks = [bc.get_prefill_rank_info(srv.url, dp_rank=r["attn_dp_rank"], tp_rank=r["attn_tp_rank"])
                     for r in regs]
            missing = bc.get_prefill_rank_info(srv.url, dp_rank=7, tp_rank=0)
            bc.register_dp_rank(srv.url, 11, 1)
            bc.register_dp_rank(srv.url, 12, 0)
            rooms = bc.query_prefill_dp_ranks(srv.url, [11, 12, 13])
            got.append((info, ranks, missing, rooms))
        assert got[0] == got[1]
        info, ranks, missing, rooms = got[1]
        assert info["dp_size"] == 2 and info["page_size"] == 16
        assert ranks == [{"rank_ip": "127.0.0.1", "rank_port": r["rank_port"]} for r in regs]
        assert missing is None and rooms == {11: 1, 12: 0}


def test_pdo_client_errors_against_sglang_server(conn):
    """SGLang answers a bad registration with a 500, which pdo's client retries (as a server fault)
    and then raises; a bad room query likewise."""
    with sglang_server(conn) as s:
        with pytest.raises(bc.BootstrapError) as e:
            bc.register_prefill_rank(s.url, {"attn_tp_size": 1}, retries=2, backoff_s=0.001)
        assert e.value.status == 500
        with pytest.raises(bc.BootstrapQueryError) as e:
            bc.query_prefill_dp_ranks(s.url, ["x"], retries=1, backoff_s=0.001)
        assert e.value.status == 500 and e.value.attempts == 2
