"""What the bootstrap server (engine/bootstrap/server.py) knows and how it answers: the prefill topology,
each rank's endpoint and the room -> DP rank table, with the validation of every request body.

The answers are aiohttp responses, and bad input raises aiohttp's HTTP exceptions, so that the HTTP
handlers and the in-process calls give the same status codes and bodies.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from aiohttp import web

# Query parameter sets accepted by GET /route; the first is SGLang's current
# client, the second its older (pre context-parallel) one.
ROUTE_PARAMS = ("prefill_dp_rank", "prefill_cp_rank", "target_tp_rank", "target_pp_rank")
LEGACY_ROUTE_PARAMS = ("engine_rank", "target_dp_group", "target_pp_rank")

# The parallel info body: every field of SGLang 0.5.23's PrefillServerInfo, which its
# server serialises whole (dataclasses.asdict) and its decode rebuilds with
# PrefillServerInfo(**body), so a key it lacks would break the decode and a key missing
# here silently takes its default (skipping, e.g., the kv_layout check or the
# decode_allocation_policy one).  The last six are the decode's own rank mapping, always
# null from the server.  kv_layout and dsv41_spec_layout are left out when null, as SGLang.
INFO_FIELDS = (
    "attn_tp_size",
    "attn_cp_size",
    "dp_size",
    "pp_size",
    "page_size",
    "kv_cache_dtype",
    "follow_bootstrap_room",
    "enable_dsa_cache_layer_split",
    "dsv41_spec_layout",
    "kv_layout",
    "decode_allocation_policy",
    "enable_kv_cache_sharding",
    "prefill_http_port",
)
INFO_DECODE_SIDE = (
    "target_tp_rank",
    "target_tp_ranks",
    "target_cp_ranks",
    "target_pp_ranks",
    "required_dst_info_num",
    "required_prefill_response_num",
)
INFO_OMITTED_WHEN_NULL = ("dsv41_spec_layout", "kv_layout")

# The fields a registration may leave null that a later rank fills in: SGLang takes each from
# the first rank that sends one, not from the first rank.
_FIRST_SENT = ("page_size", "kv_cache_dtype", "kv_layout", "prefill_http_port")


# ---- request validation ----------------------------------------------------------------------


def bad_request(reason: str) -> web.HTTPBadRequest:
    # Reasons may quote client input; keep them one short line.
    reason = " ".join(reason.split())
    return web.HTTPBadRequest(text=reason if len(reason) <= 200 else reason[:197] + "...")


MISSING = object()

# The integer domains of the wire. SGLang's clients send every size, rank and port as a signed
# 64-bit integer at most (its API types are Int64), and a bootstrap room as an unsigned one (its
# router draws u64 rooms, its decode keeps them in a torch.uint64 buffer); a TCP port is 16 bits.
# A value outside its domain is refused (400), never stored: no SGLang process could use it.
INT64_MAX = 2**63 - 1
ROOM_MAX = 2**64 - 1
PORT_MAX = 65535


def int_field(
    data: dict,
    key: str,
    *,
    minimum: int | None = None,
    maximum: int = INT64_MAX,
    default: Any = MISSING,
) -> Any:
    value = data.get(key, MISSING)
    if value is MISSING or (value is None and default is not MISSING):
        if default is MISSING:
            raise bad_request(f"missing field '{key}'")
        return default
    # bool is an int subclass; a JSON true is never a valid rank or size.
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"field '{key}' must be an integer, got {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise bad_request(f"field '{key}' must be >= {minimum}, got {value}")
    if value > maximum:
        raise bad_request(f"field '{key}' must be <= {maximum}, got {value}")
    return value


def str_field(data: dict, key: str) -> str | None:
    value = data.get(key)
    if value is not None and not isinstance(value, str):
        raise bad_request(f"field '{key}' must be a string or null")
    return value


def query_int(query, key: str) -> int:
    raw = query.get(key)
    if raw is None or raw == "":
        raise bad_request(f"missing query parameter '{key}'")
    try:
        return int(raw)
    except ValueError:
        raise bad_request(f"query parameter '{key}' must be an integer, got {raw!r}") from None


@dataclasses.dataclass(frozen=True)
class Registration:
    """One PUT /route body, validated."""

    key: tuple[int, int, int, int]  # (dp group, cp rank, tp rank, pp rank)
    endpoint: dict[str, Any]  # {"rank_ip", "rank_port"}
    sizes: dict[str, Any]  # attn_tp_size, attn_cp_size, dp_size, pp_size, page_size
    first_sent: dict[str, Any]  # the _FIRST_SENT fields, None where not sent
    policy: str
    dsv41_spec_layout: dict | None
    data: dict  # the body, for the fields only the first rank's registration sets


def parse_registration(data: dict) -> Registration:
    """Every field of a PUT /route body checked, in SGLang's field order; 400 on the first bad
    one."""
    role = data.get("role", "Prefill")
    if role != "Prefill":
        raise bad_request(f"only role 'Prefill' registers here, got {role!r}")
    tp_size = int_field(data, "attn_tp_size", minimum=1)
    cp_size = int_field(data, "attn_cp_size", minimum=1, default=1)  # absent before SGLang had CP
    attn_dp_size = int_field(data, "attn_dp_size", minimum=1)
    pp_size = int_field(data, "pp_size", minimum=1)
    sys_dp_size = int_field(data, "system_dp_size", minimum=1)
    tp_rank = int_field(data, "attn_tp_rank", minimum=0)
    cp_rank = int_field(data, "attn_cp_rank", minimum=0, default=0)
    attn_dp_rank = int_field(data, "attn_dp_rank", minimum=0)
    pp_rank = int_field(data, "pp_rank", minimum=0)
    sys_dp_rank = int_field(data, "system_dp_rank", minimum=0)
    rank_port = int_field(data, "rank_port", minimum=1, maximum=PORT_MAX)
    page_size = int_field(data, "page_size", minimum=1, default=None)
    prefill_http_port = int_field(
        data, "prefill_http_port", minimum=1, maximum=PORT_MAX, default=None
    )
    rank_ip = data.get("rank_ip")
    if not isinstance(rank_ip, str) or not rank_ip:
        raise bad_request("field 'rank_ip' must be a non-empty string")
    kv_cache_dtype = str_field(data, "kv_cache_dtype")
    kv_layout = str_field(data, "kv_layout")
    policy = str_field(data, "decode_allocation_policy")
    if policy is None:  # absent from older clients, whose only policy was "early"
        policy = "early"
    dsv41_spec_layout = data.get("dsv41_spec_layout")
    if dsv41_spec_layout is not None and not isinstance(dsv41_spec_layout, dict):
        raise bad_request("field 'dsv41_spec_layout' must be an object or null")
    for rank, size, what in (
        (tp_rank, tp_size, "attn_tp"),
        (cp_rank, cp_size, "attn_cp"),
        (attn_dp_rank, attn_dp_size, "attn_dp"),
        (pp_rank, pp_size, "pp"),
        (sys_dp_rank, sys_dp_size, "system_dp"),
    ):
        if rank >= size:
            raise bad_request(f"{what}_rank {rank} out of range for {what}_size {size}")
    # As in SGLang: with one system DP rank, DP attention ranks are the DP groups.
    single = sys_dp_size == 1
    dp_size, dp_group = (attn_dp_size, attn_dp_rank) if single else (sys_dp_size, sys_dp_rank)
    return Registration(
        key=(dp_group, cp_rank, tp_rank, pp_rank),
        endpoint={"rank_ip": rank_ip, "rank_port": rank_port},
        sizes={
            "attn_tp_size": tp_size,
            "attn_cp_size": cp_size,
            "dp_size": dp_size,
            "pp_size": pp_size,
            "page_size": page_size,
        },
        first_sent={
            "page_size": page_size,
            "kv_cache_dtype": kv_cache_dtype,
            "kv_layout": kv_layout,
            "prefill_http_port": prefill_http_port,
        },
        policy=policy,
        dsv41_spec_layout=dsv41_spec_layout,
        data=data,
    )


def check_consistent(topology: dict[str, Any], reg: Registration) -> None:
    """Refuse a rank whose registration contradicts the topology the earlier ranks registered."""
    # Both refused with a 400 by SGLang too: a decode pairs with all prefill ranks
    # under one policy and one DSpark layout.
    if reg.dsv41_spec_layout != topology["dsv41_spec_layout"]:
        raise bad_request(
            "dsv41_spec_layout differs from the one registered by earlier prefill ranks"
        )
    if reg.policy != topology["decode_allocation_policy"]:
        raise bad_request(
            f"decode_allocation_policy={reg.policy!r} conflicts with registered "
            f"{topology['decode_allocation_policy']!r}"
        )
    # SGLang silently keeps the first rank's sizes; a mismatch means a misconfigured
    # deployment, which is better refused than served as a wrong topology.
    for key, value in reg.sizes.items():
        known = topology[key]
        if value is not None and known is not None and value != known:
            raise web.HTTPConflict(text=f"{key}={value} conflicts with registered {key}={known}")


def first_topology(reg: Registration) -> dict[str, Any]:
    """The topology the first registered rank sets up."""
    data = reg.data
    return {
        **reg.sizes,
        "follow_bootstrap_room": data.get("load_balance_method", "follow_bootstrap_room")
        == "follow_bootstrap_room",
        "enable_dsa_cache_layer_split": bool(data.get("enable_dsa_cache_layer_split", False)),
        "enable_kv_cache_sharding": bool(data.get("enable_kv_cache_sharding", False)),
        "dsv41_spec_layout": reg.dsv41_spec_layout,
        "decode_allocation_policy": reg.policy,
        "kv_cache_dtype": None,
        "kv_layout": None,
        "prefill_http_port": None,
    }


# ---- the state ------------------------------------------------------------------------------


class BootstrapState:
    """The tables of one bootstrap server and the answers of its endpoints. Not thread-safe: the
    server calls it from its event loop only, or under its lock for in-process calls."""

    def __init__(self, expected_ranks: int | None = None, room_ttl_s: float | None = 120.0):
        if expected_ranks is not None and (isinstance(expected_ranks, bool) or expected_ranks < 1):
            raise ValueError(
                f"expected_ranks must be a positive int or None, got {expected_ranks!r}"
            )
        if room_ttl_s is not None and not room_ttl_s > 0:
            raise ValueError(f"room_ttl_s must be > 0 or None, got {room_ttl_s!r}")
        self._expected_ranks = expected_ranks
        # As SGLang (SGLANG_DISAGGREGATION_BOOTSTRAP_ENTRY_CLEANUP_INTERVAL, 120 s), forget
        # room -> dp_rank entries after a while so the table stays bounded; None keeps them.
        self._room_ttl_s = room_ttl_s
        self._clock = time.monotonic
        self._last_prune = self._clock()

        self._topology: dict[str, Any] | None = None  # from the first registered rank
        # (dp, cp, tp, pp) -> endpoint
        self._ranks: dict[tuple[int, int, int, int], dict[str, Any]] = {}
        self._rooms: dict[int, tuple[int, float]] = {}  # room -> (dp_rank, registered at)

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
            text=f"prefill server not fully registered yet "
            f"({len(self._ranks)}/{expected or '?'} ranks)"
        )

    def _do_route_put(self, data: dict) -> web.Response:
        reg = parse_registration(data)
        topology = self._topology
        if topology is not None:
            check_consistent(topology, reg)
        else:
            topology = self._topology = first_topology(reg)
        for key in _FIRST_SENT:
            if topology[key] is None:
                topology[key] = reg.first_sent[key]
        # Re-registration replaces the endpoint and is not counted twice (SGLang counts PUTs).
        self._ranks[reg.key] = reg.endpoint
        return web.Response(text="OK")

    def _parallel_info(self) -> dict[str, Any]:
        t = self._topology
        assert t is not None
        info = {k: t[k] for k in INFO_FIELDS if not (k in INFO_OMITTED_WHEN_NULL and t[k] is None)}
        info.update(dict.fromkeys(INFO_DECODE_SIDE))
        return info

    def _do_route_get(self, query) -> web.Response:
        # The current client never sends engine_rank; a query with both sets is a current one.
        legacy = "engine_rank" in query and "prefill_dp_rank" not in query
        names = LEGACY_ROUTE_PARAMS if legacy else ROUTE_PARAMS
        values = {n: query_int(query, n) for n in names}
        if all(v == -1 for v in values.values()):
            if not self.is_ready:
                raise self._not_ready()
            info = self._parallel_info()
            if legacy:  # the older client reads these keys instead
                info.update(
                    prefill_attn_tp_size=info["attn_tp_size"],
                    prefill_dp_size=info["dp_size"],
                    prefill_pp_size=info["pp_size"],
                )
            return web.json_response(info)
        if legacy:
            key = (values["target_dp_group"], 0, values["engine_rank"], values["target_pp_rank"])
        else:
            key = tuple(values[n] for n in ROUTE_PARAMS)
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

    def use_clock(self, clock) -> None:
        """Read the room TTL's clock from `clock` (sync.now for a server in-process under a
        controller: time there is virtual, and the wall clock would make a schedule's verdict
        depend on how fast it ran)."""
        self._clock = clock
        self._last_prune = clock()

    def _do_register_dp_rank(self, data: dict) -> web.Response:
        room = int_field(data, "bootstrap_room", minimum=0, maximum=ROOM_MAX)
        dp_rank = int_field(data, "dp_rank", minimum=0)
        if self._topology is not None and dp_rank >= self._topology["dp_size"]:
            raise bad_request(
                f"dp_rank {dp_rank} out of range for dp_size {self._topology['dp_size']}"
            )
        # Before any rank registered, the ranks the server waits for bound every DP rank
        # (dp_size is one factor of their count); a room registered now with a rank the topology
        # later leaves out is never answered (_do_query_dp_ranks).
        elif self._expected_ranks is not None and dp_rank >= self._expected_ranks:
            raise bad_request(
                f"dp_rank {dp_rank} out of range for the {self._expected_ranks} expected ranks"
            )
        now = self._clock()
        self._prune_rooms(now)
        self._rooms[room] = (dp_rank, now)
        return web.Response(text="OK")

    def _do_query_dp_ranks(self, data: dict) -> web.Response:
        rooms = data.get("bootstrap_rooms", MISSING)
        if rooms is MISSING:
            raise bad_request("missing field 'bootstrap_rooms'")
        if not isinstance(rooms, list):
            raise bad_request(f"field 'bootstrap_rooms' must be a list, got {type(rooms).__name__}")
        for room in rooms:
            if isinstance(room, bool) or not isinstance(room, int):
                raise bad_request(
                    f"field 'bootstrap_rooms' must hold integers, got {type(room).__name__}"
                )
            if not 0 <= room <= ROOM_MAX:
                raise bad_request(f"field 'bootstrap_rooms' holds {room}, not in [0, {ROOM_MAX}]")
        expired_before = -math.inf if self._room_ttl_s is None else self._clock() - self._room_ttl_s
        dp_size = math.inf if self._topology is None else self._topology["dp_size"]
        result = {}
        for room in rooms:
            entry = self._rooms.get(room)
            if entry is not None and entry[1] >= expired_before and entry[0] < dp_size:
                result[str(room)] = entry[0]
        return web.json_response(result)
