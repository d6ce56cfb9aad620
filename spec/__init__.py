"""The rules of allowed interleavings, as data (rules.toml, events.toml), and the models built on them."""
from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

HERE = pathlib.Path(__file__).parent
KINDS = ("fifo", "complete", "disjoint", "order", "adjacent", "outside", "within", "thread", "equal",
         "counter", "lifecycle", "page_count", "in_span", "decode",
         # decode and cross-process kinds (spec/decode_rules.toml, checker/decode_templates.py)
         "prefetch_top", "one_inflight", "published_first", "unknown_rooms", "prefetch_match", "no_stale",
         "release", "init_once", "init_fifo", "kv_recv", "req_end", "cross_rank", "cross_pages")


@dataclass(frozen=True)
class Rule:
    id: str
    statement: str
    modes: tuple
    seed: str
    kind: str
    params: dict = field(default_factory=dict, hash=False, compare=False)
    role: str = "prefill"

    def applies(self, mode: str | None) -> bool:
        return mode is None or mode in self.modes or "any" in self.modes

    def __getitem__(self, key):
        return self.params[key]

    def get(self, key, default=None):
        return self.params.get(key, default)


_CACHE: dict = {}


def _load(name: str) -> dict:
    """The parsed TOML file, read again only when the file changes (the checker asks once per trace
    file, and a fuzz campaign checks thousands of small files). Callers must not mutate it."""
    path = HERE / name
    stamp = path.stat().st_mtime_ns
    hit = _CACHE.get(name)
    if hit is None or hit[0] != stamp:
        with open(path, "rb") as f:
            hit = _CACHE[name] = (stamp, tomllib.load(f))
    return hit[1]


def load_rules() -> list[Rule]:
    rules = []
    for fname in ("rules.toml", "decode_rules.toml"):
        if not (HERE / fname).exists():
            continue
        for raw in _load(fname)["rule"]:
            raw = dict(raw)
            base = {k: raw.pop(k) for k in ("id", "statement", "modes", "seed", "kind")}
            role = raw.pop("role", "decode" if fname.startswith("decode") else "prefill")
            if base["kind"] not in KINDS:
                raise ValueError(f"{fname}: rule {base['id']}: unknown kind {base['kind']!r}")
            rules.append(Rule(base["id"], base["statement"], tuple(base["modes"]), base["seed"], base["kind"], raw, role))
    ids = [r.id for r in rules]
    if len(ids) != len(set(ids)):
        raise ValueError("duplicate rule ids in spec/")
    return rules


def modes_of(role: str) -> tuple[str, ...]:
    """The loop modes a trace of `role` may declare: those its rules name (a trace's `mode` selects
    the rules that apply to it, so a mode no rule names would select none)."""
    return tuple(dict.fromkeys(m for r in load_rules() if r.role == role for m in r.modes if m != "any"))


def load_events() -> dict[str, dict[str, dict]]:
    """role -> ev -> {"where": str, "fields": {name: type}}"""
    return _load("events.toml")


def rule_by_id(rule_id: str) -> Rule:
    for r in load_rules():
        if r.id == rule_id:
            return r
    raise KeyError(rule_id)
