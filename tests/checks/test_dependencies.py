"""Every package the code imports is declared in pyproject.toml: the proxy's among its
dependencies (or in the extra that guards the import), the tests', benchmarks' and tools'
there or in the test extra. A missing declaration works on the machine that happens to
have the package and fails on a fresh one."""

from __future__ import annotations

import ast
import functools
import importlib.metadata as md
import re
import sys
import tomllib
from pathlib import Path

import pytest

from ..support.servers import ROOT

#: Run inside an engine's own virtual environment (vLLM's), or with a GPU machine's own
#: PyTorch (tests/device), not phasewatch's.
ENGINE_SIDE = {
    "tests/real/tiny_model.py",
    ".ci/check-llama-server.py",
    "tests/device/gpu_power_check.py",
}


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0].strip().lower().replace("_", "-")


def declared() -> tuple[set[str], set[str]]:
    """(the package's dependencies and its feature extras, those plus the test extra)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    extras = project.get("optional-dependencies", {})
    features = {_name(r) for name, reqs in extras.items() if name != "test" for r in reqs}
    test = {_name(r) for r in extras.get("test", [])}
    return runtime | features, runtime | features | test


def imported(path: Path) -> set[str]:
    """Top-level names of the absolute imports in a file, local modules left out."""
    tree = ast.parse(path.read_text(), str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    local = {p.stem for p in path.parent.iterdir()} | {"proxy", "tests"}
    return {n for n in names if n not in sys.stdlib_module_names and n not in local}


@functools.cache
def _installed() -> dict[str, list[str]]:
    return md.packages_distributions()


def distributions(module: str) -> set[str]:
    return {d.lower().replace("_", "-") for d in _installed().get(module, [])}


def files(*parts: str) -> list[Path]:
    out = []
    for part in parts:
        out.extend(sorted((ROOT / part).rglob("*.py")))
    return [p for p in out if str(p.relative_to(ROOT)) not in ENGINE_SIDE]


def test_the_proxy_imports_only_what_it_declares():
    runtime, _ = declared()
    missing = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in files("proxy")
        for module in imported(path)
        if not distributions(module) & runtime
    }
    assert not missing, sorted(missing)


@pytest.mark.parametrize("part", ["tests", "deploy", "grafana", ".ci"])
def test_tests_and_tools_import_only_what_is_declared(part):
    _, everything = declared()
    missing = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in files(part)
        for module in imported(path)
        if not distributions(module) & everything
    }
    assert not missing, sorted(missing)
