"""Human and JSON reports of a check: counts per rule on a pass; on a violation the rule, the events
involved and a few events around them on each thread (found with a second pass over the file)."""

from __future__ import annotations

from collections import defaultdict, deque

from .trace_io import iter_events

CONTEXT = 3
MAX_SHOWN = 8


def _brief(e: dict) -> str:
    keys = [k for k in ("batch", "rid", "slot", "value", "tokens", "pages") if k in e]
    args = ",".join(f"{k}={e[k]}" for k in keys)
    return f"#{e['seq']} {e['ev']}({args})"


def _context(path: str, seqs: set[int]) -> dict[int, dict]:
    """seq -> {"event": e, "around": {thread: [brief, ...]}} for the involved seqs."""
    out: dict[int, dict] = {}
    recent: dict[str, deque] = defaultdict(lambda: deque(maxlen=CONTEXT))
    after: dict[str, list] = defaultdict(list)  # thread -> [(seq, remaining)]
    all_recent: deque = deque(maxlen=CONTEXT * 4)
    for _, e in iter_events(path):
        t = e["thread"]
        for item in after[t]:
            if item[1] > 0:
                out[item[0]]["around"].setdefault(t, []).append(_brief(e))
                item[1] -= 1
        if e["seq"] in seqs:
            around = {th: [_brief(x) for x in dq] for th, dq in recent.items() if dq}
            around.setdefault(t, []).append("[" + _brief(e) + "]")
            out[e["seq"]] = {"event": e, "around": around}
            after[t].append([e["seq"], CONTEXT])
        recent[t].append(e)
        all_recent.append(e)
    return out


def ignored_note(ignored: dict) -> list[str]:
    """A line naming the engine's own events (`x.<name>`), which no rule saw."""
    if not ignored:
        return []
    kinds = ", ".join(f"{ev} ({n})" for ev, n in sorted(ignored.items()))
    return [
        f"  note: {sum(ignored.values())} event(s) of the engine's own (x.*) were skipped: {kinds}"
    ]


def text_report(result) -> str:
    h = result.header
    name = f"{result.path} ({h.get('role')}, mode={h.get('mode', '-')})"
    if result.ok:
        if getattr(result, "truncated", None) is not None:
            lines = [
                f"INCOMPLETE {name}: truncated at line {getattr(result, 'truncated', None)}{ended_by(result)}; "
                f"{result.events} events, "
                f"{len(result.rules)} rules judged, none broken"
            ]
        else:
            lines = [f"PASS {name}: {result.events} events, {len(result.rules)} rules"]
        for rule, checks in result.rules:
            lines.append(f"  {rule.id:32s} {checks:7d} checks")
        lines += ignored_note(result.ignored) + truncation_lines(result)
        return "\n".join(lines)
    by_rule: dict[str, int] = {}
    for v in result.violations:
        by_rule[v.rule.id] = by_rule.get(v.rule.id, 0) + 1
    lines = [
        f"FAIL {name}: {len(result.violations)} violation(s) of {len(by_rule)} rule(s), {result.events} events",
        "  " + ", ".join(f"{rule} {n}" for rule, n in by_rule.items()),
    ]
    if getattr(result, "truncated", None) is not None:
        lines.append(f"  truncated at line {getattr(result, 'truncated', None)}{ended_by(result)}")
    lines += ignored_note(result.ignored) + truncation_lines(result)
    # every violated rule explained at least once, then the rest in order, up to MAX_SHOWN
    firsts = {v.rule.id: i for i, v in reversed(list(enumerate(result.violations)))}
    picked = sorted(firsts.values())[:MAX_SHOWN]
    picked += [i for i in range(len(result.violations)) if i not in firsts.values()][
        : MAX_SHOWN - len(picked)
    ]
    shown = [result.violations[i] for i in sorted(picked)]
    ctx = _context(result.path, {s for v in shown for s in v.seqs})
    for v in shown:
        lines.append(f"\n[{v.rule.id}] {v.rule.statement}")
        lines.append(f"  {v.message}")
        for s in v.seqs:
            c = ctx.get(s)
            if c is None:
                continue
            e = c["event"]
            lines.append(f"  event {_brief(e)} on {e['thread']}")
        threads: dict[str, list] = {}
        for s in v.seqs:
            for t, items in ctx.get(s, {}).get("around", {}).items():
                threads.setdefault(t, [])
                threads[t].extend(i for i in items if i not in threads[t])
        for t, items in threads.items():
            lines.append(f"    {t:>14s}: " + " · ".join(items))
        lines.append(f"  design: {v.rule.design}")
    if len(result.violations) > len(shown):
        lines.append(
            f"\n... and {len(result.violations) - len(shown)} more (--json lists them all)"
        )
    return "\n".join(lines)


def ended_by(result) -> str:
    return (
        f" (the run ended by {getattr(result, 'end_reason', None)})"
        if getattr(result, "end_reason", None)
        else ""
    )


def truncation_lines(result) -> list[str]:
    """What a truncated trace could not decide, and the watchdog's stalls."""
    lines = []
    if getattr(result, "truncated", None) is not None:
        lines.append(
            f"  not judged (need the end of the run): {', '.join(getattr(result, 'not_judged', [])) or 'none'}"
        )
    if getattr(result, "stalls", 0):
        lines.append(f"  note: {getattr(result, 'stalls', 0)} stall event(s) of the watchdog")
    return lines


def json_report(result) -> dict:
    return {
        "path": result.path,
        "ok": result.ok,
        "truncated": getattr(result, "truncated", None),
        "not_judged": getattr(result, "not_judged", []),
        "end_reason": getattr(result, "end_reason", None),
        "events": result.events,
        "ignored": result.ignored,
        "header": {k: result.header.get(k) for k in ("role", "mode", "version", "page_size")},
        "rules": [{"id": r.id, "checks": c} for r, c in result.rules],
        "violations": [
            {"rule": v.rule.id, "statement": v.rule.statement, "message": v.message, "seqs": v.seqs}
            for v in result.violations
        ],
    }
