"""Client side of the bootstrap server (engine/bootstrap/server.py, or SGLang's own).

Used by prefill ranks (register_prefill_rank, register_dp_rank) and by the
decode scheduler (get_prefill_info, get_prefill_rank_info, query_prefill_dp_ranks).

Every call goes through one ``requests.Session`` per thread: sessions keep
connections alive but are not safe to share across threads.  A URL
``inproc://<name>`` reaches a server started with ``BootstrapServer.start_inproc``
in this process instead (same handlers, no socket; used by controlled schedule
fuzzing, docs/fuzzing.md).  Retry backoff sleeps through ``engine.sync``
(virtual time under a schedule controller).

Failures are typed and their message is one line naming the URL:
  BootstrapError        the server answered, but not with success (``status`` set)
  BootstrapUnavailable  no answer: connection refused, reset or timed out
  BootstrapQueryError   query_prefill_dp_ranks gave up (after retries, or at once on a 4xx)
"""

from __future__ import annotations

import re
import threading
from typing import Any

import requests

from engine import sync
from spec.errors import RunFailed

DEFAULT_TIMEOUT_S = 5.0  # SGLang uses 5 s on every bootstrap request

_local = threading.local()


class BootstrapError(RunFailed):
    def __init__(self, url: str, message: str, *, status: int | None = None):
        super().__init__(f"{url}: {message}")
        self.url = url
        self.reason = message
        self.status = status


class BootstrapUnavailable(BootstrapError):
    pass


class BootstrapQueryError(BootstrapError):
    def __init__(
        self,
        url: str,
        message: str,
        *,
        status: int | None = None,
        attempts: int = 1,
        unavailable: bool = False,
    ):
        super().__init__(url, message, status=status)
        self.attempts = attempts
        self.unavailable = unavailable  # last failure was "no answer" rather than an error status


def session() -> requests.Session:
    s = getattr(_local, "session", None)
    if s is None:
        s = _local.session = requests.Session()
    return s


def base_url(url: str) -> str:
    """Accept both 'http://host:port' and SGLang's bare 'host:port' bootstrap_addr."""
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


def _one_line(text: str, limit: int = 200) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _request(method: str, url: str, timeout: float, **kwargs: Any) -> requests.Response:
    if url.startswith("inproc://"):
        return _inproc_request(method, url, timeout, **kwargs)
    try:
        return session().request(method, url, timeout=timeout, **kwargs)
    except requests.Timeout as e:
        raise BootstrapUnavailable(
            url, f"{method} got no answer within {timeout} s ({type(e).__name__})"
        ) from e
    except requests.ConnectionError as e:
        # requests buries the OS error ("[Errno 111] Connection refused") in a long wrapper message.
        errno = re.search(r"\[Errno -?\d+\][^'\")\]]*", str(e))
        detail = errno.group(0).strip() if errno else type(e).__name__
        raise BootstrapUnavailable(url, f"{method} failed: {detail}") from e
    except requests.RequestException as e:
        raise BootstrapError(
            url, f"{method} failed: {type(e).__name__}: {_one_line(str(e))}"
        ) from e


def _inproc_request(
    method: str, url: str, timeout: float, *, json: Any = None, params: dict | None = None
):
    """An in-process bootstrap server (BootstrapServer.start_inproc): the same handlers, no socket."""
    from engine.bootstrap.server import inproc_server  # lazy: start-up time (aiohttp)

    rest = url[len("inproc://") :]
    name, _, path = rest.partition("/")
    server = inproc_server(name)
    if server is None:
        raise BootstrapUnavailable(
            url, f"{method} failed: no in-process bootstrap server named {name!r}"
        )
    try:
        return server.handle_inproc(
            method, "/" + path, params=params, payload=json, timeout=timeout
        )
    except TimeoutError as e:
        raise BootstrapUnavailable(
            url, f"{method} got no answer within {timeout} s (ReadTimeout)"
        ) from e


def _check(resp: requests.Response, method: str, url: str) -> requests.Response:
    if resp.status_code != 200:
        raise BootstrapError(
            url,
            f"{method} -> HTTP {resp.status_code}: {_one_line(resp.text)}",
            status=resp.status_code,
        )
    return resp


def _json(resp: requests.Response, url: str) -> Any:
    try:
        return resp.json()
    except ValueError as e:
        raise BootstrapError(
            url, f"response is not JSON: {_one_line(resp.text)}", status=resp.status_code
        ) from e


def _backoff(base_s: float, attempt: int, cap_s: float) -> float:
    # Exponential with jitter in [0.75, 1], as SGLang's registration retry: keeps many
    # ranks that failed together from retrying in lockstep.
    return min(base_s * 2**attempt, cap_s) * sync.uniform(0.75, 1.0)


def health(url: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """True on HTTP 200; False if the server answers otherwise or not at all."""
    try:
        return _request("GET", f"{base_url(url)}/health", timeout).status_code == 200
    except BootstrapError:
        return False


def register_prefill_rank(
    url: str,
    info: dict,
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    retries: int = 4,
    backoff_s: float = 1.0,
    max_backoff_s: float = 30.0,
) -> None:
    """PUT /route.  ``info`` holds SGLang's registration fields (attn_tp_size, attn_tp_rank, ...,
    rank_ip, rank_port, page_size).  Like SGLang, 1 + 4 attempts with backoff 1, 2, 4, 8 s
    by default; a 4xx is a bad payload and is raised at once."""
    target = f"{base_url(url)}/route"
    for attempt in range(retries + 1):
        try:
            _check(_request("PUT", target, timeout, json=info), "PUT", target)
            return
        except BootstrapError as e:
            if (e.status is not None and 400 <= e.status < 500) or attempt == retries:
                raise
        sync.sleep(_backoff(backoff_s, attempt, max_backoff_s))


def register_dp_rank(
    url: str, room: int, dp_rank: int, *, timeout: float = DEFAULT_TIMEOUT_S
) -> None:
    """POST /register_dp_rank: this prefill DP rank took bootstrap ``room``.  One attempt, as SGLang."""
    target = f"{base_url(url)}/register_dp_rank"
    _check(
        _request("POST", target, timeout, json={"bootstrap_room": room, "dp_rank": dp_rank}),
        "POST",
        target,
    )


def get_prefill_info(url: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict | None:
    """The prefill parallel info (SGLang's PrefillServerInfo fields: attn_tp_size, attn_cp_size,
    dp_size, pp_size, page_size, kv_cache_dtype, follow_bootstrap_room, ...), or None while
    the server answers 503 (not every prefill rank registered yet)."""
    target = f"{base_url(url)}/route"
    params = {
        "prefill_dp_rank": -1,
        "prefill_cp_rank": -1,
        "target_tp_rank": -1,
        "target_pp_rank": -1,
    }
    resp = _request("GET", target, timeout, params=params)
    if resp.status_code == 503:
        return None
    info = _json(_check(resp, "GET", target), target)
    if not isinstance(info, dict):
        raise BootstrapError(target, f"parallel info is not a JSON object: {_one_line(resp.text)}")
    return info


def get_prefill_rank_info(
    url: str,
    *,
    dp_rank: int,
    tp_rank: int,
    pp_rank: int = 0,
    cp_rank: int = 0,
    timeout: float = DEFAULT_TIMEOUT_S,
) -> dict | None:
    """One prefill rank's {"rank_ip", "rank_port"}, or None if the server has none (404) or is
    not ready (503)."""
    target = f"{base_url(url)}/route"
    params = {
        "prefill_dp_rank": dp_rank,
        "prefill_cp_rank": cp_rank,
        "target_tp_rank": tp_rank,
        "target_pp_rank": pp_rank,
    }
    resp = _request("GET", target, timeout, params=params)
    if resp.status_code in (404, 503):
        return None
    return _json(_check(resp, "GET", target), target)


def query_prefill_dp_ranks(
    url: str,
    rooms: list[int],
    *,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    retries: int = 2,
    backoff_s: float = 0.05,
    max_backoff_s: float = 1.0,
) -> dict[int, int]:
    """POST /query_dp_ranks: {room: prefill dp_rank} for the rooms the server knows; rooms not
    (yet) registered are absent, and the caller asks again later.

    SGLang makes a single attempt per scheduler pass and treats any failure as "nothing
    known yet".  Here a failure (5xx, no answer, unparsable body) is retried ``retries``
    times with exponential backoff, then raised as BootstrapQueryError so the caller can
    tell "unknown" from "could not ask".  A 4xx is not retried: the request itself is wrong.
    """
    target = f"{base_url(url)}/query_dp_ranks"
    if not rooms:
        return {}
    payload = {"bootstrap_rooms": list(rooms)}
    last: BootstrapError | None = None
    for attempt in range(retries + 1):
        if attempt:
            sync.sleep(_backoff(backoff_s, attempt - 1, max_backoff_s))
        try:
            resp = _check(_request("POST", target, timeout_s, json=payload), "POST", target)
            return _parse_room_ranks(_json(resp, target), target)
        except BootstrapError as e:
            last = e
            if e.status is not None and 400 <= e.status < 500:
                break
    assert last is not None
    raise BootstrapQueryError(
        target,
        f"gave up after {attempt + 1} attempt(s): {last.reason}",
        status=last.status,
        attempts=attempt + 1,
        unavailable=isinstance(last, BootstrapUnavailable),
    ) from last


def _parse_room_ranks(data: Any, url: str) -> dict[int, int]:
    if not isinstance(data, dict):
        raise BootstrapError(
            url, f"expected a JSON object of room -> dp_rank, got {type(data).__name__}"
        )
    out = {}
    for room, rank in data.items():
        if isinstance(rank, bool) or not isinstance(rank, int):
            raise BootstrapError(url, f"malformed reply: dp_rank for room {room!r} is {rank!r}")
        try:
            out[int(room)] = rank
        except ValueError:
            raise BootstrapError(
                url, f"malformed reply: room key {room!r} is not an integer"
            ) from None
    return out


def set_faults(url: str, *, timeout: float = DEFAULT_TIMEOUT_S, **faults: Any) -> dict:
    """POST /_faults on our own server (latency_s, latency_scope, failure_rate, failure_status, seed)."""
    target = f"{base_url(url)}/_faults"
    return _json(_check(_request("POST", target, timeout, json=faults), "POST", target), target)


def get_stats(url: str, *, timeout: float = DEFAULT_TIMEOUT_S) -> dict:
    """GET /_stats on our own server: per-endpoint request counters and registration counts."""
    target = f"{base_url(url)}/_stats"
    return _json(_check(_request("GET", target, timeout), "GET", target), target)
