"""The package's import graph: no cycle, no layer importing a higher one, no function-level imports.

Layers, lowest first (a module may import its own layer and the ones below):

    0  scrubnet._config, scrubnet.atomic_io, scrubnet.integrity, scrubnet.device
    1  scrubnet.models, scrubnet.data
    2  scrubnet.training, scrubnet.recipe, scrubnet.curvature, scrubnet.diagnostics
    3  scrubnet.methods, scrubnet.mlforget, scrubnet.readouts, scrubnet.checkpoint, scrubnet.privacy
    4  scrubnet.scrub (the one scrub path), scrubnet.experiments, scrubnet.audit (a pool of experiments),
       scrubnet.api (scrubnet.forget), scrubnet.serve (the HTTP service), scrubnet.own_model (scrubbing the user's
       own model files)
    5  scrubnet.cli (the package: one module per command group)

plus: methods never import readouts (scrub, then measure), and data/models/curvature/training never import
checkpoint IO. Imports inside functions are allowed only for optional dependencies.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import scrubnet

ROOT = Path(scrubnet.__file__).parent
LAYERS = {"scrubnet._config": 0, "scrubnet.atomic_io": 0, "scrubnet.integrity": 0, "scrubnet.device": 0,
          "scrubnet.models": 1, "scrubnet.data": 1,
          "scrubnet.training": 2, "scrubnet.recipe": 2, "scrubnet.curvature": 2,
          "scrubnet.diagnostics": 2,
          "scrubnet.methods": 3, "scrubnet.mlforget": 3, "scrubnet.readouts": 3, "scrubnet.checkpoint": 3,
          "scrubnet.privacy": 3,
          "scrubnet.scrub": 4, "scrubnet.experiments": 4, "scrubnet.audit": 4, "scrubnet.api": 4, "scrubnet.cost_guard": 4, "scrubnet.serve": 4,
          "scrubnet.own_model": 4, "scrubnet.tuning": 4,
          "scrubnet.cli": 5}
FORBIDDEN = [("scrubnet.methods", "scrubnet.readouts")]
OPTIONAL_DEPENDENCIES = {"PIL", "tomli", "tomllib", "ray", "starlette", "uvicorn", "cryptography", "transformers",
                         "peft", "tokenizers", "faker"}
# heavy third-party libraries imported where they are used, so that a command's start-up does not pay for
# them (scikit-learn, scipy, matplotlib and mnist1d cost ≈ 2 s of the 3.5 s of `scrubnet config --dump`);
# never a scrubnet module, so the layer checks below still see every edge
DEFERRED_FOR_STARTUP = {"sklearn", "scipy", "matplotlib", "mnist1d"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def layer_of(mod: str) -> tuple[str, int] | None:
    for prefix, rank in sorted(LAYERS.items(), key=lambda kv: -len(kv[0])):
        if mod == prefix or mod.startswith(prefix + "."):
            return prefix, rank
    return None


def scan(source: str, name: str) -> tuple[set[str], list[str]]:
    """(scrubnet modules imported at module level, descriptions of function-level imports)."""
    tree = ast.parse(source)
    top, nested = set(), []
    is_pkg = False

    def targets(node) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name for a in node.names]
        base = node.module or ""
        if node.level:
            pkg = name if is_pkg else name.rsplit(".", 1)[0]
            for _ in range(node.level - 1):
                pkg = pkg.rsplit(".", 1)[0]
            base = f"{pkg}.{base}" if base else pkg
        return [base] + [f"{base}.{a.name}" for a in node.names]

    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        mods = targets(node)
        if node in tree.body or any(node in getattr(b, "body", []) + getattr(b, "orelse", [])
                                    for b in tree.body if isinstance(b, (ast.If, ast.Try))):
            top.update(m for m in mods if m.startswith("scrubnet"))
        elif mods[0].split(".")[0] not in OPTIONAL_DEPENDENCIES | DEFERRED_FOR_STARTUP:
            nested.append(f"{name}:{node.lineno} imports {mods[0]} inside a function")
    return top, nested


def graph() -> tuple[dict[str, set[str]], list[str]]:
    files = {module_name(p): p for p in ROOT.rglob("*.py")}
    edges, nested = {}, []
    for name, path in files.items():
        mods, nest = scan(path.read_text(), name)
        nested += nest
        # keep only targets that are modules: ``from pkg import sub`` is an edge to pkg.sub, not to pkg
        targets = {m for m in mods if m in files}
        targets -= {m.rsplit(".", 1)[0] for m in targets}
        targets |= {m.rsplit(".", 1)[0] for m in mods if m not in files and m.rsplit(".", 1)[0] in files}
        edges[name] = {m for m in targets if m != name}
    return edges, nested


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """A cycle among modules (package __init__ re-exports included), or None."""
    color, stack = {}, []

    def visit(u):
        color[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ())):
            if color.get(v) == 1:
                return stack[stack.index(v):] + [v]
            if color.get(v) is None:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        color[u] = 2
        return None

    for u in sorted(edges):
        if color.get(u) is None:
            found = visit(u)
            if found:
                return found
    return None


def layer_violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, dsts in edges.items():
        ls = layer_of(src)
        for dst in dsts:
            ld = layer_of(dst)
            if ls is None or ld is None:
                continue
            if ld[1] > ls[1]:
                bad.append(f"{src} (layer {ls[1]}) imports {dst} (layer {ld[1]})")
            for a, b in FORBIDDEN:
                if layer_of(src)[0] == a and ld[0] == b:
                    bad.append(f"{src} imports {dst}: {a} must not import {b}")
    return bad


def test_no_import_cycle():
    edges, _ = graph()
    assert find_cycle(edges) is None, " → ".join(find_cycle(edges))


def test_no_layer_violation():
    edges, _ = graph()
    assert layer_violations(edges) == []


def test_no_function_level_imports():
    _, nested = graph()
    assert nested == []


def test_every_module_has_a_layer():
    edges, _ = graph()
    assert [m for m in edges if m != "scrubnet" and layer_of(m) is None] == []


@pytest.mark.parametrize("edges, cycle", [({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
                                          ({"a": {"b"}, "b": {"c"}, "c": set()}, False)])
def test_cycle_finder(edges, cycle):
    assert (find_cycle(edges) is not None) == cycle


def test_checks_catch_violations():
    edges = {"scrubnet.training": {"scrubnet.checkpoint"}, "scrubnet.methods.fisher": {"scrubnet.readouts.basic"},
             "scrubnet.readouts.basic": {"scrubnet.training"}}
    bad = layer_violations(edges)
    assert any("scrubnet.training (layer 2)" in b for b in bad)
    assert any("must not import scrubnet.readouts" in b for b in bad)
    _, nested = scan("def f():\n    from scrubnet.methods import fisher\n    import PIL\n    from scipy import stats\n"
                     "    import numpy\n", "scrubnet.x")
    assert nested == ["scrubnet.x:2 imports scrubnet.methods inside a function",
                      "scrubnet.x:5 imports numpy inside a function"]
