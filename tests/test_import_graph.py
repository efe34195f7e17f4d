"""The package's import graph (issue 17): no circles, dependencies one way (autograd -> functional
-> encodings -> attention -> curriculum -> callbacks -> recipes), attention never imports a concrete
encoding; `functional` is formulas only, no autograd Function.

Every module is parsed (imports inside functions included) and each intra-package import resolved
to the module it loads. `GRAPH` leaves out the imports under ``if TYPE_CHECKING`` (they never run);
`TYPED_GRAPH` keeps them: a circle through a type annotation is still a circle for a reader."""

from __future__ import annotations

import ast
from pathlib import Path

import posenc_lightning

ROOT = Path(posenc_lightning.__file__).parent
PKG = "posenc_lightning"


def _module_name(path: Path) -> str:
    parts = (PKG, *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _resolve(name: str) -> str | None:
    """The package module ``name`` loads (its longest existing prefix), None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _type_checking_only(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return skip


def _imports(module: str, type_checking: bool = False) -> set[str]:
    """The package modules ``module`` imports (with ``type_checking``: those under ``if TYPE_CHECKING`` too)."""
    tree = ast.parse(MODULES[module].read_text(), str(MODULES[module]))
    skip, out = (set() if type_checking else _type_checking_only(tree)), set()
    is_pkg = MODULES[module].name == "__init__.py"
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                pkg = module.split(".") if is_pkg else module.split(".")[:-1]
                base = ".".join(pkg[:len(pkg) - node.level + 1] + ([base] if base else []))
            # ``from a import b`` loads the module a.b when there is one, else a
            out |= {f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names}
    return {r for r in map(_resolve, out) if r is not None and r != module}


GRAPH = {m: _imports(m) for m in MODULES}
TYPED_GRAPH = {m: _imports(m, type_checking=True) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
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


def _layer(module: str) -> str:
    """The top-level part of the package a module belongs to (``attention``, ``inject``, ...)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def test_the_graph_is_read_from_the_source():
    """The walker sees module-level, function-local and package-level imports (so the checks
    below cannot pass by seeing nothing)."""
    assert len(MODULES) > 60
    assert "posenc_lightning.attention.backends.sdpa" in GRAPH["posenc_lightning.attention.mixin"] or \
        "posenc_lightning.attention.backends" in GRAPH["posenc_lightning.attention.mixin"]
    assert "posenc_lightning.kernels.fused" in GRAPH["posenc_lightning.attention.backends.triton"]  # local import
    assert "posenc_lightning.callbacks" in GRAPH["posenc_lightning"]  # lazy, inside __getattr__
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_between_modules():
    assert _cycles(GRAPH) == []


def test_type_checking_imports_are_read():
    """`TYPED_GRAPH` holds the imports under ``if TYPE_CHECKING`` that `GRAPH` leaves out."""
    registry = f"{PKG}.encodings.registry"  # imports `Encoding` for its annotations only
    assert f"{PKG}.encodings.base" in TYPED_GRAPH[registry] - GRAPH[registry]
    assert all(GRAPH[m] <= TYPED_GRAPH[m] for m in MODULES)


def test_no_import_cycles_type_checking_included():
    assert _cycles(TYPED_GRAPH) == []


def test_no_import_cycles_between_parts_of_the_package():
    """Collapsed to its parts (encodings, attention, callbacks, curriculum, eval, ...), the graph
    is still acyclic: e.g. eval never imports callbacks, which import eval."""
    parts: dict[str, set[str]] = {}
    for m, deps in GRAPH.items():
        if m == PKG:  # the top-level API imports every part
            continue
        parts.setdefault(_layer(m), set()).update(_layer(d) for d in deps if _layer(d) != _layer(m) and d != PKG)
    assert _cycles(parts) == []


def test_dependencies_point_one_way():
    """Lower parts never import upper ones."""
    order = ["autograd", "functional", "encodings", "kernels", "attention", "adapters", "inject", "models", "curriculum", "callbacks",
             "recipes", "cli"]
    rank = {p: i for i, p in enumerate(order)}
    bad = [f"{m} -> {d}" for m, deps in GRAPH.items() for d in deps
           if _layer(m) in rank and _layer(d) in rank and rank[_layer(d)] > rank[_layer(m)]]
    assert bad == []


def test_attention_never_imports_a_concrete_encoding():
    allowed = {f"{PKG}.encodings.base", f"{PKG}.encodings.bias"}
    bad = [f"{m} -> {d}" for m, deps in GRAPH.items() if _layer(m) in ("attention", "kernels")
           for d in deps if _layer(d) == "encodings" and d not in allowed]
    assert bad == []


def test_functional_is_formulas_without_autograd_functions():
    """`functional/` is the papers' formulas; a hand-written backward lives in `autograd/` (shared by
    the formulas) or with its encoding (`encodings/fire/`, `encodings/cope/`)."""
    def functions(path: Path) -> list[str]:
        tree = ast.parse(path.read_text())
        return [f"{path.name}:{node.name}" for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                and any("Function" in ast.unparse(base) for base in node.bases)]

    assert functions(ROOT / "autograd" / "rotary.py")  # the check sees a Function where there is one
    assert [f for p in sorted((ROOT / "functional").glob("*.py")) for f in functions(p)] == []
    # autograd imports nothing of the package but itself: the rotations' Triton launches, on CUDA only
    assert GRAPH[f"{PKG}.autograd.rotary"] == {f"{PKG}.autograd.rotary_triton"}
    assert GRAPH[f"{PKG}.autograd.lie"] == {f"{PKG}.autograd.lie_triton"}
    assert GRAPH[f"{PKG}.autograd.rotary_triton"] == set() and GRAPH[f"{PKG}.autograd.lie_triton"] == set()



def test_the_generic_bias_package_imports_no_encoding():
    """`encodings/bias/` is the protocol every kind plugs into (issue 46): none of its modules imports
    an encoding family (`encodings/fire/` included), at the top, inside a function or for typing; a
    kind registers itself from its own file (`register_opaque_kind`, `register_tile_kind`)."""
    bias = f"{PKG}.encodings.bias"
    own = {m for m in MODULES if m == bias or m.startswith(bias + ".")}
    assert f"{bias}.kinds" in own and f"{bias}.tile" in own
    bad = [f"{m} -> {d}" for m in sorted(own) for d in sorted(TYPED_GRAPH[m]) if _layer(d) == "encodings" and d not in own]
    assert bad == []
