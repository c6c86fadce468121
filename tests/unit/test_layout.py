"""The package's shape: no import circle among its modules or its packages, no module over 400 lines and no function
over 80. An edge is
every way one module makes Python run another: an import anywhere in its body (lazy imports inside functions hide a
circle, they do not remove it), a module named in a string ("drafttrain.engines.vllm_forms:EAGLE3" for importlib, a
vLLM class path), and the __init__ of each package above an imported module that the importer is not inside."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import drafttrain

ROOT = Path(drafttrain.__file__).parent
MAX_LINES = 400
MAX_FUNCTION_LINES = 80  # a function reads on one screen: longer ones split into named steps
NAMED = re.compile(r"drafttrain(\.\w+)+(:\w+)?")  # a whole string naming a module (optionally ":attribute")
# Known edges that still close a circle, each with the reason it stays: (importer, imported). Empty: keep it so.
ALLOWED: set[tuple[str, str]] = set()


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = p.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


def _named(text: str, mods) -> str | None:
    """The package module a string names ("a.b.c", "a.b:NAME", "a.b.Class": the longest module prefix), or None."""
    if not NAMED.fullmatch(text.strip()):
        return None
    name = text.strip().split(":")[0]
    while name not in mods and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in mods and name != "drafttrain" else None


def _packages_above(name: str) -> set[str]:
    """The packages whose __init__ runs before module `name` (the root's excepted: every module sits below it)."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(2, len(parts))}


def import_graph() -> dict[str, set[str]]:
    """module -> the package modules it makes Python run, anywhere in its body (`from a.b import c`: a.b.c if that
    is a module, else a.b; a string naming a module; the packages above each, outside the importer's own)."""
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
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and (m := _named(node.value, mods)):
                deps.add(m)
        own = _packages_above(name) | {name}
        deps |= {p for d in deps for p in _packages_above(d) if p in mods and p not in own}
        graph[name] = {d for d in deps - {name} if (name, d) not in ALLOWED}
    return graph


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same edges between the package's top-level parts (drafttrain.drafters, drafttrain.engines, ...)."""
    top = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        out.setdefault(top(m), set()).update(top(d) for d in deps if top(d) != top(m))
    return out


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


def test_the_graph_sees_lazy_imports_named_modules_and_packages(tmp_path, monkeypatch):
    graph = import_graph()
    assert "drafttrain.tracking.tracker" in graph and graph["drafttrain"] == {  # the root's lazy __getattr__ import
        "drafttrain.tracking.tracker", "drafttrain.tracking"}
    assert "drafttrain.engines.vllm_suffix" in graph["drafttrain.engines.vllm_forms"]  # a class path in a string
    assert "drafttrain.engines" in graph["drafttrain.tracking.deliverable"]  # a lazy import, and its package
    assert "drafttrain.drafters" not in graph["drafttrain.drafters.base"]  # a module's own package is no edge
    # a circle closed only inside a function, or only by a string, is found
    pkg = tmp_path / "drafttrain"
    (pkg / "low").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "__init__.py").write_text("from drafttrain.low import a\n")
    (pkg / "low" / "a.py").write_text("def f():\n    import importlib\n    return importlib.import_module('x')\n")
    (pkg / "high.py").write_text("from drafttrain.low.a import f\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", pkg)
    assert find_cycle(import_graph()) is None
    (pkg / "low" / "a.py").write_text("def f():\n    from drafttrain import high\n")
    assert find_cycle(import_graph()) == ["drafttrain.high", "drafttrain.low", "drafttrain.low.a", "drafttrain.high"]
    (pkg / "low" / "a.py").write_text("HOOK = 'drafttrain.high:f'\n")
    assert find_cycle(import_graph()) == ["drafttrain.high", "drafttrain.low", "drafttrain.low.a", "drafttrain.high"]


def test_the_package_has_no_import_circle():
    graph = import_graph()
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)
    cycle = find_cycle(package_graph(graph))  # e.g. drafters naming an engine module that imports drafters
    assert cycle is None, " -> ".join(cycle)


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT.parent)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> dict[str, int]:
    """Each function (or method) in `source` longer than `limit` lines, def line to last line, by qualified name."""
    out: dict[str, int] = {}

    def walk(node, prefix=""):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                n = child.end_lineno - child.lineno + 1
                if not isinstance(child, ast.ClassDef) and n > limit:
                    out[name] = n
                walk(child, name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(source))
    return out


def test_long_functions_finds_a_long_method_and_a_nested_one():
    body = "\n".join(f"        x{i} = {i}" for i in range(80))
    inner = "\n".join("    " + line for line in body.splitlines())
    src = f"class A:\n    def f(self):\n{body}\n\n    def g(self):\n        def h():\n{inner}\n        return h\n"
    assert long_functions(src) == {"A.f": 81, "A.g": 83, "A.g.h": 81}
    assert long_functions(src, limit=90) == {}


def test_no_function_is_over_80_lines():
    long = {f"{p.relative_to(ROOT.parent)}:{name}": n for p in _modules().values()
            for name, n in long_functions(p.read_text()).items()}
    assert not long, long


def test_the_package_imports_without_vllm():
    """vLLM is an optional extra and heavy to import (every spawned process of a multi-process run pays it):
    only an engine.kind=vllm build imports it."""
    import subprocess

    code = ("import sys, drafttrain.engines, drafttrain.tracking.tracker, drafttrain.rl.job, drafttrain.online; "
            "print(sorted(m for m in sys.modules if m == 'vllm' or m.startswith('drafttrain.engines.vllm')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def code_lines_matching(pattern: re.Pattern, where) -> list[str]:
    """`path:line` of each package line whose code (before any #) matches `pattern`, in the modules `where` keeps."""
    return [f"{p.relative_to(ROOT.parent)}:{i}" for p in _modules().values() if where(p)
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line.split("#")[0])]


def test_only_the_drafters_package_branches_on_a_drafter_kind():
    """A kind is one file plus one registration: code outside drafters/ never tests which kind it has (`kind ==` or
    `kind !=`, as drafter.kind or a variable of that name); it asks the drafter or a table keyed by kind."""
    found = code_lines_matching(re.compile(r"\bkind\s*[!=]="), lambda p: "drafters" not in p.parts)
    assert not found, found


def test_no_module_probes_a_drafter_with_hasattr():
    """The drafter contract is declared (drafters/contract.py gives every optional method a default): nothing outside
    it asks a drafter whether it has a method."""
    pattern = re.compile(r"hasattr\(\s*[\w.]*(drafter|member)\b")
    found = code_lines_matching(pattern, lambda p: p.name != "contract.py")
    assert not found, found
    assert pattern.search("if hasattr(self.drafter, 'adopt'):")  # what it would catch


def private_imports(source: str) -> list[str]:
    """`from drafttrain.x import _name` anywhere in `source` (inside functions too): a private name crossing modules."""
    return [f"{n.module}.{a.name}" for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("drafttrain"))
            for a in n.names if a.name.startswith("_") and not a.name.startswith("__")]


def test_no_module_imports_another_modules_private_name():
    assert private_imports("def f():\n    from drafttrain.engines.chooser import _bucket, Chooser\n") == \
        ["drafttrain.engines.chooser._bucket"]
    assert private_imports("from .chooser import _bucket\n") == ["chooser._bucket"]
    found = {str(p.relative_to(ROOT.parent)): x for p in _modules().values() if (x := private_imports(p.read_text()))}
    assert not found, found
