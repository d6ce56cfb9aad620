"""Bootstrap server and client over real HTTP on 127.0.0.1: routes, registration, queries."""

from __future__ import annotations

import re
import time

import pytest
import requests

from engine.bootstrap import client as bootstrap_client
from engine.bootstrap.client import BootstrapError, BootstrapUnavailable
from engine.bootstrap.server import BootstrapServer
from tests.engine.bootstrap.fixtures import T, info_params, rank


def test_health_and_unknown_routes(server):
    assert requests.get(f"{server.url}/health", timeout=T).status_code == 200
    assert (
        requests.head(f"{server.url}/health", timeout=T).status_code == 200
    )  # load-balancer probes
    assert bootstrap_client.health(server.url)
    assert requests.get(f"{server.url}/nope", timeout=T).status_code == 404
    assert requests.delete(f"{server.url}/route", timeout=T).status_code == 405
    assert server.counters["health"] == 3
    assert server.counters["other"] == 2


@pytest.mark.filterwarnings("error")
def test_start_stop_is_clean_and_port_conflict_is_reported():
    s = BootstrapServer().start()
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", s.url) and s.port > 0
    session = requests.Session()  # a keep-alive connection still open at stop()
    assert session.get(f"{s.url}/health", timeout=T).status_code == 200
    with pytest.raises(OSError):
        BootstrapServer(port=s.port).start()
    t0 = time.monotonic()
    s.stop()
    s.stop()  # idempotent
    session.close()
    assert time.monotonic() - t0 < 3
    with pytest.raises(BootstrapUnavailable):
        bootstrap_client.get_prefill_info(s.url, timeout=0.5)


def test_invalid_constructor_arguments():
    for kwargs in (
        {"failure_rate": 1.5},
        {"failure_status": 404},
        {"latency_s": -1},
        {"latency_scope": "some"},
        {"expected_ranks": 0},
        {"room_ttl_s": 0},
    ):
        with pytest.raises(ValueError):
            BootstrapServer(**kwargs)


# ---- PUT/GET /route ---------------------------------------------------------


def test_parallel_info_is_503_until_every_rank_registered(server):
    url = server.url
    assert bootstrap_client.get_prefill_info(url) is None  # nothing registered
    bootstrap_client.register_prefill_rank(url, rank(tp_rank=0, tp_size=2, dp_size=2))
    bootstrap_client.register_prefill_rank(
        url, rank(tp_rank=0, tp_size=2, dp_size=2)
    )  # re-registering is no progress
    r = requests.get(f"{url}/route", params=info_params(), timeout=T)
    assert r.status_code == 503 and "1/4" in r.text
    # A rank's endpoint is not served before the whole server is either (as SGLang).
    assert bootstrap_client.get_prefill_rank_info(url, dp_rank=0, tp_rank=0) is None
    for dp, tp in ((0, 1), (1, 0), (1, 1)):
        assert bootstrap_client.get_prefill_info(url) is None
        bootstrap_client.register_prefill_rank(
            url, rank(tp_rank=tp, tp_size=2, dp_rank=dp, dp_size=2)
        )
    info = bootstrap_client.get_prefill_info(url)
    # SGLang 0.5.23's PrefillServerInfo, whole; kv_layout and dsv41_spec_layout are left out when null.
    assert info == {
        "attn_tp_size": 2,
        "attn_cp_size": 1,
        "dp_size": 2,
        "pp_size": 1,
        "page_size": 16,
        "kv_cache_dtype": "auto",
        "follow_bootstrap_room": False,
        "enable_dsa_cache_layer_split": False,
        "decode_allocation_policy": "early",
        "enable_kv_cache_sharding": False,
        "prefill_http_port": None,
        "target_tp_rank": None,
        "target_tp_ranks": None,
        "target_cp_ranks": None,
        "target_pp_ranks": None,
        "required_dst_info_num": None,
        "required_prefill_response_num": None,
    }
    assert server.is_ready and server.expected_ranks == 4


def test_expected_ranks_overrides_topology():
    with BootstrapServer(expected_ranks=2) as s:
        bootstrap_client.register_prefill_rank(s.url, rank())
        assert bootstrap_client.get_prefill_info(s.url) is None
        bootstrap_client.register_prefill_rank(
            s.url, rank(rank_port=30000, pp_rank=0, dp_rank=0, tp_rank=0, rank_ip="10.0.0.2")
        )  # same slot: still 1 rank
        assert bootstrap_client.get_prefill_info(s.url) is None


def test_rank_lookup_current_and_legacy_params(ready_server):
    url = ready_server.url
    assert bootstrap_client.get_prefill_rank_info(url, dp_rank=0, tp_rank=1) == {
        "rank_ip": "127.0.0.1",
        "rank_port": 20010,
    }
    r = requests.get(
        f"{url}/route",
        params=info_params(
            prefill_dp_rank=3, prefill_cp_rank=0, target_tp_rank=0, target_pp_rank=0
        ),
        timeout=T,
    )
    assert r.status_code == 404 and "prefill_dp_rank=3" in r.text
    # SGLang's older client: engine_rank / target_dp_group / target_pp_rank.
    legacy = requests.get(
        f"{url}/route",
        params={"engine_rank": 1, "target_dp_group": 0, "target_pp_rank": 0},
        timeout=T,
    )
    assert legacy.status_code == 200 and legacy.json()["rank_port"] == 20010
    info = requests.get(
        f"{url}/route",
        params={"engine_rank": -1, "target_dp_group": -1, "target_pp_rank": -1},
        timeout=T,
    ).json()
    assert (info["prefill_attn_tp_size"], info["prefill_dp_size"], info["prefill_pp_size"]) == (
        2,
        1,
        1,
    )
    assert (
        requests.get(
            f"{url}/route",
            params={"engine_rank": 0, "target_dp_group": 7, "target_pp_rank": 0},
            timeout=T,
        ).status_code
        == 404
    )


@pytest.mark.parametrize(
    "params, reason",
    [
        ({}, "missing query parameter 'prefill_dp_rank'"),
        ({"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1}, "'target_pp_rank'"),
        (info_params(target_tp_rank="x"), "must be an integer"),
        ({"engine_rank": 0, "target_dp_group": 0}, "'target_pp_rank'"),
    ],
)
def test_route_get_bad_params(ready_server, params, reason):
    r = requests.get(f"{ready_server.url}/route", params=params, timeout=T)
    assert r.status_code == 400 and reason in r.text and "\n" not in r.text.strip()


@pytest.mark.parametrize(
    "body, status, reason",
    [
        (b"{not json", 400, "not valid JSON"),
        (b"", 400, "not valid JSON"),
        (b"\xff\xfe\x00garbage", 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'{"attn_tp_size": 1}', 400, "missing field"),
        (rank(attn_tp_size="2"), 400, "'attn_tp_size' must be an integer"),
        (rank(pp_rank=True), 400, "'pp_rank' must be an integer"),
        (rank(attn_tp_size=0), 400, "'attn_tp_size' must be >= 1"),
        (rank(tp_rank=2, tp_size=2), 400, "attn_tp_rank 2 out of range"),
        (rank(role="Decode"), 400, "role"),
        (rank(rank_ip=""), 400, "rank_ip"),
        (rank(rank_port=70000), 400, "rank_port"),
        (rank(page_size=1.5), 400, "page_size"),
        (rank(tp_rank=1, tp_size=4), 409, "attn_tp_size=4 conflicts"),
        (rank(tp_rank=1, tp_size=2, page_size=32), 409, "page_size=32 conflicts"),
        (rank(kv_layout=3), 400, "'kv_layout' must be a string"),
        (rank(dsv41_spec_layout=[1]), 400, "'dsv41_spec_layout' must be an object"),
        # Refused by SGLang too (400): one policy and one DSpark layout across the prefill's ranks.
        (
            rank(tp_rank=1, tp_size=2, decode_allocation_policy="prefill_complete"),
            400,
            "decode_allocation_policy",
        ),
        (rank(tp_rank=1, tp_size=2, dsv41_spec_layout={"n": 4}), 400, "dsv41_spec_layout differs"),
    ],
)
def test_route_put_rejects_bad_input_and_keeps_serving(server, body, status, reason):
    bootstrap_client.register_prefill_rank(server.url, rank(tp_rank=0, tp_size=2))
    kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
    r = requests.put(f"{server.url}/route", timeout=T, **kwargs)
    assert r.status_code == status, r.text
    assert reason in r.text and "\n" not in r.text.strip()
    assert bootstrap_client.health(server.url)
    assert len(server._ranks) == 1  # the bad request registered nothing


def test_route_put_accepts_extra_and_older_fields(server):
    old_style = rank(future_field={"x": 1}, prefill_http_port=30000)
    del (
        old_style["attn_cp_size"],
        old_style["attn_cp_rank"],
        old_style["page_size"],
        old_style["kv_cache_dtype"],
    )
    assert requests.put(f"{server.url}/route", json=old_style, timeout=T).text == "OK"
    info = bootstrap_client.get_prefill_info(server.url)
    assert (
        info["attn_cp_size"] == 1
        and info["page_size"] is None
        and info["prefill_http_port"] == 30000
    )


def test_parallel_info_carries_layouts_policy_and_first_sent_fields(server):
    # As SGLang: page_size, kv_cache_dtype, kv_layout and prefill_http_port come from the first rank
    # that sends one; kv_layout and dsv41_spec_layout are left out of the info while null.
    policy = {"decode_allocation_policy": "prefill_complete", "dsv41_spec_layout": {"n": 4}}
    bootstrap_client.register_prefill_rank(
        server.url, rank(tp_size=2, kv_cache_dtype=None, enable_kv_cache_sharding=True, **policy)
    )
    bootstrap_client.register_prefill_rank(
        server.url, rank(tp_rank=1, tp_size=2, kv_layout="L", prefill_http_port=30000, **policy)
    )
    info = bootstrap_client.get_prefill_info(server.url)
    assert {
        k: info[k]
        for k in (
            "kv_cache_dtype",
            "kv_layout",
            "prefill_http_port",
            "enable_kv_cache_sharding",
            "decode_allocation_policy",
            "dsv41_spec_layout",
        )
    } == {
        "kv_cache_dtype": "auto",
        "kv_layout": "L",
        "prefill_http_port": 30000,
        "enable_kv_cache_sharding": True,
        "decode_allocation_policy": "prefill_complete",
        "dsv41_spec_layout": {"n": 4},
    }


def test_register_prefill_rank_client_does_not_retry_4xx(server):
    with pytest.raises(BootstrapError) as e:
        bootstrap_client.register_prefill_rank(server.url, {"role": "Prefill"}, backoff_s=0.01)
    assert e.value.status == 400 and "missing field" in str(e.value) and server.url in str(e.value)
    assert server.counters["route_put"] == 1


# ---- dp ranks ---------------------------------------------------------------


def test_register_and_query_dp_ranks_known_rooms_only(ready_server):
    url = ready_server.url
    assert bootstrap_client.query_prefill_dp_ranks(url, [1, 2]) == {}
    bootstrap_client.register_dp_rank(url, 2**62 + 5, 0)
    bootstrap_client.register_dp_rank(url, 7, 0)
    got = bootstrap_client.query_prefill_dp_ranks(url, [7, 8, 2**62 + 5])
    assert got == {7: 0, 2**62 + 5: 0} and all(type(k) is int for k in got)
    raw = requests.post(f"{url}/query_dp_ranks", json={"bootstrap_rooms": [7, 9]}, timeout=T)
    assert raw.status_code == 200 and raw.json() == {"7": 0}  # SGLang's wire form: string keys
    assert bootstrap_client.query_prefill_dp_ranks(url, []) == {}  # nothing to ask: no request made
    assert ready_server.counters["query_dp_ranks"] == 3


@pytest.mark.parametrize(
    "path, body, reason",
    [
        ("/register_dp_rank", b"nope", "not valid JSON"),
        ("/register_dp_rank", {"dp_rank": 0}, "missing field 'bootstrap_room'"),
        ("/register_dp_rank", {"bootstrap_room": "1", "dp_rank": 0}, "must be an integer"),
        ("/register_dp_rank", {"bootstrap_room": 1, "dp_rank": -1}, "'dp_rank' must be >= 0"),
        ("/register_dp_rank", {"bootstrap_room": 1, "dp_rank": 1}, "out of range for dp_size 1"),
        ("/query_dp_ranks", b"[", "not valid JSON"),
        ("/query_dp_ranks", {}, "missing field 'bootstrap_rooms'"),
        ("/query_dp_ranks", {"bootstrap_rooms": 5}, "must be a list"),
        ("/query_dp_ranks", {"bootstrap_rooms": [1, "2"]}, "must hold integers"),
        ("/query_dp_ranks", {"bootstrap_rooms": [1.0]}, "must hold integers"),
    ],
)
def test_dp_rank_endpoints_reject_bad_input(ready_server, path, body, reason):
    kwargs = {"json": body} if isinstance(body, dict) else {"data": body}
    r = requests.post(f"{ready_server.url}{path}", timeout=T, **kwargs)
    assert r.status_code == 400 and reason in r.text, r.text
    assert (
        bootstrap_client.query_prefill_dp_ranks(ready_server.url, [1]) == {}
    )  # still serving, nothing stored


def test_register_dp_rank_client_raises_on_rejection(ready_server):
    with pytest.raises(BootstrapError) as e:
        bootstrap_client.register_dp_rank(ready_server.url, 1, 5)
    assert e.value.status == 400 and "/register_dp_rank" in str(e.value)


def test_rooms_expire_after_ttl():
    with BootstrapServer(room_ttl_s=0.2) as s:
        bootstrap_client.register_dp_rank(s.url, 1, 0)
        assert bootstrap_client.query_prefill_dp_ranks(s.url, [1]) == {1: 0}
        time.sleep(0.3)
        assert bootstrap_client.query_prefill_dp_ranks(s.url, [1]) == {}
        bootstrap_client.register_dp_rank(s.url, 2, 0)  # prunes the stale entry
        assert s._rooms.keys() == {2}
