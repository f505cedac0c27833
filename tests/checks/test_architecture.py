"""The package's shape, checked: no import cycles, layers that import only downward, the
simulator kept apart, a core that names no engine, and e2e tests by area.

Every import counts, including those inside functions (lazy imports hide cycles); imports
under ``if TYPE_CHECKING:`` count for the layers but not for cycles (they never run).
"""

from __future__ import annotations

import ast
from pathlib import Path

from ..support.servers import ROOT

PACKAGE = ROOT / "proxy"

#: A part may import from parts of a lower layer, and from itself.
LAYERS = {
    "proxy": 0,  # the package root: the version only
    "extensions": 0,  # the names of the extensions the layers offer each other
    "measure": 1,
    "transport": 1,
    "engines": 2,
    "fleet": 3,  # the upstreams, pools, balancer and health, apart from the request path
    "core": 4,  # the request path
    "services": 5,
    "settings": 6,
    "api": 6,
    "app": 7,
    "runtime": 8,
    "tools": 9,
    "__main__": 10,  # python -m proxy
}
#: The simulator stands apart: it imports only itself; only the tools import it.
SIM = "sim"


def modules() -> dict[str, Path]:
    """Every module of the package by name; a compiled one (a C twin) by its stub."""
    out = {}
    stubs = [p for p in PACKAGE.rglob("*.pyi") if not p.with_suffix(".py").exists()]
    for path in [*PACKAGE.rglob("*.py"), *stubs]:
        rel = path.relative_to(ROOT).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def part(module: str) -> str:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "proxy"


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def imports() -> list[tuple[str, str, bool]]:
    """(importer, imported, type_only) for every import of a proxy module by another."""
    mods = modules()
    edges = []
    for name, path in mods.items():
        tree = ast.parse(path.read_text())
        typing_only = _type_checking_lines(tree)
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".")
                    base = base[: len(base) - node.level + (1 if is_pkg else 0)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for alias in node.names:
                    sub = f"{target}.{alias.name}"
                    targets.append(sub if sub in mods else target)
            for t in targets:
                if t == "proxy" or t.startswith("proxy."):
                    while t not in mods and "." in t:
                        t = t.rsplit(".", 1)[0]
                    if t != name:
                        edges.append((name, t, node.lineno in typing_only))
    return edges


def test_every_module_belongs_to_a_known_part():
    unknown = {part(m) for m in modules()} - set(LAYERS) - {SIM}
    assert not unknown, f"add these to LAYERS (and to the layout in CONTRIBUTING.md): {unknown}"


def test_layers_import_only_downward_and_the_simulator_stands_apart():
    wrong = []
    for src, dst, _ in imports():
        a, b = part(src), part(dst)
        if a == b:
            continue
        if SIM in (a, b):
            if not (b == SIM and a == "tools") and not (a == SIM and b == "proxy"):
                wrong.append(f"{src} -> {dst}")
        elif LAYERS[a] <= LAYERS[b] and b != "proxy":
            wrong.append(f"{src} (layer {LAYERS[a]}) -> {dst} (layer {LAYERS[b]})")
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_core_and_engines_never_import_tools_services_or_the_simulator():
    for src, dst, _ in imports():
        if part(src) in ("core", "fleet", "engines"):
            assert part(dst) not in ("tools", "services", SIM, "runtime", "app", "api"), (src, dst)


def test_no_import_cycles():
    graph: dict[str, set[str]] = {m: set() for m in modules()}
    for src, dst, type_only in imports():
        if not type_only:
            graph[src].add(dst)
    # Tarjan's strongly connected components: any with two or more modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def _plant(tmp_path, monkeypatch, files: dict[str, str]) -> None:
    """Point the checks at a fake package made of `files` (path -> source)."""
    fake = tmp_path / "proxy"
    (fake).mkdir()
    (fake / "__init__.py").write_text("")
    for rel, text in files.items():
        path = fake / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "__init__.py").touch()
        path.write_text(text)
    me = __import__(__name__, fromlist=["x"])
    monkeypatch.setattr(me, "PACKAGE", fake)
    monkeypatch.setattr(me, "ROOT", tmp_path)


def _fails(check, needle: str) -> None:
    try:
        check()
    except AssertionError as exc:
        assert needle in str(exc), str(exc)
    else:
        raise AssertionError(f"{check.__name__} did not see the planted fault")


def test_the_checker_sees_a_cycle(tmp_path, monkeypatch):
    """The cycle check can fail: two modules importing each other are caught."""
    _plant(
        tmp_path,
        monkeypatch,
        {"core/a.py": "from ..core import b\n", "core/b.py": "from ..core import a\n"},
    )
    edges = {(s, d) for s, d, _ in imports()}
    assert ("proxy.core.a", "proxy.core.b") in edges and ("proxy.core.b", "proxy.core.a") in edges
    _fails(test_no_import_cycles, "proxy.core.a")
    test_layers_import_only_downward_and_the_simulator_stands_apart()  # same part: allowed


def test_the_checker_sees_a_layer_violation_without_a_cycle(tmp_path, monkeypatch):
    """The layer check can fail on its own: one upward import (the core reaching into the
    tools, a lazy import inside a function) with no cycle behind it is caught."""
    _plant(
        tmp_path,
        monkeypatch,
        {
            "core/a.py": "def f():\n    from ..tools import b\n    return b\n",
            "tools/b.py": "X = 1\n",
        },
    )
    test_no_import_cycles()  # no cycle here
    _fails(test_layers_import_only_downward_and_the_simulator_stands_apart, "proxy.core.a")
    _fails(test_core_and_engines_never_import_tools_services_or_the_simulator, "proxy.tools.b")


def test_the_checker_sees_the_simulator_imported_by_the_relay(tmp_path, monkeypatch):
    _plant(tmp_path, monkeypatch, {"core/a.py": "import proxy.sim.x\n", "sim/x.py": ""})
    _fails(test_layers_import_only_downward_and_the_simulator_stands_apart, "proxy.sim.x")


#: The parts that know no engine by name: they reach an engine only through the Dialect
#: protocol and the registry of proxy.engines.
ENGINE_BLIND = ("core", "fleet", "measure", "transport", "services", "runtime", "app", "api")


def engine_mentions() -> list[str]:
    """Where an engine-blind module names an engine: a string constant equal to a
    registered engine's name, an import of one engine's module, or of its dialect class."""
    from proxy.engines import ENGINES

    names = set(ENGINES)
    classes = {c.__name__ for c in ENGINES.values()}
    engine_modules = {c.__module__ for c in ENGINES.values()}
    found = []
    for src, dst, _ in imports():
        if part(src) in ENGINE_BLIND and dst in engine_modules:
            found.append(f"{src} imports {dst}")
    for name, path in modules().items():
        if part(name) not in ENGINE_BLIND:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and node.value in names:
                found.append(f"{name}:{node.lineno} names engine {node.value!r}")
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                for alias in node.names:
                    if alias.name.rsplit(".", 1)[-1] in classes:
                        found.append(f"{name}:{node.lineno} imports {alias.name}")
    return found


def test_no_module_outside_the_engines_names_an_engine():
    """Adding an engine is one module in proxy/engines and one registry line: nothing
    above the engines may special-case one by name (comments may mention them)."""
    found = engine_mentions()
    assert not found, "engine knowledge outside proxy/engines:\n" + "\n".join(found)


def test_the_checker_sees_an_engine_named_in_the_core(tmp_path, monkeypatch):
    _plant(
        tmp_path,
        monkeypatch,
        {
            "core/a.py": '"""Mentions ollama in a docstring: fine."""\nX = "ollama"\n',
            "core/b.py": "from ..engines.vllm import VLLMDialect\n",
            "core/c.py": "def f():\n    from ..engines import LlamaCppDialect\n",
            "engines/vllm.py": "VLLMDialect = 1\n",
            "measure/d.py": 'Y = "ollama_chat"  # an endpoint label, not an engine\n',
        },
    )
    found = engine_mentions()
    assert any("proxy.core.a:2 names engine 'ollama'" in f for f in found), found
    assert any("proxy.core.b imports proxy.engines.vllm" in f for f in found), found
    assert any("proxy.core.c:2 imports LlamaCppDialect" in f for f in found), found
    assert not any("proxy.measure.d" in f or "proxy.core.a:1" in f for f in found), found
    _fails(test_no_module_outside_the_engines_names_an_engine, "proxy.core.a")


def test_no_document_outside_the_repository_is_cited():
    """Docstrings, help texts and comments explain themselves."""
    import re

    pattern = re.compile(r"SPEC §|\bSPEC\b|seeds'|issue \d|\.\./shared")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in PACKAGE.rglob("*")
        if p.suffix in (".py", ".html")
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


# --- tests by area ----------------------------------------------------------------------------

#: The e2e tier's areas (CONTRIBUTING.md says what each holds): every e2e module is in one.
E2E_AREAS = ("wire", "relay", "engines", "observability", "fleet", "tools")


def misplaced_e2e(e2e: Path) -> list[str]:
    """What in the e2e tier is not in an area: a module beside the areas, a folder that is
    no area, an area that is not a package (its relative imports would not resolve)."""
    found = [str(p.relative_to(e2e)) for p in sorted(e2e.glob("*.py")) if p.name != "__init__.py"]
    for folder in sorted(p for p in e2e.iterdir() if p.is_dir() and p.name != "__pycache__"):
        if folder.name not in E2E_AREAS:
            found.append(f"{folder.name}/ is no area")
        elif not (folder / "__init__.py").exists():
            found.append(f"{folder.name}/ has no __init__.py")
    return found


def test_e2e_tests_live_in_their_areas():
    found = misplaced_e2e(ROOT / "tests" / "e2e")
    assert not found, f"put these in one of {E2E_AREAS}: {found}"


def test_the_checker_sees_an_e2e_module_outside_the_areas(tmp_path):
    for area in ("wire", "relay"):
        (tmp_path / area).mkdir()
        (tmp_path / area / "test_a.py").write_text("")
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "wire" / "__init__.py").write_text("")
    (tmp_path / "test_flat.py").write_text("")
    (tmp_path / "misc").mkdir()
    assert misplaced_e2e(tmp_path) == [
        "test_flat.py",
        "misc/ is no area",
        "relay/ has no __init__.py",
    ]
