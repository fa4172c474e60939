"""The package imports only downward: no import circle, and no import from a layer to one above it.

Every module under ``dflash_mlx`` is parsed with ``ast`` (not imported): imports at module level and
lazy ones inside functions alike, package ``__init__``s included, relative imports resolved.
Importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b``, so it counts as importing them
too (a module's own packages excepted: they are initialised before it runs).

``LAYERS`` is the map written at the top of docs/design.md, lowest first. Each layer holds groups;
a group is one module, or a package with everything under it, or a tuple of those that work
together. A module may import any module in a lower layer and any in its own group; not one in a
higher layer, nor another group of its own layer. Every module must be on the map, so a new one is
placed when it is added.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Set, Tuple

PACKAGE = "dflash_mlx"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE

LAYERS: List[Tuple[str, List]] = [
    ("leaves", ["paths", ("errors", "checkpoint_files"), "quant", "records", "device", "kernels", "sampling",
                "reasoning", "block_policy"]),
    ("quantized matmuls, caches, the cycle-cost model, text from commits, grammars",
     [("quantized", "traffic", "splash"), "cache", "responses", ("grammar", "grammar_formats")]),
    ("models, the prompt cache", ["models", "prompt_cache"]),
    ("the prompt cache's disk tier", ["prompt_store"]),
    ("loading", ["loading"]),
    ("converters, decode loops, pipeline", ["convert", "target_conversion", ("prefill", "decoder", "driver", "speculative"),
                                            "pipeline"]),
    ("where a request runs", ["runner"]),
    ("named models", ["defaults"]),
    ("api", ["api"]),
    ("batched requests", ["scheduler"]),
    ("what the front ends use", ["doctor", "chat", "bench", "train", ("tiny", "scripted", "agents")]),
    ("server", ["server"]),
    ("command line, the package's lazy exports", ["cli", PACKAGE]),
]


def modules(root: Path = ROOT) -> Dict[str, Path]:
    """Dotted name -> file, for every module of the package (a package is named by its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name,) + path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imported(node: ast.AST, module: str, is_package: bool) -> Iterable[str]:
    """The dotted names an import statement (or ``importlib.import_module("...")``) may load."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base = module.split(".") if is_package else module.split(".")[:-1]
            base = base[: len(base) - (node.level - 1)]
            stem = ".".join(base + ([node.module] if node.module else []))
        else:
            stem = node.module or ""
        return [stem] + [f"{stem}.{alias.name}" for alias in node.names]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        name = node.args[0].value
        if name.startswith("."):
            package = node.args[1].value if len(node.args) > 1 and isinstance(node.args[1], ast.Constant) else module
            return list(_imported(ast.ImportFrom(module=name.lstrip(".") or None, names=[],
                                                 level=len(name) - len(name.lstrip("."))), package, True))
        return [name]
    return []


def import_graph(root: Path = ROOT) -> Dict[str, Set[str]]:
    """Module -> the package's modules it imports (lazily or not), with the packages that runs."""
    mods = modules(root)
    graph: Dict[str, Set[str]] = {m: set() for m in mods}
    for module, path in mods.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for name in _imported(node, module, is_package):
                while name and name not in mods:  # ``from .x import Class``: the module x
                    name = name.rpartition(".")[0]
                while name:
                    if name != module and not module.startswith(name + "."):
                        graph[module].add(name)
                    name = name.rpartition(".")[0]
    return graph


def cycles(graph: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def place(module: str) -> Optional[Tuple[int, int]]:
    """(layer, group) of a module on the map; None when the map leaves it out."""
    best, where = -1, None
    for layer, (_, groups) in enumerate(LAYERS):
        for group, members in enumerate(groups):
            for member in members if isinstance(members, tuple) else (members,):
                name = member if member == PACKAGE else f"{PACKAGE}.{member}"
                # the most specific entry wins (the root package names only its own __init__)
                if (module == name or (member != PACKAGE and module.startswith(name + "."))) and len(name) > best:
                    best, where = len(name), (layer, group)
    return where


def violations(graph: Dict[str, Set[str]]) -> List[str]:
    """Every module off the map, and every import that is not downward (or within a group)."""
    out = [f"{m} is not on the layer map (tests/test_layers.py LAYERS, docs/design.md)"
           for m in sorted(graph) if place(m) is None]
    for module in sorted(graph):
        here = place(module)
        for target in sorted(graph[module]):
            there = place(target)
            if here is None or there is None or there[0] < here[0] or there == here:
                continue
            what = "up" if there[0] > here[0] else "across"
            out.append(f"{module} ({LAYERS[here[0]][0]}) imports {what} to {target} ({LAYERS[there[0]][0]})")
    return out


def test_no_import_circle():
    found = cycles(import_graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_imports_only_go_down_the_layers():
    found = violations(import_graph())
    assert not found, "imports against the layer map:\n" + "\n".join(found)


def test_the_map_is_the_one_in_the_design_notes():
    text = (ROOT.parent / "docs" / "design.md").read_text()
    for name, groups in LAYERS:
        for members in groups:
            for member in members if isinstance(members, tuple) else (members,):
                assert f"`{member}`" in text, f"docs/design.md's layer map does not name {member}"


def test_the_checker_sees_lazy_imports_and_circles(tmp_path):
    """The graph counts an import inside a function, a relative one and the packages it runs, and a
    circle through them is found (so the two tests above can fail)."""
    pkg = tmp_path / PACKAGE
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from .inner import x\n")
    (pkg / "sub" / "inner.py").write_text("def f():\n    from .. import low\n")
    (pkg / "low.py").write_text("def g():\n    import importlib\n    importlib.import_module('dflash_mlx.sub.inner')\n")
    graph = import_graph(pkg)
    assert graph[f"{PACKAGE}.sub.inner"] == {f"{PACKAGE}.low"}
    assert graph[f"{PACKAGE}.low"] == {f"{PACKAGE}.sub", f"{PACKAGE}.sub.inner"}
    assert cycles(graph) == [[f"{PACKAGE}.low", f"{PACKAGE}.sub", f"{PACKAGE}.sub.inner"]]
    up = {f"{PACKAGE}.paths": {f"{PACKAGE}.api"}, f"{PACKAGE}.api": set(), f"{PACKAGE}.convert": {f"{PACKAGE}.speculative"},
          f"{PACKAGE}.speculative": set(), f"{PACKAGE}.nowhere": set()}
    assert violations(up) == [
        f"{PACKAGE}.nowhere is not on the layer map (tests/test_layers.py LAYERS, docs/design.md)",
        f"{PACKAGE}.convert (converters, decode loops, pipeline) imports across to {PACKAGE}.speculative "
        "(converters, decode loops, pipeline)",
        f"{PACKAGE}.paths (leaves) imports up to {PACKAGE}.api (api)",
    ]
