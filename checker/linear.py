"""The linear checker: one streaming pass over a trace, every rule of spec/ evaluated as it goes.

Each rule kind is a template (checker/streaming.py) instantiated with the rule's parameters; the
kinds live in checker/batch_templates.py, checker/request_templates.py, checker/send_templates.py and
checker/decode_templates.py, the cross-process ones in checker/cross_templates.py. One pass per
chunk of the trace routes each event to the templates that listen to it and keeps the events of
the shared batch index (the seq and thread of `ev` for batch N), which the finish-time templates
read as numpy columns (`Dense`); memory grows with batches and requests, not with events.
"""

from __future__ import annotations

import gc
import itertools
from collections import defaultdict

from spec import Rule, load_events, load_rules

# The template modules register their kinds into TEMPLATES when imported.
from . import (  # noqa: F401 - each registers its template kinds
    batch_templates,
    decode_templates,
    receiver_templates,
    request_templates,
    send_templates,
)
from .cross_templates import check_cross
from .streaming import CROSS_TEMPLATES, TEMPLATES, Ctx, Dense, Result, Template, Violation
from .trace_io import as_events, check_consecutive, iter_chunks, truncation

__all__ = [
    "CROSS_TEMPLATES",
    "TEMPLATES",
    "Ctx",
    "Dense",
    "Result",
    "Template",
    "Violation",
    "check_file",
    "check_files",
]


def check_file(
    path: str, *, rules: list[Rule] | None = None, extra_templates: dict | None = None
) -> Result:
    """Every rule of the trace's role and mode, in one streaming pass."""
    # The checker allocates millions of small, acyclic objects (events, index entries); the cyclic
    # garbage collector would rescan the growing index again and again.
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        return _check_file(path, rules, extra_templates)
    finally:
        if gc_was_enabled:
            gc.enable()


def _instantiate(rules: list[Rule], ctx: Ctx, extra_templates: dict | None) -> list[Template]:
    """A template per rule; a rule kind no template knows is an error."""
    templates = {**dict(TEMPLATES.items()), **(extra_templates or {})}
    missing = sorted({r.kind for r in rules} - set(templates))
    if missing:  # a rule this checker cannot check must not pass silently
        raise ValueError(f"no linear template for rule kind(s) {', '.join(missing)}")
    return [templates[r.kind](r, ctx) for r in rules]


def _batched_events(role: str) -> set[str]:
    """The batch-indexed events: those the vocabulary gives an int `batch` (prefix_send is per
    request, several per batch, and is not a batch step)."""
    return {
        ev
        for ev, spec in load_events().get(role, {}).items()
        if spec.get("fields", {}).get("batch") == "int" and ev != "prefix_send"
    }


def _stream(chunks, active: list[Template], ctx: Ctx, batched: set[str]) -> int:
    """Feed every chunk to the templates and the batch index; returns the number of events.

    Per chunk, one pass splits the events by kind and, for each distinct set of several kinds
    that templates listen to, gathers that set's events in trace order (`_split`); a template gets
    its set's list (one kind: the kind's list as it is), shared with every template listening to
    exactly that set, unless its `idle` says the chunk has nothing for it; a template with
    `on_kinds` gets the split itself. The batch index keeps the lists of the batch-indexed kinds
    (Ctx.add), and is built from them when read."""
    listeners: dict[frozenset | None, list] = defaultdict(list)  # kinds (None: all) -> templates
    columnar = [t.on_kinds for t in active if t.on_kinds is not None]
    for t in active:
        if t.on_kinds is None:
            kinds = frozenset(t.handlers())
            listeners[None if "*" in kinds else kinds].append(t)
    sets = [(kinds, tuple(ts)) for kinds, ts in listeners.items() if kinds is None or kinds]
    several = [kinds for kinds, _ in sets if kinds is not None and len(kinds) > 1]
    # each set: the chunk (None), a kind's list (a str) or a gathered list (its index in `several`)
    feeds = [
        (None if k is None else several.index(k) if len(k) > 1 else next(iter(k)), ts)
        for k, ts in sets
    ]
    indexed = sorted(batched)
    n = 0
    for chunk in chunks:
        n += len(chunk)
        by, gathered = _split(chunk, several)
        ctx.columns.clear()
        for ev in indexed:  # first: a template may read the chunk's own entries
            if ev in by:
                ctx.add(ev, by[ev])
        for on_kinds in columnar:
            on_kinds(by)
        for which, ts in feeds:
            feed = (
                chunk
                if which is None
                else by.get(which, ())
                if type(which) is str
                else gathered[which]
            )
            if feed:
                for t in ts:
                    if t.idle is None or not t.idle(by):
                        t.on_chunk(feed)
    return n


def _split(chunk: list, several: list) -> tuple[dict, list]:
    """The chunk's events by kind (ev -> its events in trace order, the kinds of the chunk only),
    and for each set of kinds in `several` its events in trace order: one pass, in which each
    event is appended to its kind's list and to the list of every set that holds its kind (cheaper
    than merging the kinds' lists again by seq for every set)."""
    by: dict = {}
    gathered: list = [[] for _ in several]
    targets: dict = {}  # the struct type of a kind -> the append of each list it goes to
    for e in chunk:
        to = targets.get(type(e))
        if to is None:
            ev = e.ev
            by[ev] = []
            to = targets[type(e)] = (
                by[ev].append,
                *[g.append for kinds, g in zip(several, gathered, strict=True) if ev in kinds],
            )
        for add in to:
            add(e)
    return by, gathered


def _check_file(path: str, rules: list[Rule] | None, extra_templates: dict | None) -> Result:
    header: dict = {}
    ignored: dict = {}
    status: dict = {}
    chunks = iter_chunks(
        path, header_out=header, ignored=ignored, status=status, structs=True, consecutive=False
    )
    first = next(chunks, [])  # reads (and validates) the header
    role, mode = header["role"], header.get("mode")
    rules = [r for r in (rules or load_rules()) if r.role == role and r.applies(mode, header)]
    ctx = Ctx(header, header.get("page_size", 1))
    active = _instantiate(rules, ctx, extra_templates)
    n = _stream(itertools.chain((first,), chunks), active, ctx, _batched_events(role))
    check_consecutive(path, ctx.admitted())  # (the reader leaves it to the batch index)
    cut = truncation(status)
    if cut is not None:  # a prefix of the run: the rules that need its end say nothing
        skipped = [t.rule.id for t in active if t.rule.needs_end]
        active = [t for t in active if not t.rule.needs_end]
    for t in active:
        t.finish()
    violations = [v for t in active for v in t.violations]
    result = Result(path, header, n, [(t.rule, t.checks) for t in active], violations, ignored)
    result.stalls = status.get("stalls", 0)
    end = status.get("end")
    result.end_reason = end["reason"] if end else None
    if cut is not None:
        result.truncated, result.not_judged = cut, skipped
    return result


def check_files(paths, *, rules: list[Rule] | None = None) -> list[Result]:
    """Each file against its role's rules, then every decode trace together with the prefill traces
    of its DP ranks given alongside it (the cross-process rules, one extra Result per decode
    trace)."""
    rules = rules or load_rules()
    results = [check_file(p, rules=rules) for p in paths]
    cross = check_cross(list(paths), rules)
    cut = next((r.truncated for r in results if r.truncated is not None), None)
    if cut is not None:  # the cross rules read the truncated trace too
        for r in cross:
            r.truncated = cut
            r.not_judged = sorted({rule.id for rule, _ in r.rules if rule.needs_end})
            r.rules = [(rule, c) for rule, c in r.rules if not rule.needs_end]
            r.violations = [v for v in r.violations if not v.rule.needs_end]
    return results + cross


def check_events(header: dict, events: list[dict], rules: list[Rule]) -> list[Violation]:
    """`rules` (those of the header's role and mode) on events already read, in list order: what
    `pdo check --predict` runs on a reordering of a trace."""
    role, mode = header["role"], header.get("mode")
    rules = [r for r in rules if r.role == role and r.applies(mode, header)]
    ctx = Ctx(header, header.get("page_size", 1))
    active = _instantiate(rules, ctx, None)
    _stream((as_events(header, events),), active, ctx, _batched_events(role))
    for t in active:
        t.finish()
    return [v for t in active for v in t.violations]
