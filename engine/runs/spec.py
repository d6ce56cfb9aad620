"""One run, described once: `RunSpec`, what `pdo run`, `pdo run --pd`, `pdo launch`'s processes
and the fuzz harness are given. Torch-free, so the CLI builds it before torch loads. A strict JSON
round-trip (the spec file `pdo launch` hands its processes), and the record of it every trace
header carries (`to_header`, `from_header`: what `pdo check --predict --confirm` rebuilds a run
from)."""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Literal

import msgspec

from engine.decode.config import DecodeConfig
from engine.runtime.config import EngineConfig
from spec.errors import BadInput


@dataclass
class WorkloadConfig:
    """A seeded workload (engine/runs/workload.py draws it)."""

    requests: int = 24
    prompt_len: tuple[int, int] = (24, 160)  # inclusive range
    hit: float = 0.8
    groups: int = 3
    arrival: Literal["burst", "poisson"] = "burst"
    rate: float = 2000.0  # requests per second for poisson
    logit_bias_frac: float = 0.25
    max_new_tokens: int = 1
    seed: int = 0


@dataclass
class Kill:
    """A fault (docs/faults.md): `role` (prefill<i>, decode, bootstrap) dies at moment `at`."""

    role: str
    at: int


@dataclass
class WatchdogSpec:
    """engine/trace/watchdog.py's settings: a `stall` event after `seconds` with no event."""

    seconds: float
    on_stall: Literal["continue", "stop"] = "continue"


@dataclass
class RunSpec:
    """A run. A prefill run (`run_prefill`) reads `engine`, `workload`, the trace and the checks;
    a PD run (`run_pd`, `pdo launch`) the rest too."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    dp: int = 1  # prefill DP ranks
    router: Literal["round_robin", "random"] = "round_robin"  # request -> rank, seeded
    # "http": the aiohttp server on its own thread; "inproc": its handlers called in process;
    # None: inproc under a schedule controller (every role thread managed), else http
    bootstrap: Literal["http", "inproc"] | None = None
    bootstrap_url: str | None = None  # a server already running (pdo bootstrap), else one started
    bootstrap_latency_ms: float = 0.0
    latency_scope: Literal["all", "query_dp_ranks"] = "all"
    prefill_delay_s: float = 0.0  # the prefill ranks register this late
    kill: Kill | None = None
    timeout_s: float = 120.0
    trace_path: str | None = None  # a prefill run's trace; a PD run's stem (pd_trace_paths)
    watchdog: WatchdogSpec | None = None
    verify: bool = True  # judge the outputs against the reference

    def to_json(self) -> bytes:
        return msgspec.json.encode(self, order="deterministic")

    @classmethod
    def from_json(cls, data: bytes | str, source: str = "run spec") -> RunSpec:
        """The spec `data` holds; BadInput naming `source` and the field for an unknown field, a
        wrong type or a value a config refuses."""
        try:
            raw = msgspec.json.decode(data)
            _refuse_unknown(raw, cls, "$")
            return msgspec.convert(raw, cls)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise BadInput(f"{source}: {exc}") from None

    def to_header(self, *, pd: bool, unrecorded=()) -> dict:
        """The run's record in a trace header: `config`, `workload`, and for a PD run (`pd`)
        `decode_config` and `pd_run` (with `unrecorded`: what the run was given that the header
        cannot hold, so that no rebuild is attempted)."""
        out = msgspec.to_builtins(self, order="deterministic")
        head = {"config": out["engine"], "workload": out["workload"]}
        if pd:
            run = {k: out[k] for k in _PD_RUN}
            head.update(decode_config=out["decode"], pd_run={**run, "unrecorded": list(unrecorded)})
        return head

    @classmethod
    def from_header(cls, header: dict, source: str) -> RunSpec:
        """The run a trace header records (fields a later version dropped are left out); BadInput
        when it records none."""
        if not isinstance(header.get("config"), dict) or not isinstance(
            header.get("workload"), dict
        ):
            raise BadInput(f"{source}: header lacks 'config' or 'workload': cannot rebuild the run")
        raw = {"engine": header["config"], "workload": header["workload"]}
        raw["dp"] = header.get("dp_size", 1)
        if "decode_config" in header:
            raw["decode"] = header["decode_config"]
        run = header.get("pd_run") or {}
        raw.update({k: run[k] for k in _PD_RUN if k in run})
        try:
            return msgspec.convert(raw, cls)
        except msgspec.ValidationError as exc:
            raise BadInput(f"{source}: header: {exc}") from None


# the PD options a trace header records under `pd_run` (with what the run was given that it
# cannot record: `unrecorded`)
_PD_RUN = ("router", "bootstrap_latency_ms", "latency_scope", "prefill_delay_s", "kill")


def _refuse_unknown(raw, cls, at: str) -> None:
    """msgspec ignores a dataclass's unknown fields: a misspelt knob would run at its default."""
    if not (dataclasses.is_dataclass(cls) and isinstance(raw, dict)):
        return
    hints = typing.get_type_hints(cls)
    for k, v in raw.items():
        if k not in hints:
            raise msgspec.ValidationError(f"Object contains unknown field `{k}` - at `{at}`")
        for t in (hints[k], *typing.get_args(hints[k])):
            _refuse_unknown(v, t, f"{at}.{k}")
