"""The rules of allowed interleavings, as data (rules.toml, events.toml), and the models built on them."""

from __future__ import annotations

import pathlib
from dataclasses import dataclass, field

from spec.vocabulary import LOOP_MODES, THREADS, events

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

HERE = pathlib.Path(__file__).parent
# Each rule kind (a template of checker/linear.py and checker/decode_templates.py, an encoding of
# spec/z3model/) with its parameters: name -> type, "?" marking an optional one. Types: event (a
# name in the role's vocabulary, spec/events.toml), events (a list of them), span (two of them),
# steps (a list of [event, batch offset]), thread (a name in THREADS), str, bool, int; `check` of
# lifecycle is one of two words. A rule's modes must be its role's (LOOP_MODES).
# load_rules() checks every rule against this, so a misspelt event or parameter fails at load time
# instead of making a rule vacuous.
PARAMS: dict[str, dict[str, str]] = {
    "fifo": {"events": "events"},
    "complete": {"events": "events"},
    "disjoint": {"span": "span"},
    "order": {
        "chain": "steps",
        "when?": "steps",
        "same_thread?": "bool",
        "same_thread_prefix?": "int",
    },
    "adjacent": {"first": "event", "then": "event", "thread": "thread"},
    "outside": {"ev": "event", "span": "span"},
    "within": {
        "ev": "event",
        "after": "event",
        "before": "event",
        "thread?": "thread",
        "same_thread_as?": "event",
    },
    "thread": {"events": "events", "thread?": "thread", "not_thread?": "thread"},
    "equal": {"a": "event", "b": "event", "field": "str"},
    "counter": {"inc": "event", "dec": "event", "owner": "event"},
    "lifecycle": {
        "acquire": "event",
        "release": "event",
        "check": "pairing|after_done",
        "processed?": "events",
        "sent?": "event",
        "counter?": "events",
    },
    "page_count": {"events": "events"},
    "page_aligned": {"events": "events"},
    "in_span": {"ev": "event", "span": "span"},
    "each_in_span": {"ev": "event", "span": "span"},
    "chunk_sent": {"sends": "events", "done": "event", "started": "event", "release": "event"},
    "delivered": {"done": "event", "consumer": "event", "sends?": "events", "failed?": "event"},
    # decode and cross-process kinds (spec/decode_rules.toml, checker/decode_templates.py)
    "prefetch_top": {"thread?": "thread"},
    **{
        k: {}
        for k in (
            "one_inflight",
            "published_first",
            "unknown_rooms",
            "prefetch_match",
            "consume_answer",
            "no_stale",
            "release",
            "init_once",
            "init_fifo",
            "kv_recv",
            "req_end",
            "cross_rank",
            "cross_pages",
        )
    },
}
KINDS = tuple(PARAMS)


@dataclass(frozen=True)
class Rule:
    id: str
    statement: str
    modes: tuple
    design: str  # the passage of the design the rule comes from
    kind: str
    params: dict = field(default_factory=dict, hash=False, compare=False)
    role: str = "prefill"
    # header field -> value for which the rule does not apply (a loop variant its mode does not name:
    # SGLang's overlap loop with sampling inside the forward, `sampling = "inline"`)
    unless: tuple = ()
    # derived from the events the rule names (spec/events.toml): the first format version that has
    # them all (an older trace lacks them, and the rule does not apply to it), and whether the loop
    # model emits them all (if not, the rule is judged on traces only, never proved)
    since: int = 1
    loop_model: bool = True
    # judged only on a whole trace: a prefix of a correct run can break it (an absence, a count at
    # the end); a truncated trace lists it as not judged (docs/trace-format.md)
    needs_end: bool = False

    def applies(self, mode: str | None, header: dict | None = None) -> bool:
        if header is not None and any(header.get(k) == v for k, v in self.unless):
            return False
        if header is not None and header.get("version", 1) < self.since:
            return False
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


_RULES: list = [None, None]  # (the parsed files they were built from, the rules)


def load_rules() -> list[Rule]:
    """Every rule of spec/, checked against PARAMS and the vocabulary: built again only when a file
    changed (the checker asks once per trace file, a fuzz campaign for thousands of small files)."""
    files = [f for f in ("rules.toml", "decode_rules.toml") if (HERE / f).exists()]
    parsed = tuple(_load(f) for f in files)  # held, so that a new parse is never mistaken for them
    if (
        _RULES[0] is None
        or len(_RULES[0]) != len(parsed)
        or any(a is not b for a, b in zip(_RULES[0], parsed))
    ):
        _RULES[:] = [parsed, _build_rules(files)]
    return list(_RULES[1])


def _build_rules(files: list[str]) -> list[Rule]:
    rules = []
    for fname in files:
        for raw in _load(fname)["rule"]:
            raw = dict(raw)
            base = {k: raw.pop(k) for k in ("id", "statement", "modes", "design", "kind")}
            role = raw.pop("role", "decode" if fname.startswith("decode") else "prefill")
            unless = raw.pop("unless", {})
            needs_end = raw.pop("needs_end", False)
            if type(needs_end) is not bool:
                raise ValueError(f"{fname}: rule {base['id']}: 'needs_end' must be true or false")
            if not isinstance(unless, dict) or not all(isinstance(k, str) for k in unless):
                raise ValueError(
                    f"{fname}: rule {base['id']}: 'unless' must be a table of header fields"
                )
            if base["kind"] not in KINDS:
                raise ValueError(f"{fname}: rule {base['id']}: unknown kind {base['kind']!r}")
            _check_params(fname, base["id"], base["kind"], raw, role, tuple(base["modes"]))
            named = [
                load_events().get(r, {}).get(ev, {})
                for r, ev in _events_named(base["kind"], raw, role)
            ]
            rules.append(
                Rule(
                    base["id"],
                    base["statement"],
                    tuple(base["modes"]),
                    base["design"],
                    base["kind"],
                    raw,
                    role,
                    tuple(sorted(unless.items())),
                    max((e.get("since", 1) for e in named), default=1),
                    all(e.get("loop_model", True) for e in named),
                    needs_end,
                )
            )
    ids = [r.id for r in rules]
    if len(ids) != len(set(ids)):
        raise ValueError("duplicate rule ids in spec/")
    return rules


def _events_named(kind: str, params: dict, role: str) -> list[tuple[str, str]]:
    """(role, event) for each event a rule's parameters name (a cross rule's, in either role)."""
    names = []
    for key, typ in PARAMS[kind].items():
        v = params.get(key.rstrip("?"))
        if v is None:
            continue
        if typ == "event":
            names.append(v)
        elif typ in ("events", "span"):
            names += v
        elif typ == "steps":
            names += [x for x, _ in v]
    roles = ("prefill", "decode") if role == "cross" else (role,)
    return [(r, ev) for ev in names for r in roles]


def modes_of(role: str) -> tuple[str, ...]:
    """The loop modes a trace of `role` may declare (its `mode` selects the rules that apply)."""
    return LOOP_MODES[role]


def _check_params(fname: str, rid: str, kind: str, params: dict, role: str, modes: tuple) -> None:
    where = f"spec/{fname}: rule {rid} ({kind})"
    vocab = load_events()
    names = (
        set(vocab.get(role, {}))
        if role != "cross"
        else set(vocab.get("prefill", {})) | set(vocab.get("decode", {}))
    )
    schema = {k.rstrip("?"): (t, k.endswith("?")) for k, t in PARAMS[kind].items()}
    unknown = set(params) - set(schema)
    if unknown:
        raise ValueError(f"{where}: unknown parameter(s) {', '.join(sorted(unknown))}")
    bad = [m for m in modes if m not in (*LOOP_MODES[role], "any")]
    if not modes or bad:
        raise ValueError(
            f"{where}: 'modes' must list modes of role {role} ({', '.join(LOOP_MODES[role])}, "
            f"or any); got {list(modes)}"
        )

    def event(v, what):
        if not isinstance(v, str) or v not in names:
            raise ValueError(
                f"{where}: {what}: {v!r} is not an event of role {role} (spec/events.toml)"
            )

    for name, (typ, optional) in schema.items():
        if name not in params:
            if not optional:
                raise ValueError(f"{where}: missing parameter {name!r}")
            continue
        v, what = params[name], f"parameter {name!r}"
        if typ == "event":
            event(v, what)
        elif typ in ("events", "span"):
            if not isinstance(v, list) or not v or (typ == "span" and len(v) != 2):
                raise ValueError(
                    f"{where}: {what}: expected {'two event names' if typ == 'span' else 'a list of event names'}"
                )
            for x in v:
                event(x, what)
        elif typ == "steps":
            if (
                not isinstance(v, list)
                or len(v) < 2
                or not all(isinstance(x, list) and len(x) == 2 and type(x[1]) is int for x in v)
            ):
                raise ValueError(
                    f"{where}: {what}: expected a list of [event, batch offset], at least two"
                )
            for x, _ in v:
                event(x, what)
        elif (
            typ == "bool"
            and type(v) is not bool
            or typ == "int"
            and type(v) is not int
            or typ == "str"
            and not isinstance(v, str)
        ):
            raise ValueError(f"{where}: {what}: expected {typ}, got {v!r}")
        elif typ == "thread" and v not in THREADS:
            raise ValueError(
                f"{where}: {what}: expected a thread ({', '.join(THREADS)}), got {v!r}"
            )
        elif "|" in typ and v not in typ.split("|"):
            raise ValueError(
                f"{where}: {what}: expected one of {typ.replace('|', ', ')}, got {v!r}"
            )


def load_events() -> dict[str, dict[str, dict]]:
    """role -> ev -> {"where": str, "fields": {name: type}, "optional": {name: type}, "order": names}
    (spec/vocabulary.py)"""
    return events()


def rule_by_id(rule_id: str) -> Rule:
    for r in load_rules():
        if r.id == rule_id:
            return r
    raise KeyError(rule_id)
