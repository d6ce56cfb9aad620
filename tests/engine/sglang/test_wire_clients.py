"""SGLang 0.5.23's real client functions against pdo bootstrap, and pdo's client
(engine/bootstrap/client.py) against SGLang's server (tests/engine/sglang/wire.py describes the setup)."""

from __future__ import annotations

import contextlib
import time
import types
from unittest import mock

import pytest

from engine.bootstrap import client as bootstrap_client
from engine.runs.pd import rank_info as pdo_rank_info

from .wire import (
    TOPOLOGIES,
    Prefill,
    decode_manager,
    pdo_server,
    prefill_manager,
    receiver,
    sender,
    sglang_context,
    sglang_payloads,
    sglang_server,
)


@contextlib.contextmanager
def no_backoff(conn):
    """register_to_bootstrap sleeps 1, 2, 4, 8 s between its 5 attempts; record the sleeps
    instead."""
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
        decode = {
            srv.addr: decode_manager(
                conn,
                attn_tp_size=prefill.attn_tp_size,
                page_size=prefill.page_size,
                kv_cache_dtype=prefill.kv_cache_dtype,
                kv_layout=prefill.kv_layout,
                dsv41_spec_layout=prefill.dsv41_spec_layout,
                is_mla_backend=prefill.enable_kv_cache_sharding,
            )
            for srv in (p, s)
        }
        ranks = prefill.ranks()
        for srv in (p, s):
            register_all(conn, prefill, srv.port, ranks[:-1])
            assert decode[srv.addr].try_ensure_parallel_info(srv.addr) is False  # 503: not yet
            register_all(conn, prefill, srv.port, ranks[-1:])
            assert decode[srv.addr].try_ensure_parallel_info(srv.addr) is True
        assert len(p.server._ranks) == len(ranks)

        info = decode[p.addr].prefill_info_table[p.addr]
        # the whole PrefillServerInfo, mapping included
        assert info == decode[s.addr].prefill_info_table[s.addr]
        assert_parallel_info_is(info, prefill, n_dp)
        assert_lookups_and_rooms(conn, p, prefill, n_dp)


def assert_parallel_info_is(info, prefill: Prefill, n_dp: int) -> None:
    """The PrefillServerInfo SGLang's decode made from pdo's answer holds what the prefill sent."""
    assert (info.attn_tp_size, info.attn_cp_size, info.dp_size, info.pp_size) == (
        prefill.attn_tp_size,
        prefill.attn_cp_size,
        n_dp,
        prefill.pp_size,
    )
    assert (info.page_size, info.kv_cache_dtype, info.kv_layout, info.dsv41_spec_layout) == (
        prefill.page_size,
        prefill.kv_cache_dtype,
        prefill.kv_layout,
        prefill.dsv41_spec_layout,
    )
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


def assert_lookups_and_rooms(conn, pdo, prefill: Prefill, n_dp: int) -> None:
    """SGLang's receiver looks up every rank of the registered prefill on pdo, and SGLang's sender
    and receiver register and query rooms there."""
    rx = receiver(conn, pdo.addr)
    for sd, d, c, t, pp in prefill.ranks():
        dp = d if prefill.system_dp_size == 1 else sd
        assert rx._get_bootstrap_info_from_server(dp, c, t, pp) == {
            "rank_ip": "127.0.0.1",
            "rank_port": prefill.rank_port(sd, d, c, t, pp),
            "pp_rank": pp,
        }
    assert rx._get_bootstrap_info_from_server(n_dp, 0, 0, 0) is None  # 404

    rooms = {1000 + i: i % n_dp for i in range(6)}
    for room, dp_rank in rooms.items():
        sender(conn, pdo.addr, room, dp_rank)._register_prefill_dp_rank()
    assert conn.CommonKVReceiver.query_prefill_dp_ranks(pdo.addr, [*rooms, 5]) == {
        str(room): rank for room, rank in rooms.items()
    }
    assert conn.CommonKVReceiver.query_prefill_dp_ranks(pdo.addr, [5]) == {}
    assert pdo.server.counters["register_dp_rank"] == len(rooms)


def test_sglang_decode_checks_now_run_against_pdo(conn):
    """try_ensure_parallel_info refuses a prefill whose page size, KV dtype, KV layout or DSpark
    layout differs from the decode's; with pdo, as with SGLang's server, each mismatch is raised."""
    prefill = Prefill(
        attn_tp_size=1, attn_dp_size=1, kv_layout="dsv4_c4", dsv41_spec_layout={"n": 4}
    )
    mismatches = {
        "page_size": {"page_size": 32},
        "kv_cache_dtype": {"kv_cache_dtype": "fp8_e5m2"},
        "kv_layout": {"kv_layout": "dsv4_c128"},
        "dsv41_spec_layout": {"dsv41_spec_layout": {"n": 8}},
    }
    base = {
        "attn_tp_size": 1,
        "page_size": 16,
        "kv_cache_dtype": "auto",
        "kv_layout": "dsv4_c4",
        "dsv41_spec_layout": {"n": 4},
    }
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
            rx.kv_mgr = types.SimpleNamespace(
                prefill_info_table=decode.prefill_info_table,
                record_failure=lambda room, why, failures=failures: failures.append((room, why)),
                update_status=lambda room, status: None,
            )
            with sglang_context(
                conn, Prefill(decode_allocation_policy="early")
            ):  # the decode's policy
                rx.init(prefill_dp_rank=0)
            assert rx.conclude_state == conn.KVPoll.Failed and len(failures) == 1
            reasons.append(failures[0])
        assert (
            reasons[0] == reasons[1] and "prefill=prefill_complete, decode=early" in reasons[0][1]
        )


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
        assert (
            infos[0].target_tp_rank,
            infos[0].target_tp_ranks,
            infos[0].required_prefill_response_num,
        ) == (None, [0, 1], 2)


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
    """The duplicate_put difference, seen by SGLang's decode: SGLang's server publishes parallel
    info after a rank registered twice, and the missing rank's lookup then fails the request; pdo's
    keeps the decode waiting until the missing rank registers."""
    prefill = Prefill(attn_dp_size=1)
    with pdo_server() as p, sglang_server(conn) as s:
        for srv in (p, s):
            register_all(conn, prefill, srv.port, [(0, 0, 0, 0, 0), (0, 0, 0, 0, 0)])
        assert decode_manager(conn).try_ensure_parallel_info(s.addr) is True
        assert receiver(conn, s.addr)._get_bootstrap_info_from_server(0, 0, 1, 0) is None  # 404
        assert decode_manager(conn).try_ensure_parallel_info(p.addr) is False  # 503
        register_all(conn, prefill, p.port, [(0, 0, 0, 1, 0)])
        assert decode_manager(conn).try_ensure_parallel_info(p.addr) is True
        assert (
            receiver(conn, p.addr)._get_bootstrap_info_from_server(0, 0, 1, 0)["rank_port"] == 20010
        )


@pytest.mark.parametrize("payloads", ["sglang", "pdo"])
def test_pdo_client_against_sglang_server(conn, payloads):
    """engine/bootstrap/client.py against SGLang's server: the same answers as against pdo's."""
    if payloads == "sglang":
        regs = sglang_payloads(conn, Prefill())
    else:  # what pdo's own prefill ranks send (engine/runs/pd.py)
        regs = [pdo_rank_info(r, 2, 16, 21000 + r) for r in range(2)]
    with pdo_server() as p, sglang_server(conn) as s:
        got = []
        for srv in (p, s):
            assert bootstrap_client.health(srv.url)
            assert bootstrap_client.get_prefill_info(srv.url) is None
            for reg in regs[:-1]:
                bootstrap_client.register_prefill_rank(srv.url, reg)
            assert bootstrap_client.get_prefill_info(srv.url) is None
            assert (
                bootstrap_client.get_prefill_rank_info(srv.url, dp_rank=0, tp_rank=0) is None
            )  # 503
            bootstrap_client.register_prefill_rank(
                srv.addr, regs[-1]
            )  # SGLang's bare host:port works too
            info = bootstrap_client.get_prefill_info(srv.url)
            ranks = [
                bootstrap_client.get_prefill_rank_info(
                    srv.url, dp_rank=r["attn_dp_rank"], tp_rank=r["attn_tp_rank"]
                )
                for r in regs
            ]
            missing = bootstrap_client.get_prefill_rank_info(srv.url, dp_rank=7, tp_rank=0)
            bootstrap_client.register_dp_rank(srv.url, 11, 1)
            bootstrap_client.register_dp_rank(srv.url, 12, 0)
            rooms = bootstrap_client.query_prefill_dp_ranks(srv.url, [11, 12, 13])
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
        with pytest.raises(bootstrap_client.BootstrapError) as e:
            bootstrap_client.register_prefill_rank(
                s.url, {"attn_tp_size": 1}, retries=2, backoff_s=0.001
            )
        assert e.value.status == 500
        with pytest.raises(bootstrap_client.BootstrapQueryError) as e:
            bootstrap_client.query_prefill_dp_ranks(s.url, ["x"], retries=1, backoff_s=0.001)
        assert e.value.status == 500 and e.value.attempts == 2
