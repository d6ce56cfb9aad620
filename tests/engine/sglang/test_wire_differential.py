"""pdo bootstrap (engine/bootstrap/server.py) and SGLang 0.5.23's CommonKVBootstrapServer, sent the same
requests: the same status codes and JSON bodies, except where wire.DIFFERENCES says why pdo answers
otherwise (tests/engine/sglang/wire.py describes the setup)."""

from __future__ import annotations

import dataclasses

import pytest
import requests

from engine.bootstrap import client as bootstrap_client

from .wire import (
    DIFFERENCES,
    REGISTRATION_FIELDS,
    TIMEOUT_S,
    TOPOLOGIES,
    Prefill,
    info_params,
    lookup,
    pdo_server,
    sglang_payloads,
)

# ---- one request sequence, both servers ---------------------------------------------------------


def test_registration_payload_is_everything_sglang_sends(conn):
    for prefill in TOPOLOGIES.values():
        payloads = sglang_payloads(conn, prefill)
        assert len(payloads) == len(prefill.ranks())
        assert all(set(p) == REGISTRATION_FIELDS for p in payloads)


def test_parallel_info_keys_are_sglangs_prefill_server_info(conn):
    with pdo_server() as p:
        for payload in sglang_payloads(
            conn, Prefill(attn_tp_size=1, attn_dp_size=1, kv_layout="x", dsv41_spec_layout={"a": 1})
        ):
            requests.put(f"{p.url}/route", json=payload, timeout=TIMEOUT_S)
        info = bootstrap_client.get_prefill_info(p.url)
    assert set(info) == {f.name for f in dataclasses.fields(conn.PrefillServerInfo)}


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_same_sequence_same_answers(pair, conn, topology):
    """One stateful request sequence: each step's answers agree, or differ as documented."""
    prefill = TOPOLOGIES[topology]
    payloads = sglang_payloads(conn, prefill)
    room_rank = {7: 0, 2**62 + 5: prefill.attn_dp_size * prefill.system_dp_size - 1, 0: 0}
    sequence_health(pair)
    sequence_registration(pair, payloads, room_rank)
    info = sequence_registered(pair, prefill, payloads)
    sequence_route_input_errors(pair)
    sequence_rooms(pair, room_rank)
    sequence_body_errors(pair, prefill, payloads[0])
    sequence_unknown_paths(pair)
    # Re-registering every rank as it was changes nothing either server answers.
    for payload in payloads:
        pair.same("PUT", "/route", json=payload)
    assert pair.same("GET", "/route", params=info_params()).body == info
    assert pair.seen == IN_SEQUENCE


def sequence_health(pair) -> None:
    """Health, both methods (HEAD is what load balancers probe with)."""
    assert pair.same("GET", "/health").body == "OK"
    assert pair.same("HEAD", "/health").status == 200
    pair.same("POST", "/health")  # 405


def sequence_registration(pair, payloads: list[dict], room_rank: dict) -> None:
    """Nothing registered, then one rank, then the rest: 503 until every rank is there."""
    first, rest = payloads[0], payloads[1:]
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


def sequence_registered(pair, prefill: Prefill, payloads: list[dict]) -> dict:
    """Fully registered: parallel info, and each rank's endpoint. Returns the parallel info."""
    first = payloads[0]
    info = pair.same("GET", "/route", params=info_params()).body
    assert info["dp_size"] == prefill.attn_dp_size * prefill.system_dp_size
    assert info.get("kv_layout") == prefill.kv_layout  # left out when null, by both
    for payload in payloads:
        assert pair.same("GET", "/route", params=lookup(payload)).body == {
            "rank_ip": "127.0.0.1",
            "rank_port": payload["rank_port"],
        }
    assert pair.same("GET", "/route", params=info_params(dp=5, cp=0, tp=0, pp=0)).status == 404
    assert pair.same("GET", "/route", params=info_params(dp=0, cp=0, tp=9, pp=0)).status == 404
    assert pair.same("GET", "/route", params=info_params(dp=0)).status == 404  # some -1: a lookup
    # A query with both parameter sets is a current one (older keys ignored).
    both = {**lookup(first), "engine_rank": 9, "target_dp_group": 9}
    assert pair.same("GET", "/route", params=both).status == 200
    pair.differs(
        "legacy_route_params",
        "GET",
        "/route",
        params={"engine_rank": first["attn_tp_rank"], "target_dp_group": 0, "target_pp_rank": 0},
    )
    pair.differs(
        "legacy_route_params",
        "GET",
        "/route",
        params={"engine_rank": -1, "target_dp_group": -1, "target_pp_rank": -1},
    )
    return info


def sequence_route_input_errors(pair) -> None:
    """GET /route input errors, and the methods /route does not take."""
    for params in (
        {},
        {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1},
        {**info_params(), "target_pp_rank": ""},
    ):
        assert pair.same("GET", "/route", params=params).status == 400
    pair.differs("non_integer_query", "GET", "/route", params=info_params(tp="x"))
    for method in ("HEAD", "POST", "DELETE"):
        assert pair.same(method, "/route").status == 405


def sequence_rooms(pair, room_rank: dict) -> None:
    """Rooms: known, unknown, repeated, none, and a 62-bit room; a room registered again moves."""
    big = 2**62 + 5
    for room, rank in room_rank.items():
        registered = pair.same(
            "POST", "/register_dp_rank", json={"bootstrap_room": room, "dp_rank": rank}
        )
        assert registered.body == "OK"
    assert pair.same(
        "POST", "/query_dp_ranks", json={"bootstrap_rooms": [7, 8, big, 0, 7]}
    ).body == {"7": room_rank[7], str(big): room_rank[big], "0": 0}
    assert pair.same("POST", "/query_dp_ranks", json={"bootstrap_rooms": [123456]}).body == {}
    assert pair.same("POST", "/query_dp_ranks", json={"bootstrap_rooms": []}).body == {}
    pair.same("POST", "/register_dp_rank", json={"bootstrap_room": 0, "dp_rank": room_rank[big]})
    assert pair.same("POST", "/query_dp_ranks", json={"bootstrap_rooms": [0]}).body == {
        "0": room_rank[big]
    }


def sequence_body_errors(pair, prefill: Prefill, first: dict) -> None:
    """Body errors: none of these changes either server's state."""
    for path in ("/route", "/register_dp_rank", "/query_dp_ranks"):
        method = "PUT" if path == "/route" else "POST"
        for body in (b"{not json", b"", b"\xff\xfe"):
            pair.differs("bad_json", method, path, data=body)
        for encoding in ("gzip", "deflate"):
            pair.differs(
                "undecodable_body",
                method,
                path,
                data=b"not compressed",
                headers={"Content-Encoding": encoding},
            )
    without_ip = {k: v for k, v in first.items() if k != "rank_ip"}
    pair.differs("missing_field", "PUT", "/route", json=without_ip)
    pair.differs("missing_field", "POST", "/register_dp_rank", json={"dp_rank": 0})
    pair.differs("missing_field", "POST", "/query_dp_ranks", json={"rooms": [7]})
    pair.differs(
        "string_integers", "POST", "/register_dp_rank", json={"bootstrap_room": "99", "dp_rank": 0}
    )
    pair.differs("string_integers", "POST", "/query_dp_ranks", json={"bootstrap_rooms": ["7"]})
    # A policy or DSpark layout other than the registered one: both refuse (400).
    other_policy = "early" if prefill.decode_allocation_policy != "early" else "prefill_complete"
    assert (
        pair.same("PUT", "/route", json={**first, "decode_allocation_policy": other_policy}).status
        == 400
    )
    assert (
        pair.same("PUT", "/route", json={**first, "dsv41_spec_layout": {"other": 1}}).status == 400
    )


def sequence_unknown_paths(pair) -> None:
    """Paths SGLang does not have."""
    assert pair.same("GET", "/nope").status == 404
    pair.differs("admin_endpoints", "GET", "/_stats")
    pair.differs("admin_endpoints", "GET", "/_faults")


def stateful_duplicate_put(pair, conn):
    p0, _p1 = sglang_payloads(conn, Prefill(attn_dp_size=1))
    pair.same("PUT", "/route", json=p0)
    pair.same("PUT", "/route", json=p0)
    pair.differs("duplicate_put", "GET", "/route", params=info_params())
    pdo, sgl = pair.send("GET", "/route", params=info_params(0, 0, 1, 0))  # the missing rank
    assert (pdo.status, sgl.status) == (503, 404)


def stateful_out_of_range_rank(pair, conn):
    p0, _p1 = sglang_payloads(conn, Prefill(attn_dp_size=1))
    pair.differs(
        "out_of_range_rank", "PUT", "/route", json={**p0, "attn_tp_rank": 2, "rank_port": 29999}
    )
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
    pair.differs(
        "out_of_range_dp_rank",
        "POST",
        "/register_dp_rank",
        json={"bootstrap_room": 5, "dp_rank": 2},
    )
    pair.differs(
        "out_of_range_dp_rank",
        "POST",
        "/register_dp_rank",
        json={"bootstrap_room": -5, "dp_rank": 0},
    )
    pair.differs(
        "out_of_range_dp_rank",
        "POST",
        "/register_dp_rank",
        json={"bootstrap_room": 6, "dp_rank": -1},
    )
    pdo, sgl = pair.send("POST", "/query_dp_ranks", json={"bootstrap_rooms": [5, 6]})
    assert pdo.body == {} and sgl.body == {"5": 2, "6": -1}


def stateful_room_out_of_domain(pair, conn):
    for room in (2**64, 2**70, -5):
        pair.differs(
            "room_out_of_domain",
            "POST",
            "/register_dp_rank",
            json={"bootstrap_room": room, "dp_rank": 0},
        )
        pair.differs(
            "room_out_of_domain", "POST", "/query_dp_ranks", json={"bootstrap_rooms": [room]}
        )
    pair.same(
        "POST", "/register_dp_rank", json={"bootstrap_room": 2**64 - 1, "dp_rank": 0}
    )  # the largest room: both keep it
    assert pair.same("POST", "/query_dp_ranks", json={"bootstrap_rooms": [2**64 - 1]}).body == {
        str(2**64 - 1): 0
    }


def stateful_dp_rank_out_of_domain(pair, conn):
    pair.differs(
        "dp_rank_out_of_domain",
        "POST",
        "/register_dp_rank",
        json={"bootstrap_room": 3, "dp_rank": 2**70},
    )
    pdo, sgl = pair.send("POST", "/query_dp_ranks", json={"bootstrap_rooms": [3]})
    assert pdo.body == {} and sgl.body == {"3": 2**70}


def stateful_port_out_of_range(pair, conn):
    p0, p1 = sglang_payloads(conn, Prefill(attn_dp_size=1))
    pair.differs("port_out_of_range", "PUT", "/route", json={**p0, "prefill_http_port": 65536})
    pair.same("PUT", "/route", json=p0)
    pair.same("PUT", "/route", json=p1)
    pdo, sgl = pair.send("GET", "/route", params=info_params())
    assert (pdo.status, sgl.status) == (200, 200)
    assert (pdo.body["prefill_http_port"], sgl.body["prefill_http_port"]) == (30000, 65536)


def stateful_older_payload(pair, conn):
    p0, p1 = sglang_payloads(conn, Prefill(attn_dp_size=1))
    old = {
        k: v
        for k, v in p0.items()
        if k not in ("attn_cp_size", "attn_cp_rank", "page_size", "kv_cache_dtype")
    }
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


STATEFUL = {
    "duplicate_put": stateful_duplicate_put,
    "out_of_range_rank": stateful_out_of_range_rank,
    "topology_conflict": stateful_topology_conflict,
    "out_of_range_dp_rank": stateful_out_of_range_dp_rank,
    "room_out_of_domain": stateful_room_out_of_domain,
    "dp_rank_out_of_domain": stateful_dp_rank_out_of_domain,
    "port_out_of_range": stateful_port_out_of_range,
    "older_payload": stateful_older_payload,
    "role": stateful_role,
}
IN_SEQUENCE = {
    "bad_json",
    "undecodable_body",
    "missing_field",
    "non_integer_query",
    "string_integers",
    "legacy_route_params",
    "admin_endpoints",
}


@pytest.mark.parametrize("key", STATEFUL)
def test_stateful_difference(pair, conn, key):
    """Differences that change one server's state, each on a fresh pair."""
    STATEFUL[key](pair, conn)
    assert pair.seen == {key}


def test_every_difference_is_exercised():
    assert set(STATEFUL) | IN_SEQUENCE == set(DIFFERENCES) and not set(STATEFUL) & IN_SEQUENCE
    assert all(d.pdo != d.sglang and d.why for d in DIFFERENCES.values())


def test_fields_come_from_the_first_rank_that_sends_them(pair, conn):
    """SGLang takes page_size, kv_cache_dtype, kv_layout and prefill_http_port from the first rank
    that sends one (not from the first rank); pdo does the same."""
    p0, p1 = sglang_payloads(conn, Prefill(attn_dp_size=1, kv_layout="L"))
    pair.same(
        "PUT",
        "/route",
        json={**p0, "kv_cache_dtype": None, "kv_layout": None, "prefill_http_port": None},
    )
    pair.same("PUT", "/route", json=p1)
    info = pair.same("GET", "/route", params=info_params()).body
    assert (info["kv_cache_dtype"], info["kv_layout"], info["prefill_http_port"]) == (
        "auto",
        "L",
        30000,
    )
