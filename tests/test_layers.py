"""Layers read top-down, as the README states: formats -> bmm -> policy -> model -> engine -> validate /
serve / audit -> integrations -> cli, under the shared helpers (settings, libc, progress, bundled). Every
package and module of mlaq has its place (a new one fails until it is placed), the sub-packages of a
package have an order of their own, and no modules (anywhere) nor sibling sub-packages import a circle,
TYPE_CHECKING imports included (read from the source, not run)."""

from __future__ import annotations

import ast
from pathlib import Path

import mlaq

ROOT = Path(mlaq.__file__).resolve().parent
# tiers, lowest first: a module may import its own tier and the ones below, never one above
ORDER: tuple[tuple[str, ...], ...] = (
    ("settings", "libc", "progress", "outputs"),
    ("bundled",),
    ("formats",),
    ("bmm",),
    ("policy",),
    ("model",),
    ("engine",),
    ("validate", "serve", "audit"),
    ("integrations",),
    ("cli", "__main__"),
)
# inside a package: its modules and sub-packages by tier ("" is the package's own __init__)
SUB_ORDER: dict[str, tuple[tuple[str, ...], ...]] = {
    "model": (("kernels",), ("config", "registry"), ("layers",), ("loading",), ("",)),
}


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


def _tier(order: tuple[tuple[str, ...], ...], name: str) -> int | None:
    return next((i for i, names in enumerate(order) if name in names), None)


def _top(module: str) -> str:
    return module.split(".")[1] if "." in module else ""


def _part(module: str, package: str) -> str | None:
    """The part of ``package`` (mlaq.<package>) that ``module`` lies in ("" for its __init__)."""
    prefix = f"mlaq.{package}"
    if module == prefix:
        return ""
    return module[len(prefix) + 1 :].split(".")[0] if module.startswith(prefix + ".") else None


def layer_violations(g: dict[str, set[str]]) -> list[str]:
    bad = []
    for name, deps in g.items():
        if name == "mlaq":
            continue
        mine = _tier(ORDER, _top(name))
        for d in deps:
            theirs = _tier(ORDER, _top(d))
            if mine is not None and theirs is not None and theirs > mine:
                bad.append(f"{name} -> {d}")
        for package, order in SUB_ORDER.items():
            part = _part(name, package)
            if part is None:
                continue
            for d in deps:
                other = _part(d, package)
                if other is None or other == part:
                    continue
                a, b = _tier(order, part), _tier(order, other)
                if a is not None and b is not None and b > a:
                    bad.append(f"{name} -> {d}")
    return bad


def _sibling_graph(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """Sub-packages as nodes: mlaq.a.b -> mlaq.a.c when a module under b imports one under c (b, c siblings
    that are both packages)."""
    packages = {n for n in g if any(m.startswith(n + ".") for m in g)}

    def home(module: str) -> str | None:
        parts = module.split(".")
        for k in range(len(parts), 1, -1):
            p = ".".join(parts[:k])
            if p in packages and p != "mlaq":
                return p
        return None

    out: dict[str, set[str]] = {p: set() for p in packages}
    for name, deps in g.items():
        for d in deps:
            a, b = home(name), home(d)
            if a is None or b is None or a == b:
                continue
            while a.count(".") > b.count("."):
                a = a.rsplit(".", 1)[0]
            while b.count(".") > a.count("."):
                b = b.rsplit(".", 1)[0]
            if a != b and a.rsplit(".", 1)[0] == b.rsplit(".", 1)[0]:  # siblings
                out[a].add(b)
    return out


def test_every_package_and_module_has_its_place() -> None:
    g = graph()
    unplaced = sorted({_top(n) for n in g if n != "mlaq" and _tier(ORDER, _top(n)) is None})
    assert unplaced == [], f"add these to ORDER in tests/test_layers.py: {unplaced}"
    for package, order in SUB_ORDER.items():
        parts = {p for n in g if (p := _part(n, package)) is not None}
        assert parts - {p for tier in order for p in tier} == set(), package


def test_no_import_circle_anywhere() -> None:
    assert _cycles(graph(), "mlaq") == []


def test_no_circle_between_sibling_subpackages() -> None:
    assert _cycles(_sibling_graph(graph()), "mlaq") == []


def test_the_cycle_finder_sees_a_circle() -> None:
    g = {"mlaq.validate.a": {"mlaq.validate.b"}, "mlaq.validate.b": {"mlaq.validate.a"}, "mlaq.x": set()}
    assert _cycles(g, "mlaq.validate") == [["mlaq.validate.a", "mlaq.validate.b"]]
    packages = {
        "mlaq.model": set(),
        "mlaq.model.layers": set(),
        "mlaq.model.layers.mla": {"mlaq.model.loading.kv_b"},
        "mlaq.model.loading": set(),
        "mlaq.model.loading.kv_b": {"mlaq.model.layers.mla"},
    }
    assert _cycles(_sibling_graph(packages), "mlaq") == [["mlaq.model.layers", "mlaq.model.loading"]]


def test_lower_layers_never_import_higher_ones() -> None:
    assert layer_violations(graph()) == []


def test_the_layer_check_sees_an_upward_import() -> None:
    g = {
        "mlaq.engine.x": {"mlaq.validate.y"},
        "mlaq.serve.a": {"mlaq.audit.b"},  # one tier: allowed
        "mlaq.model.layers.mla": {"mlaq.model.loading.kv_b"},
        "mlaq.model.loading.kv_b": {"mlaq.model.layers.mla"},
    }
    assert layer_violations(g) == [
        "mlaq.engine.x -> mlaq.validate.y",
        "mlaq.model.layers.mla -> mlaq.model.loading.kv_b",
    ]


def test_validate_statistics_and_renderers_do_not_touch_the_model() -> None:
    """stats, the record and every renderer read only data: no model, engine or source import."""
    g = graph()
    for name in ("record", "stats", "summary", "report_md", "report", "plots"):
        deps = g[f"mlaq.validate.{name}"]
        assert not {d for d in deps if d.startswith(("mlaq.model", "mlaq.validate.sources"))}, (name, deps)
