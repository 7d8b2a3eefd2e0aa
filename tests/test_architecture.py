"""The package graph follows the drawn direction (README, "Architecture"), with no cycles.

Every import counts, deferred ones inside functions too: a deferred import hides a cycle from
Python's import system, not from this test.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Layer -> the layers it may import. Read top-down: nothing may import a layer above it.
ALLOWED: dict[str, set[str]] = {
    "engine_format": set(),
    "plugins_cuda": {"engine_format"},
    "runtime.backends": {"engine_format", "plugins_cuda"},
    "runtime.engine": {"runtime.backends", "engine_format"},
    "runtime.api": {"runtime.engine", "runtime.backends", "engine_format"},
    "runtime.serve": {"runtime.api", "runtime.engine", "engine_format"},
    # The OpenAI gateway runs as its own light process: it talks to tritonserver, not to the engine.
    "runtime.gateway": {"runtime.serve", "engine_format"},
    "runtime.cli": {
        "runtime.gateway",
        "runtime.serve",
        "runtime.api",
        "runtime.engine",
        "runtime.backends",
        "engine_format",
    },
    "calibration": {"runtime.api", "runtime.engine", "runtime.backends", "engine_format"},
    "builder": {"calibration", "runtime.api", "runtime.engine", "runtime.backends", "plugins_cuda", "engine_format"},
    "model_repository": {"runtime.api", "runtime.engine", "runtime.serve", "engine_format"},
}
ALLOWED["benchmarks"] = set(ALLOWED)  # benchmarks -> everything


def layer_of(module: str) -> str | None:
    """The layer a dotted module name belongs to (None: not trtserve's)."""
    parts = module.split(".")
    if parts[0] == "runtime":
        if len(parts) > 1 and parts[1] in ("engine", "backends", "serve", "gateway", "cli"):
            return f"runtime.{parts[1]}"
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
        ("runtime/backends/ort_cpu.py", "from ..engine import request\n", "runtime.backends -> runtime.engine"),
        ("runtime/engine/llm_engine.py", "import runtime.serve.launcher\n", "runtime.engine -> runtime.serve"),
    ],
)
def test_the_check_catches_a_backward_import(path, source, expected):
    [problem] = forbidden_edges({path: source})
    assert expected in problem
