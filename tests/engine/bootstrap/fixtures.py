"""Helpers of the bootstrap server tests: rank registrations, query parameters, a free port."""

from __future__ import annotations

import socket
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
T = 2.0  # per-request timeout for raw requests in tests: nothing here should take longer


def rank(tp_rank=0, tp_size=1, dp_rank=0, dp_size=1, pp_rank=0, pp_size=1, **extra):
    """A registration payload as SGLang's prefill sends it."""
    info = {
        "role": "Prefill",
        "attn_tp_size": tp_size,
        "attn_tp_rank": tp_rank,
        "attn_cp_size": 1,
        "attn_cp_rank": 0,
        "attn_dp_size": dp_size,
        "attn_dp_rank": dp_rank,
        "pp_size": pp_size,
        "pp_rank": pp_rank,
        "system_dp_size": 1,
        "system_dp_rank": 0,
        "rank_ip": "127.0.0.1",
        "rank_port": 20000 + 100 * dp_rank + 10 * tp_rank + pp_rank,
        "page_size": 16,
        "kv_cache_dtype": "auto",
        "load_balance_method": "round_robin",
    }
    info.update(extra)
    return info


def info_params(**values):
    return {
        "prefill_dp_rank": -1,
        "prefill_cp_rank": -1,
        "target_tp_rank": -1,
        "target_pp_rank": -1,
        **values,
    }


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
