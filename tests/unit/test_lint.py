"""Guard rails of the package's layout, read from the source (nothing of autopar is imported):
ruff's checks (pyproject ``[tool.ruff]``: pyflakes, ``__all__`` naming defined names, banned
private torch modules), no private torch module imported outside ``autopar/_torch_private.py``,
no import cycle between modules, and no private (underscore) name imported from another module
of the package; a name another module imports is in its module's ``__all__``."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"autopar": "autopar", "passes": "autopar.passes", "cost_models": "autopar.cost_models"}
PRIVATE_HOME = "autopar._torch_private"


def _modules() -> dict[str, Path]:
    out = {}
    for folder, package in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in f.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            out[".".join([package, *parts])] = f
    return out


def _imports(name: str, path: Path) -> list[tuple[str, str | None, int]]:
    """``(module, imported name or None, line)`` for every import in the file, function-level
    ones included (relative imports resolved)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = name.split(".")[: len(name.split(".")) - node.level + (path.name == "__init__.py")]
                module = ".".join(base + ([module] if module else []))
            out += [(module, a.name, node.lineno) for a in node.names]
    return out


MODULES = _modules()


def test_ruff_passes():
    ruff = shutil.which("ruff") or (Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.skip("ruff is a test extra: pip install -e '.[test]'")
    out = subprocess.run([str(ruff), "check", "autopar", "passes", "cost_models", "tests",
                          "benchmarks", "examples"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_private_torch_modules_only_in_torch_private():
    found = []
    for name, path in MODULES.items():
        if name == PRIVATE_HOME:
            continue
        for module, _, line in _imports(name, path):
            if module.split(".")[0] == "torch" and any(p.startswith("_") for p in module.split(".")):
                found.append(f"{path.relative_to(ROOT)}:{line} imports {module}")
    assert not found, "import private torch modules through autopar/_torch_private.py:\n" + "\n".join(found)


def test_no_import_cycles():
    edges: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        for module, imported, _ in _imports(name, path):
            target = f"{module}.{imported}" if f"{module}.{imported}" in MODULES else module
            if target in MODULES and target != name and MODULES[target].name != "__init__.py":
                edges.setdefault(name, set()).add(target)
    # a cycle exists iff a depth-first walk meets a module on its own stack
    state: dict[str, int] = {}
    cycles = []

    def visit(v: str, stack: list[str]) -> None:
        state[v] = 1
        for w in sorted(edges.get(v, ())):
            if state.get(w) == 1:
                cycles.append(" -> ".join(stack[stack.index(w):] + [v, w]) if w in stack
                              else f"{v} -> {w}")
            elif w not in state:
                visit(w, stack + [v])
        state[v] = 2

    for v in sorted(MODULES):
        if v not in state:
            visit(v, [])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_names_other_modules_import_are_public_and_exported():
    exported: dict[str, set[str] | None] = {}
    for name, path in MODULES.items():
        names = None
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
                names = set(ast.literal_eval(node.value))
        exported[name] = names
    bad = []
    for name, path in MODULES.items():
        for module, imported, line in _imports(name, path):
            if module not in MODULES or module == name or imported is None or imported == "*" \
                    or imported.startswith("__") \
                    or f"{module}.{imported}" in MODULES or module == PRIVATE_HOME:
                continue
            where = f"{path.relative_to(ROOT)}:{line} imports {module}.{imported}"
            if imported.startswith("_") and not imported.startswith("__"):
                bad.append(f"{where}: a private name")
            elif exported[module] is not None and imported not in exported[module]:
                bad.append(f"{where}: not in {module}.__all__")
    assert not bad, "\n".join(bad)
