"""The package's import graph, read from the source (ast, every import, also those inside a
function): no circle, and each layer imports only the layers below it (ARCHITECTURE.md)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import smallbatch

SRC = Path(smallbatch.__file__).parent
#: a layer may import its own modules and those of the layers listed after it ("core": the
#: package's top-level modules, io and errors); a package must be named in one of them
LAYERS = (
    "pipeline|__main__",
    "local",
    "report",
    "mi",
    "evaluation",
    "training",
    "study",
    "data|losses|tracking",
    "core",
)


@functools.cache  # read once: every check below walks it, some once per import
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
    raise AssertionError(f"smallbatch.{name} is in no layer of LAYERS (ARCHITECTURE.md): place it there")


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


#: third-party packages whose import costs start-up time (0.1-3 s each): the only reason a package
#: module is imported inside a function (ARCHITECTURE.md, "Imports inside functions")
HEAVY = {"torch", "torchvision", "mlflow", "pandas", "matplotlib", "seaborn", "faiss", "sklearn", "scipy", "numpy"}


#: the command's own module imports each subcommand's modules in that subcommand: every job's
#: client (and ``smallbatch --version``) starts it, so it imports nothing it does not need
COMMAND_MODULES = {"smallbatch.pipeline.cli", "smallbatch.__main__"}


def _imports(path: Path, at_import: bool) -> list[ast.Import | ast.ImportFrom]:
    """The imports a module runs when it is imported (``at_import``: module and class bodies,
    not ``if TYPE_CHECKING:``), or those inside its functions."""
    found: list[ast.Import | ast.ImportFrom] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.Import | ast.ImportFrom) and in_function != at_import:
                found.append(child)
            visit(child, in_function or isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef))

    visit(ast.parse(path.read_text()), False)
    return found


def _targets(mod: str, node: ast.Import | ast.ImportFrom) -> set[str]:
    """What an import reaches: package modules, third-party roots, and ``pkg:lazy`` for a name a
    package's ``__getattr__`` loads on first use."""
    mods = _modules()
    if isinstance(node, ast.Import):
        return {a.name if a.name in mods else a.name.split(".")[0] for a in node.names}
    if not node.level:
        return {node.module if node.module in mods else (node.module or "").split(".")[0]}
    path, package = mods[mod]
    here = (mod if package else mod.rsplit(".", 1)[0]).split(".")
    target = ".".join(p for p in (".".join(here[: len(here) - node.level + 1]), node.module or "") if p)
    out = set()
    for a in node.names:
        sub = f"{target}.{a.name}"
        lazy = target in mods and mods[target][1] and "def __getattr__" in mods[target][0].read_text()
        out.add(sub if sub in mods else f"{target}:lazy" if lazy else target)
    return out


def _loads_heavy() -> dict[str, bool]:
    """module -> whether importing it loads one of HEAVY (through the package's own imports too)."""
    mods = _modules()
    direct = {m: set().union(*[_targets(m, n) for n in _imports(p, True)]) for m, (p, _) in mods.items()}
    heavy: dict[str, bool] = {}

    def loads(m: str, seen: frozenset = frozenset()) -> bool:
        if m not in heavy:
            deps = {d for d in direct[m] if d in mods and d not in seen}
            heavy[m] = bool(direct[m] & HEAVY) or any(loads(d, seen | {m}) for d in deps)
        return heavy[m]

    return {m: loads(m) for m in mods}


def _reaches(graph: dict[str, set[str]], start: str, goal: str) -> bool:
    todo, seen = [start], set()
    while todo:
        m = todo.pop()
        if m == goal:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(graph.get(m, ()))
    return False


def test_a_module_is_imported_inside_a_function_only_to_keep_start_up_light():
    """An import inside a function hides the graph from a reader; it is there only when the module
    it imports loads torch, MLflow, pandas, ... (``smallbatch cells``, config validation and the
    report start without them) or when importing it at the top would close a circle."""
    mods, heavy = _modules(), _loads_heavy()
    mods_checked = {m: v for m, v in mods.items() if m not in COMMAND_MODULES}
    top = {m: {d for n in _imports(p, True) for d in _targets(m, n) if d in mods} for m, (p, _) in mods.items()}
    needless = sorted(
        f"{m} -> {d}"
        for m, (p, _) in mods_checked.items()
        for n in _imports(p, False)
        for d in _targets(m, n)
        if d in mods and d != m and not heavy[d] and not _reaches(top, d, m)
    )
    assert needless == [], "import these at the top of the module"


def test_the_start_up_check_tells_light_modules_from_heavy_ones_and_finds_circles():  # the test above can fail
    assert not _loads_heavy()["smallbatch.study.experiments"] and _loads_heavy()["smallbatch.data.load"]
    assert _reaches({"a": {"b"}, "b": {"c"}}, "a", "c") and not _reaches({"a": {"b"}, "c": {"a"}}, "a", "c")
