"""Layers read top-down (formats -> bmm -> policy -> model -> engine -> validate -> cli) and the
modules of mlaq import no circle, TYPE_CHECKING imports included (read from the source, not run)."""

from __future__ import annotations

import ast
from pathlib import Path

import mlaq

ROOT = Path(mlaq.__file__).resolve().parent
ORDER = ("settings", "libc", "bundled", "formats", "bmm", "policy", "model", "engine", "validate", "cli")


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set[str]) -> set[str]:
    """mlaq modules ``path`` imports (``from mlaq.a import b`` counts mlaq.a.b when that is a module)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("mlaq.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("mlaq"):
            subs = {f"{node.module}.{a.name}" for a in node.names} & known
            out |= subs or {node.module}
    return out & known


def graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in ROOT.rglob("*.py")}
    return {name: _imports(p, set(files)) - {name} for name, p in files.items()}


def _cycles(g: dict[str, set[str]], within: str) -> list[list[str]]:
    """Strongly connected components of more than one module among modules under ``within``."""
    nodes = [n for n in g if n.startswith(within)]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in g[v]:
            if not w.startswith(within):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for n in nodes:
        if n not in index:
            visit(n)
    return out


def test_validate_has_no_import_circle() -> None:
    assert _cycles(graph(), "mlaq.validate") == []


def test_the_cycle_finder_sees_a_circle() -> None:
    g = {"mlaq.validate.a": {"mlaq.validate.b"}, "mlaq.validate.b": {"mlaq.validate.a"}, "mlaq.x": set()}
    assert _cycles(g, "mlaq.validate") == [["mlaq.validate.a", "mlaq.validate.b"]]


def test_lower_layers_never_import_higher_ones() -> None:
    def layer(module: str) -> int | None:
        top = module.split(".")[1] if "." in module else ""
        return ORDER.index(top) if top in ORDER else None

    bad = []
    for name, deps in graph().items():
        mine = layer(name)
        if mine is None:
            continue
        bad += [f"{name} -> {d}" for d in deps if (theirs := layer(d)) is not None and theirs > mine]
    assert bad == []


def test_validate_statistics_and_renderers_do_not_touch_the_model() -> None:
    """stats, the record and every renderer read only data: no model, engine or source import."""
    g = graph()
    for name in ("record", "stats", "summary", "report_md", "report", "plots"):
        deps = g[f"mlaq.validate.{name}"]
        assert not {d for d in deps if d.startswith(("mlaq.model", "mlaq.validate.sources"))}, (name, deps)
