"""The package's layout holds: layers import downward only, no import cycle, no file past 700 lines, and
every third-party module the package imports is a declared dependency.

Imports are read from the source (module-level and those inside functions alike), so a lazy import that
climbs a layer is caught too."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mhar_ablate"

# Lowest first. A module may import from its own layer and those below it, never from above.
LAYERS = [
    {"", "errors", "ranges", "io", "redaction", "console", "processes", "provenance"},
    {"kernels"},
    {"ops", "norm"},
    {"variants"},
    {"config"},
    {"model"},
    {"data"},
    {"training"},
    {"evaluation"},
    {"sweep"},
    {"reporting"},
    {"bench"},
    {"interop"},
    {"cli", "__main__"},
]
MAX_LINES = 700

# Import names of the package's dependencies (pyproject.toml) where they differ from the distribution's.
IMPORT_NAMES = {"pyyaml": "yaml", "psycopg[binary]": "psycopg", "lm-eval": "lm_eval", "liger-kernel": "liger_kernel",
                "huggingface_hub": "huggingface_hub"}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(name: str, path: Path) -> set[str]:
    """The package modules that ``name`` imports (a ``from X import y`` naming a submodule counts as it)."""
    is_pkg = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in MODULES else target)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
    return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _layer(module: str) -> int:
    top = module.split(".")[1] if "." in module else ""
    for i, layer in enumerate(LAYERS):
        if top in layer:
            return i
    raise AssertionError(f"{module}: its top-level name {top!r} is in no layer of this test; add it to LAYERS")


def test_every_module_has_a_layer():
    for module in MODULES:
        _layer(module)


def test_layers_import_downward_only():
    upward = [f"{a} -> {b}" for a, targets in GRAPH.items() for b in targets if _layer(b) > _layer(a)]
    assert not upward, "imports from a lower layer back up:\n" + "\n".join(sorted(upward))


def test_no_import_cycle():
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_checks_see_a_cycle_and_an_upward_import(monkeypatch):
    """The two checks above are not vacuous: a graph with a cycle and a climb fails them."""
    fake = dict(GRAPH)
    fake["mhar_ablate.errors"] = GRAPH["mhar_ablate.errors"] | {"mhar_ablate.cli.main"}
    monkeypatch.setattr(sys.modules[__name__], "GRAPH", fake)
    with pytest.raises(AssertionError, match="lower layer back up"):
        test_layers_import_downward_only()
    with pytest.raises(AssertionError, match="import cycles"):
        test_no_import_cycle()


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_file_past_the_limit(path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, f"{path.relative_to(ROOT)} has {n} lines; split it by concept (at most {MAX_LINES})"


def _declared() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text()
    names = set()
    for spec in re.findall(r'"([A-Za-z0-9_.\-\[\]]+)\s*[<>=!~;]', text):
        dist = spec.lower()
        names.add(IMPORT_NAMES.get(dist, dist.split("[")[0].replace("-", "_")))
    return names


def test_every_imported_library_is_declared():
    stdlib = set(sys.stdlib_module_names)
    declared = _declared()
    missing = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for name in names:
                top = name.split(".")[0]
                if top and top not in stdlib and top != "mhar_ablate" and top not in declared:
                    missing.setdefault(top, module)
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
