"""The package graph follows the drawn direction (README, "Architecture"), with no cycles, between
packages or between modules; and the processes that must not carry the engine (the gateway, `trtserve
serve`'s supervisor) import without it.

Every import counts, deferred ones inside functions too: a deferred import hides a cycle from
Python's import system, not from this test.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layer -> the layers it may import. Read top-down: nothing may import a layer above it.
ALLOWED: dict[str, set[str]] = {
    "engine_format": set(),  # the contracts: engine directory, request fields, the served model's protocol
    "plugins_cuda": {"engine_format"},
    "executors": {"engine_format", "plugins_cuda"},  # run an engine's steps: what build and serve both stand on
    "calibration": {"executors", "engine_format"},
    "builder": {"calibration", "executors", "plugins_cuda", "engine_format"},
    "runtime.engine": {"executors", "engine_format"},
    "runtime.api": {"runtime.engine", "executors", "engine_format"},
    "runtime.triton_model": {"runtime.api", "runtime.engine", "engine_format"},  # inside Triton's stub
    # Processes of their own that never load the engine: they speak the contracts only.
    "runtime.serve": {"engine_format"},
    "runtime.gateway": {"engine_format"},
    "runtime.cli": {
        "runtime.gateway",
        "runtime.serve",
        "runtime.triton_model",
        "runtime.api",
        "runtime.engine",
        "executors",
        "engine_format",
    },
    "model_repository": {"runtime.triton_model", "runtime.api", "engine_format"},
}
ALLOWED["benchmarks"] = set(ALLOWED)  # benchmarks -> everything


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (None: not trtserve's)."""
    parts = module.split(".")
    if parts[0] == "runtime":
        if len(parts) > 1 and parts[1] in ("engine", "serve", "gateway", "triton_model"):
            return f"runtime.{parts[1]}"
        if len(parts) > 1 and parts[1].startswith("cli"):
            return "runtime.cli"  # cli.py, cli_serve.py, cli_options.py
        return "runtime.api"  # runtime/__init__.py, llm.py, async_llm.py
    return parts[0] if parts[0] in ALLOWED else None


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    if parts[0] == "model_repository":
        return "model_repository"
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str) -> set[str]:
    """Absolute names of every module `source` imports, at any depth of the code."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the importing module's package
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.add(name)
            found.update(f"{name}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    return found


def forbidden_edges(files: dict[str, str]) -> list[str]:
    """'file: layer -> layer (first such import)' for each import against the allowed direction."""
    problems: dict[tuple[str, str], str] = {}
    for path, source in files.items():
        module = module_name(ROOT / path)
        importer = layer_of(module)
        if importer is None:
            continue
        for name in sorted(imported_modules(source, module)):
            target = layer_of(name)
            if target and target != importer and target not in ALLOWED[importer]:
                problems.setdefault((path, target), f"{path}: {importer} -> {target} ({name})")
    return sorted(problems.values())


def project_files() -> dict[str, str]:
    packages = [*(p for p in ALLOWED if "." not in p), "runtime"]
    return {
        str(path.relative_to(ROOT)): path.read_text()
        for package in packages
        for path in sorted((ROOT / package).rglob("*.py"))
        if ".venvs" not in path.parts
    }


def test_allowed_direction_is_acyclic():
    try:
        order = list(TopologicalSorter(ALLOWED).static_order())
    except CycleError as exc:
        pytest.fail(f"the allowed layer graph has a cycle: {exc.args[1]}")
    assert order[0] == "engine_format"


def test_every_import_follows_the_drawn_direction():
    files = project_files()
    assert len(files) > 80, "the walk found too few files: is ROOT right?"
    assert forbidden_edges(files) == []


def test_engine_format_imports_no_other_package():
    edges = {
        name
        for path, source in project_files().items()
        if path.startswith("engine_format/")
        for name in imported_modules(source, module_name(ROOT / path))
        if layer_of(name) not in (None, "engine_format")
    }
    assert edges == set()


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        (
            "runtime/engine/scheduler.py",
            "def f():\n    from builder import build\n",
            "runtime.engine -> builder",
        ),
        ("calibration/gate.py", "import builder.export\n", "calibration -> builder"),
        ("engine_format/config.py", "from runtime.engine import errors\n", "engine_format -> runtime.engine"),
        ("executors/ort_cpu.py", "from runtime.engine import request\n", "executors -> runtime.engine"),
        ("runtime/engine/spec/ngram.py", "from ...serve import launcher\n", "runtime.engine -> runtime.serve"),
        (
            "runtime/gateway/protocol.py",
            "from runtime.engine import sampling_params\n",
            "runtime.gateway -> runtime.engine",
        ),
        ("builder/build.py", "from runtime import LLM\n", "builder -> runtime.api"),
        ("runtime/engine/llm_engine.py", "import runtime.serve.launcher\n", "runtime.engine -> runtime.serve"),
    ],
)
def test_the_check_catches_a_backward_import(path, source, expected):
    [problem] = forbidden_edges({path: source})
    assert expected in problem


def module_cycles(files: dict[str, str]) -> list[list[str]]:
    """Cycles among the project's modules (each as the modules on it), deferred imports included."""
    modules = {module_name(ROOT / path): source for path, source in files.items()}
    graph = {module: explicit_imports(source, module, set(modules)) - {module} for module, source in modules.items()}
    cycles = []
    for component in _strongly_connected(graph):
        if len(component) > 1:
            cycles.append(sorted(component))
    return cycles


def explicit_imports(source: str, module: str, modules: set[str]) -> set[str]:
    """The project modules `source` names in its imports: `import a.b` -> a.b, `from a.b import c` -> a.b.c
    where that is a module, else a.b (c is an attribute). A package's __init__ is not counted as imported by
    its submodules' imports (Python runs it, but re-exporting submodules is no design cycle)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[: -node.level] if node.level else []
            parent = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                child = f"{parent}.{alias.name}"
                found.add(child if child in modules else parent)
    return found & modules


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iterative (the graph has hundreds of modules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in graph:
                continue
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def test_no_module_imports_itself_through_others():
    assert module_cycles(project_files()) == []


def test_the_cycle_check_sees_a_deferred_import():
    files = {
        "runtime/engine/a.py": "from runtime.engine import b\n",
        "runtime/engine/b.py": "def f():\n    import runtime.engine.a\n",
    }
    assert module_cycles(files) == [["runtime.engine.a", "runtime.engine.b"]]


@pytest.mark.parametrize("module", ["runtime.gateway.app", "runtime.serve.serve_loop", "runtime.serve.supervisor"])
def test_processes_without_an_engine_import_without_it(module):
    """The gateway and the supervisor run in processes of their own: importing them loads neither the engine,
    the executors nor torch."""
    code = (
        f"import sys, {module}; print(sorted(m for m in sys.modules "
        "if m.startswith(('runtime.engine', 'runtime.async_llm', 'executors', 'torch'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    assert out.strip() == "[]"
