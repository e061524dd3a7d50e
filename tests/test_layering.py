"""The package's layering, read from the source: no import from a lower layer to a higher one and no
import cycle between modules, counting the imports inside functions (docs/architecture.md).

Layers, lowest first: errors < compiler < ops < runtime < layers < tasks < train < bench < search < study
< export < cli. A stage's ``commands.py`` / ``*_commands.py`` is the command line's face of that
stage and belongs to the cli layer, as does the ``ssmcraft`` package itself. ``import ssmcraft``
counts as an import of what is used from it (``ssmcraft.compile`` is ``ssmcraft.runtime.objective``,
through the package's lazy table).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("errors", "compiler", "ops", "runtime", "layers", "tasks", "train", "bench", "search", "study", "export",
          "cli")


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted((ROOT / "ssmcraft").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _lazy_table() -> dict[str, str]:
    """``ssmcraft.__init__._LAZY``: attribute -> module, read from its source."""
    tree = ast.parse(MODULES["ssmcraft"].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "_LAZY" for t in node.targets):
            return {k: v[0] for k, v in ast.literal_eval(node.value).items()}
    raise AssertionError("ssmcraft/__init__.py has no _LAZY table")


LAZY = _lazy_table()


def layer(module: str) -> str:
    leaf = module.rsplit(".", 1)[-1]
    if module in ("ssmcraft", "ssmcraft.cli", "ssmcraft.__main__") or leaf == "commands" or leaf.endswith("_commands"):
        return "cli"
    if module in ("ssmcraft.yamlsafe", "ssmcraft.config_check", "ssmcraft.modpath", "ssmcraft.fileio"):
        return "errors"                               # reading and checking specs, writing files: below all
    return module.split(".")[1]


def imports(module: str) -> set[str]:
    """Every ssmcraft module ``module`` imports, at the top level or inside a function."""
    path = MODULES[module]
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out: set[str] = set()

    def add(name: str, attr: str | None = None):
        if name == "ssmcraft" and attr is not None:
            if attr in LAZY:
                out.add(LAZY[attr])
            elif f"ssmcraft.{attr}" in MODULES:
                out.add(f"ssmcraft.{attr}")
            return                                   # a constant of the package (its version)
        full = f"{name}.{attr}" if attr else name
        out.add(full if full in MODULES else name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "ssmcraft":
                    bound = alias.asname or "ssmcraft"
                    for use in ast.walk(tree):
                        if isinstance(use, ast.Attribute) and getattr(use.value, "id", None) == bound:
                            add("ssmcraft", use.attr)
                elif alias.name.startswith("ssmcraft."):
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name == "ssmcraft" or name.startswith("ssmcraft."):
                for alias in node.names:
                    add(name, alias.name)
    return {m for m in out if m in MODULES and m != module}


GRAPH = {m: imports(m) for m in MODULES}


def test_every_module_has_a_known_layer():
    unknown = sorted(m for m in MODULES if layer(m) not in LAYERS)
    assert unknown == [], f"modules outside the layers {LAYERS}: {unknown}"


def test_no_import_goes_up_a_layer():
    rank = {name: i for i, name in enumerate(LAYERS)}
    upward = sorted(f"{m} ({layer(m)}) imports {d} ({layer(d)})" for m, deps in GRAPH.items() for d in deps
                    if rank[layer(d)] > rank[layer(m)])
    assert upward == [], "imports from a lower layer to a higher one:\n" + "\n".join(upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    cycles = _cycles(GRAPH)
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("graph, found", [
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"b"}, "b": set()}, []),
])
def test_the_cycle_finder_finds_cycles(graph, found):
    assert _cycles(graph) == found


def test_function_level_and_lazy_imports_are_counted():
    """The reader sees an import inside a function and ``ssmcraft.compile`` through the lazy table."""
    assert "ssmcraft.runtime.objective" in GRAPH["ssmcraft.compiler.commands"]      # ssmcraft.compile(...)
    assert "ssmcraft.runtime.select" in GRAPH["ssmcraft.runtime.objective"]          # inside triton_runner


def test_every_package_folder_has_an_init():
    """setuptools' ``packages.find`` (pyproject.toml) ships only folders with an ``__init__.py``."""
    missing = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "ssmcraft").rglob("*")
                     if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py")) and not (p / "__init__.py").is_file())
    assert missing == [], f"folders of modules without __init__.py: {missing}"
