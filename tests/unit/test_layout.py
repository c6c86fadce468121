"""The package's shape: no import circle among its modules (lazy imports inside functions included: they hide a
circle, they do not remove it), and no module over 400 lines."""
from __future__ import annotations

import ast
from pathlib import Path

import drafttrain

ROOT = Path(drafttrain.__file__).parent
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it imports anywhere in its body (`from a.b import c`: a.b.c if that is a
    module, else a.b)."""
    mods = _modules()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in mods}
            elif isinstance(node, ast.ImportFrom) and node.module in mods and node.level == 0:
                subs = {f"{node.module}.{a.name}" for a in node.names} & mods.keys()
                deps |= subs if len(subs) == len(node.names) else subs | {node.module}
        graph[name] = deps - {name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "drafttrain.tracking.tracker" in graph and graph["drafttrain.rl.hooks"] == {"drafttrain.tracking.tracker"}
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def test_the_package_imports_without_vllm():
    """vLLM is an optional extra and heavy to import (every spawned process of a multi-process run pays it):
    only an engine.kind=vllm build imports it."""
    import subprocess
    import sys

    code = ("import sys, drafttrain.engines, drafttrain.tracking.tracker, drafttrain.rl.job, drafttrain.online; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('drafttrain.engines.vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout
