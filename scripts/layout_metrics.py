"""Size and structure figures for the layout: the numbers of the before/after table of a layout change.

Run: .venv/bin/python scripts/layout_metrics.py [--json]
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("engine", "spec", "checker", "triton_kernels")


def tracked_python() -> list[Path]:
    out = subprocess.run(
        ["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return [ROOT / line for line in out.stdout.split()]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def resolve(module: str, node: ast.ImportFrom, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports(path: Path, known: set[str]) -> list[tuple[str, bool]]:
    """(imported project module, imported inside a function) for each import in the file."""
    module = module_name(path)
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[str, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            if isinstance(child, ast.Import):
                found.extend((alias.name, in_function) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                target = resolve(module, child, path.name == "__init__.py")
                names = [f"{target}.{alias.name}" for alias in child.names]
                found.extend((n if n in known else target, in_function) for n in names)
            visit(child, nested)

    visit(tree, False)
    return [(name, lazy) for name, lazy in found if name.split(".")[0] in PACKAGES + ("tests",)]


def function_level_imports(path: Path) -> int:
    """Import statements (of any module) inside a function body."""
    tree = ast.parse(path.read_text(), str(path))
    functions = [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
    ]
    inner = {
        id(n) for f in functions for n in ast.walk(f) if isinstance(n, (ast.Import, ast.ImportFrom))
    }
    return len(inner)


def graph(files: list[Path]) -> dict[str, set[str]]:
    known = {module_name(p) for p in files}
    edges: dict[str, set[str]] = {}
    for path in files:
        source = module_name(path)
        targets = edges.setdefault(source, set())
        for name, _ in imports(path, known):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != source:
                targets.add(name)
    return edges


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                connect(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(edges):
        if node not in index:
            connect(node)
    return components


def long_functions(path: Path, limit: int = 60) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    return [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1})"
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > limit
    ]


ENGINE_CORE = ("engine/sync", "engine/runtime", "engine/prefill", "engine/decode")


def exception_classes(modules: list[str]) -> list[str]:
    """The exception classes the code defines (imported, so a class is counted by what it is)."""
    import importlib

    found = set()
    for name in modules:
        try:
            module = importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001 - an optional dependency missing: say so, go on
            found.add(f"{name}: not imported ({type(exc).__name__})")
            continue
        for value in vars(module).values():
            if (
                isinstance(value, type)
                and issubclass(value, BaseException)
                and value.__module__ == name
            ):
                found.add(f"{name}.{value.__name__}")
    return sorted(found)


def process_globals(path: Path) -> list[str]:
    """Module-level names a function rebinds (`global`): state of the process, not of an object."""
    tree = ast.parse(path.read_text(), str(path))
    names = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    return [f"{module_name(path)}.{n}" for n in sorted(names)]


def underscore_key_reads(path: Path) -> int:
    """Subscripts by a string constant that starts with an underscore: x["_scheduler"]."""
    tree = ast.parse(path.read_text(), str(path))
    return sum(
        1
        for node in ast.walk(tree)
        if isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and isinstance(node.slice.value, str)
        and node.slice.value.startswith("_")
        and not node.slice.value.startswith("__")
    )


def duplicate_pairs() -> str:
    out = subprocess.run(
        ["duplicates", "--most", "1", "--seconds", "120"], cwd=ROOT, capture_output=True, text=True
    )
    return out.stdout.splitlines()[0] if out.stdout else "duplicates: not available"


def main() -> None:
    files = tracked_python()
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in files}
    code = [p for p in files if p.relative_to(ROOT).parts[0] in PACKAGES]
    lazy = sum(function_level_imports(p) for p in code)
    edges = graph(files)
    from tests.layers import back_edges  # the layer rules live with their test

    rel = {p: str(p.relative_to(ROOT)) for p in files}
    figures = {
        "total_lines": sum(sizes.values()),
        "code_lines": sum(sizes[rel[p]] for p in code),
        "test_lines": sum(sizes[rel[p]] for p in files if rel[p].startswith("tests/")),
        "engine_core_lines": sum(sizes[rel[p]] for p in files if rel[p].startswith(ENGINE_CORE)),
        "engine_top_level_modules": sorted(
            rel[p] for p in files if p.parent == ROOT / "engine" and p.name != "__init__.py"
        ),
        "process_globals": [g for p in code for g in process_globals(p)],
        "exception_classes": exception_classes(
            [module_name(p) for p in code if "__main__" not in p.name]
        ),
        "underscore_key_reads": sum(underscore_key_reads(p) for p in files),
        "largest_file": max(sizes.items(), key=lambda kv: kv[1]),
        "files_over_500": sorted(f for f, n in sizes.items() if n > 500),
        "functions_over_60": [f for p in files for f in long_functions(p)],
        "cycles": cycles(edges),
        "back_edges": back_edges(edges),
        "function_level_imports_in_code": lazy,
        "duplicates": duplicate_pairs(),
    }
    if "--json" in sys.argv:
        print(json.dumps(figures, indent=1))
        return
    for key, value in figures.items():
        if isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"  {item}")
        else:
            print(f"{key}: {value}")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
