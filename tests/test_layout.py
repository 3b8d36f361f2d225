"""The shape of core/: packages import in one direction, modules import without circles, and no
module re-exports another's names or imports a private one (DESIGN.md, "Layout").

Every `import` counts, also those inside functions (the lazy imports that keep `dsv4 --help`
fast): a lazy import that runs back up the order is still a back-arrow.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "core"
# Each package may import itself and those before it. Ranks that tie are siblings that must not
# import each other (eval, hf, bench and plan all sit on top of train).
ORDER = {"errors": 0, "tree": 0, "process": 0, "config": 1, "ops": 2, "loss": 3, "model": 4, "spec": 5, "parallel": 6,
         "data": 7, "checkpoint": 8, "train": 9, "eval": 10, "hf": 10, "bench": 10, "plan": 11}
# The model and the maths below it take specs (core/spec), never a Config: they may not import core.config.
NEVER = {"ops": {"config"}, "loss": {"config"}, "model": {"config"}}


def _module(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(imported core module, names taken from it, line) for every import statement in `path`."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, [], node.lineno) for a in node.names if a.name.split(".")[0] == "core"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "core":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                if (CORE.parent / (sub.replace(".", "/") + ".py")).exists() or (CORE.parent / sub.replace(".", "/")).is_dir():
                    out.append((sub, [], node.lineno))  # `from core.pkg import module`
                else:
                    out.append((node.module, [a.name], node.lineno))
    return out


def _graph() -> dict[str, dict[str, int]]:
    return {_module(p): {m: line for m, _, line in _imports(p)} for p in sorted(CORE.rglob("*.py"))}


def _package(module: str) -> str:
    return module.split(".")[1] if module.count(".") else "core"


def test_every_core_package_has_a_rank_and_a_docstring():
    packages = {p.stem if p.is_file() else p.name for p in CORE.iterdir() if p.suffix == ".py" or p.is_dir()}
    packages -= {"__init__", "__pycache__"}
    assert packages <= set(ORDER), f"packages without a rank in ORDER: {sorted(packages - set(ORDER))}"
    for init in CORE.glob("*/__init__.py"):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        assert len(doc.splitlines()) >= 3 and "import" in doc, f"{init}: say what it holds and what it may import"


def test_every_package_docstring_names_its_modules():
    missing = []
    for init in sorted(CORE.glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        missing += [f"{init.parent.name}/{p.name}" for p in sorted(init.parent.glob("*.py"))
                    if p.stem != "__init__" and not re.search(rf"\b{p.stem}\b", doc)]
    assert not missing, f"modules their package's __init__ docstring does not name: {missing}"


def test_packages_import_only_downwards():
    arrows = []
    for module, targets in _graph().items():
        src = _package(module)
        for target, line in targets.items():
            dst = _package(target)
            if src != dst and dst != "core" and ORDER[dst] >= ORDER[src]:
                arrows.append(f"{module}:{line} imports {target} ({src} may not import {dst})")
    assert not arrows, "\n".join(arrows)


def test_model_and_maths_never_import_the_config():
    """model/, ops/ and loss/ take specs, never a Config: no import of core.config, not even a lazy one."""
    arrows = [f"{module}:{line} imports {target}" for module, targets in _graph().items()
              for target, line in targets.items() if _package(target) in NEVER.get(_package(module), ())]
    assert not arrows, "\n".join(arrows)


def test_no_import_cycles():
    """No module reaches itself through imports, in core/ or dsv4cli/."""
    raw = {**_graph(), **{f"dsv4cli.{p.stem}": _cli_imports(p) for p in (CORE.parent / "dsv4cli").glob("*.py")}}
    graph = {m: {t for t in ts if t in raw} for m, ts in raw.items()}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                return path[path.index(t):] + [t]
            if t not in state and (cycle := visit(t)):
                return cycle
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            raise AssertionError("import cycle: " + " -> ".join(cycle))


def _cli_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dsv4cli"):
            out |= {f"dsv4cli.{a.name}" if node.module == "dsv4cli" else node.module for a in node.names}
    return out


def test_no_reexports_and_no_private_imports():
    bad = []
    for p in sorted(CORE.rglob("*.py")):
        text = p.read_text()
        if "import *" in text or "# re-export" in text or "re-exported" in text:
            bad.append(f"{p}: re-exports")
        for target, names, line in _imports(p):
            bad += [f"{p}:{line} imports private {target}.{n}" for n in names if n.startswith("_")]
    for p in sorted((CORE.parent / "dsv4cli").glob("*.py")) + sorted((CORE.parent / "tests").rglob("*.py")):
        for target, names, line in _imports(p):
            bad += [f"{p}:{line} imports private {target}.{n}" for n in names if n.startswith("_")]
    assert not bad, "\n".join(bad)


def test_every_core_package_is_installed():
    """pyproject's explicit package list names every package under core/, so a wheel holds them all."""
    import tomllib

    listed = set(tomllib.loads((CORE.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {_module(p) for p in CORE.rglob("__init__.py")}
    assert found <= listed, f"add to pyproject.toml's packages: {sorted(found - listed)}"
