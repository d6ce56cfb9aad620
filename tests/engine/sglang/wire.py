"""What the wire tests of pdo bootstrap against SGLang 0.5.23's CommonKVBootstrapServer share.

Both servers run on 127.0.0.1 and get the same requests (test_wire_differential.py): their status
codes and JSON bodies must agree, except where DIFFERENCES below says why pdo answers otherwise.
SGLang's real client functions run against pdo, and pdo's client (engine/bootstrap/client.py)
against SGLang's server (test_wire_clients.py).

The registration payloads are not written here: SGLang's own CommonKVManager.register_to_bootstrap
builds them (its HTTP call captured), so the PUTs carry every field 0.5.23 sends.

SGLang's objects are made with ``Cls.__new__(Cls)`` and given only the attributes the called method
reads, and the runtime-context getters those methods call are patched on the conn module, as
SGLang's own unit tests do. The `conn` fixture (conftest.py) skips every test that needs it unless
SGLang 0.5.23 imports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
import time
import types
from typing import Any
from unittest import mock

import pytest
import requests

from engine.bootstrap.server import BootstrapServer

SGLANG_VERSION = "0.5.23"  # the version whose server and clients these tests pin
TIMEOUT_S = 5.0  # per-request timeout: loopback answers are immediate


# ---- the two servers ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def sglang_server(conn):
    """SGLang's CommonKVBootstrapServer on its own thread and event loop, at a free loopback
    port."""
    for _ in range(3):  # the free port may be taken between the probe and SGLang's bind
        port = free_port()
        server = conn.CommonKVBootstrapServer("127.0.0.1", port)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while server.thread.is_alive() and time.monotonic() < deadline:
            try:
                if requests.get(f"{url}/health", timeout=TIMEOUT_S).status_code == 200:
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
            # reports ("Task was destroyed but it is pending!") when the task is collected;
            # cancelled first, it ends during the runner cleanup that close() lets run.
            for task in list(server._background_tasks):
                server._loop.call_soon_threadsafe(task.cancel)
            server.close()
        return
    pytest.fail("SGLang's bootstrap server did not start on three free ports")


@contextlib.contextmanager
def pdo_server(**options):
    options.setdefault("test_routes", True)  # the admin-endpoint difference is kept on purpose
    with BootstrapServer("127.0.0.1", 0, **options) as s:
        yield types.SimpleNamespace(url=s.url, port=s.port, addr=f"127.0.0.1:{s.port}", server=s)


# ---- SGLang's client objects -------------------------------------------------------------------


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
        return [
            (s, d, c, t, p)
            for s in range(self.system_dp_size)
            for d in range(self.attn_dp_size)
            for c in range(self.attn_cp_size)
            for t in range(self.attn_tp_size)
            for p in range(self.pp_size)
        ]

    def rank_port(self, s, d, c, t, p) -> int:
        return 20000 + 1000 * s + 100 * d + 50 * c + 10 * t + p


@contextlib.contextmanager
def sglang_context(conn, prefill: Prefill):
    """The runtime-context reads of conn's functions (get_parallel/get_serving/get_disagg),
    answered."""
    parallel = types.SimpleNamespace(
        enable_cp_tp_group_sharing=False,
        load_balance_method=prefill.load_balance_method,
        enable_dsa_cache_layer_split=prefill.enable_dsa_cache_layer_split,
        enable_kv_cache_sharding=prefill.enable_kv_cache_sharding,
    )
    serving = types.SimpleNamespace(port=prefill.http_port)
    disagg = types.SimpleNamespace(
        disaggregation_decode_allocation_policy=prefill.decode_allocation_policy
    )
    with (
        mock.patch.object(conn, "get_parallel", lambda: parallel),
        mock.patch.object(conn, "get_serving", lambda: serving),
        mock.patch.object(conn, "get_disagg", lambda: disagg),
    ):
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
    """The PUT /route bodies SGLang's prefill ranks send, one per rank, from
    register_to_bootstrap."""
    sent = []

    def put(url, json, timeout):
        sent.append(json)
        return types.SimpleNamespace(status_code=200, text="OK")

    with (
        sglang_context(conn, prefill),
        mock.patch.object(conn, "requests", types.SimpleNamespace(put=put)),
    ):
        for coords in prefill.ranks():
            prefill_manager(conn, prefill, coords, bootstrap_port=1).register_to_bootstrap()
    return sent


# What 0.5.23's register_to_bootstrap sends; the differential PUTs carry all of it.
REGISTRATION_FIELDS = {
    "attn_tp_size",
    "attn_tp_rank",
    "attn_cp_size",
    "attn_cp_rank",
    "attn_dp_size",
    "attn_dp_rank",
    "pp_size",
    "pp_rank",
    "system_dp_size",
    "system_dp_rank",
    "rank_ip",
    "rank_port",
    "page_size",
    "kv_cache_dtype",
    "kv_layout",
    "dsv41_spec_layout",
    "load_balance_method",
    "enable_dsa_cache_layer_split",
    "enable_kv_cache_sharding",
    "prefill_http_port",
    "decode_allocation_policy",
}


def decode_manager(
    conn,
    *,
    attn_tp_size=2,
    engine_rank=0,
    page_size=16,
    kv_cache_dtype="auto",
    kv_layout=None,
    dsv41_spec_layout=None,
    is_mla_backend=False,
    pp_size=1,
):
    """A CommonKVManager with just what try_ensure_parallel_info (and its rank mapping) reads."""
    mgr = conn.CommonKVManager.__new__(conn.CommonKVManager)
    mgr.prefill_info_table = {}
    mgr.kv_args = types.SimpleNamespace(
        page_size=page_size, engine_rank=engine_rank, state_types=()
    )
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


# ---- the differential harness ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Diff:
    """A deliberate difference: pdo's and SGLang's status for the probing request, and why."""

    pdo: int
    sglang: int
    why: str


# Every place pdo answers a request otherwise than 0.5.23's server. Each entry is exercised below
# (test_same_sequence_same_answers or test_stateful_difference) with its exact two status codes.
DIFFERENCES = {
    "bad_json": Diff(
        400,
        500,
        "a body that is not JSON is the client's error; SGLang's handler raises and aiohttp "
        "answers 500. No SGLang client sends one, and each treats any non-200 alike",
    ),
    "undecodable_body": Diff(
        400,
        500,
        "a body that says Content-Encoding: gzip (or deflate) and does not decode is the client's "
        "error; SGLang's handler lets aiohttp's payload error escape and answers 500",
    ),
    "room_out_of_domain": Diff(
        400,
        200,
        "a bootstrap room outside [0, 2**64) in register_dp_rank or query_dp_ranks: SGLang's "
        "router draws u64 rooms and its decode keeps them in a torch.uint64 buffer, so no SGLang "
        "request has one; SGLang's server stores (or looks up) any Python int",
    ),
    "dp_rank_out_of_domain": Diff(
        400,
        200,
        "a dp_rank above 2**63 - 1 in register_dp_rank before any rank registered (once one has, "
        "out_of_range_dp_rank): SGLang's ranks are int64 at most; SGLang stores any Python int and "
        "its decode would then look up a rank that cannot exist",
    ),
    "port_out_of_range": Diff(
        400,
        200,
        "a prefill_http_port outside [1, 65535] in PUT /route: SGLang stores it and publishes it in "
        "the parallel info, where the decode would use it as a TCP port",
    ),
    "missing_field": Diff(
        400,
        500,
        "a missing required field (KeyError in SGLang's handler) is the client's error, with a "
        "reason",
    ),
    "non_integer_query": Diff(
        400, 500, "GET /route with a non-integer coordinate: int() raises in SGLang's handler"
    ),
    "string_integers": Diff(
        400,
        200,
        "SGLang coerces '7' to 7 with int(); pdo takes JSON integers only (SGLang's clients send "
        "ints)",
    ),
    "older_payload": Diff(
        200,
        500,
        "pdo still registers payloads from before SGLang sent attn_cp_size/attn_cp_rank, page_size "
        "and kv_cache_dtype (defaults 1, 0, unknown, unknown); 0.5.23 needs them (KeyError, or "
        "int(None))",
    ),
    "role": Diff(
        400,
        200,
        "SGLang 0.5.23 reads no 'role'; older clients sent role=Prefill, and pdo refuses a PUT "
        "that says it is not a prefill rank rather than serve it as one",
    ),
    "legacy_route_params": Diff(
        200,
        400,
        "pdo also answers the pre-context-parallel lookup (engine_rank, target_dp_group, "
        "target_pp_rank) of older SGLang decodes; 0.5.23 answers it 'Missing inputs'",
    ),
    "out_of_range_rank": Diff(
        400,
        200,
        "a rank >= its size is a misconfigured prefill: SGLang stores and counts it, so parallel "
        "info is published while an in-range rank is missing and the decode's lookup of that rank "
        "then 404s; pdo refuses it and keeps answering 503 until every in-range rank is there",
    ),
    "duplicate_put": Diff(
        503,
        200,
        "a rank registering twice (a restart, a retry after a lost answer) replaces its endpoint "
        "in pdo; SGLang counts every PUT, so parallel info is published (200) with a rank missing",
    ),
    "topology_conflict": Diff(
        409,
        200,
        "a PUT whose sizes or page_size disagree with the registered ones: SGLang keeps the first "
        "silently (and counts the PUT); pdo refuses it",
    ),
    "out_of_range_dp_rank": Diff(
        400,
        200,
        "POST /register_dp_rank with dp_rank >= dp_size (or a negative room or rank) would send "
        "the decode to a DP rank that does not exist; pdo refuses it, so the room stays unknown "
        "and the decode times it out as with a lost registration",
    ),
    "admin_endpoints": Diff(
        200,
        404,
        "GET/POST /_faults and GET /_stats are pdo's fault injection and counters, for tests and "
        "benchmarks; SGLang has no such routes and no SGLang client asks for them",
    ),
}


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    mimetype: str
    body: Any  # parsed JSON for a 200 JSON answer, else the text

    @classmethod
    def of(cls, resp: requests.Response) -> Answer:
        mimetype = resp.headers.get("Content-Type", "").split(";")[0].strip()
        ok_json = resp.status_code == 200 and mimetype == "application/json"
        return cls(resp.status_code, mimetype, resp.json() if ok_json else resp.text)


class Pair:
    """A pdo server and an SGLang server, sent the same requests."""

    def __init__(self, pdo, sgl):
        self.pdo, self.sgl = pdo, sgl
        self.seen: set[str] = set()  # DIFFERENCES keys met

    def send(
        self, method: str, path: str, *, params=None, json=None, data=None, headers=None
    ) -> tuple[Answer, Answer]:
        kwargs = {"params": params, "timeout": TIMEOUT_S, "headers": headers}
        if data is not None:
            kwargs["data"] = data
        elif json is not None:
            kwargs["json"] = json
        return tuple(
            Answer.of(requests.request(method, f"{s.url}{path}", **kwargs))
            for s in (self.pdo, self.sgl)
        )

    def same(self, method: str, path: str, **kwargs) -> Answer:
        """The two answers agree: status always; media type and body on success (error reasons are
        plain text, worded differently, and SGLang's clients only log them)."""
        p, s = self.send(method, path, **kwargs)
        what = f"{method} {path} {kwargs}"
        assert p.status == s.status, (
            f"{what}: pdo {p.status} {p.body!r}, SGLang {s.status} {s.body!r}"
        )
        if p.status == 200:
            assert (p.mimetype, p.body) == (s.mimetype, s.body), what
        return p

    def differs(self, key: str, method: str, path: str, **kwargs) -> tuple[Answer, Answer]:
        """The two answers differ exactly as DIFFERENCES[key] documents."""
        d = DIFFERENCES[key]
        p, s = self.send(method, path, **kwargs)
        assert (p.status, s.status) == (d.pdo, d.sglang), (
            f"{key}: {method} {path} {kwargs}: "
            f"pdo {p.status} {p.body!r}, SGLang {s.status} {s.body!r}"
        )
        self.seen.add(key)
        return p, s


def info_params(dp=-1, cp=-1, tp=-1, pp=-1) -> dict:
    return {
        "prefill_dp_rank": dp,
        "prefill_cp_rank": cp,
        "target_tp_rank": tp,
        "target_pp_rank": pp,
    }


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
        attn_tp_size=1,
        attn_cp_size=2,
        attn_dp_size=1,
        system_dp_size=2,
        pp_size=2,
        page_size=64,
        kv_cache_dtype="fp8_e4m3",
        kv_layout="dsv4_c4",
        dsv41_spec_layout={"num_draft_tokens": 4, "x": [1, 2]},
        load_balance_method="follow_bootstrap_room",
        enable_dsa_cache_layer_split=True,
        enable_kv_cache_sharding=True,
        decode_allocation_policy="prefill_complete",
        http_port=31000,
    ),
}
