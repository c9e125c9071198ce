"""The package's import graph, read from the source (ast, every import, also those inside a
function): no circle, and each layer imports only the layers below it (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

import smallbatch

SRC = Path(smallbatch.__file__).parent
#: a layer may import its own modules and those of the layers listed after it ("core": the
#: package's top-level modules -- losses, models, augment, data, io, errors, tracking, ...)
LAYERS = ("pipeline|__main__", "report", "mi", "evaluation", "training", "core")


def _modules() -> dict[str, tuple[Path, bool]]:
    out = {}
    for f in sorted(SRC.rglob("*.py")):
        parts = ("smallbatch", *f.relative_to(SRC).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (f, package)
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (a ``from pkg import name`` of a submodule
    counts as that submodule, of anything else as ``pkg``)."""
    mods = _modules()
    graph: dict[str, set[str]] = {}
    for mod, (path, package) in mods.items():
        here = (mod if package else mod.rsplit(".", 1)[0]).split(".")
        deps = set()
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.ImportFrom):
                base = ".".join(here[: len(here) - n.level + 1]) if n.level else ""
                target = ".".join(p for p in (base, n.module or "") if p)
                for a in n.names:
                    sub = f"{target}.{a.name}"
                    deps.add(sub if sub in mods else target)
            elif isinstance(n, ast.Import):
                deps.update(a.name for a in n.names)
        graph[mod] = {d for d in deps if d in mods and d != mod and d != "smallbatch"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's circles (strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(mod: str) -> int:
    if mod == "smallbatch":  # the package itself: its public API (smallbatch.results) may import any layer
        return -1
    parts = mod.split(".")
    name = parts[1] if len(parts) > 2 or _modules()[mod][1] or parts[1] == "__main__" else "core"
    for i, group in enumerate(LAYERS):
        if name in group.split("|"):
            return i
    return LAYERS.index("core")


def test_the_package_has_no_import_circle():
    assert cycles(import_graph()) == []


def test_a_cycle_is_found():  # the check can fail
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_each_layer_imports_only_layers_below_it():
    up = sorted(f"{m} -> {d}" for m, deps in import_graph().items() for d in deps if layer(d) < layer(m))
    assert up == [], "imports against the layers of ARCHITECTURE.md"


def test_only_the_tracking_package_imports_mlflow():
    """ARCHITECTURE.md: only ``smallbatch.tracking`` talks to MLflow (any import, also one inside a
    function), and the rest of the package reads it through its public names alone."""
    outside = []
    for mod, (path, _) in _modules().items():
        for n in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in n.names] if isinstance(n, ast.Import) else []
            names += [n.module or ""] if isinstance(n, ast.ImportFrom) and not n.level else []
            if any(x.split(".")[0] == "mlflow" for x in names) and not mod.startswith("smallbatch.tracking"):
                outside.append(mod)
    assert outside == [] and any(m.startswith("smallbatch.tracking.") for m in _modules())
    inside = sorted(
        f"{m} -> {d}"
        for m, deps in import_graph().items()
        for d in deps
        if d.startswith("smallbatch.tracking.") and not m.startswith("smallbatch.tracking")
    )
    assert inside == [], "the rest of the package imports smallbatch.tracking, never its modules"
