"""The import graph runs one way: cli -> orchestrate -> (spec, plan, supervise, state, checks, bench) ->
launchers -> (plan records, observe, errors); the router imports nothing of the rest but errors. A new
import that runs back up fails here, and so does any cycle between packages."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pdserve"

# package -> the pdserve packages it may import (besides itself)
ALLOWED = {
    "errors": set(),
    "engine": set(),
    "observe": {"errors"},
    "spec": {"errors", "engine", "router"},  # engine: built-in model names; router: the one source of its defaults
    "plan": {"spec", "engine", "errors"},
    "launchers": {"plan", "observe", "errors"},
    "state": {"launchers", "errors"},
    "supervise": {"plan", "spec", "state", "launchers", "observe", "errors"},
    "checks": {"plan", "spec", "observe", "supervise", "launchers", "engine", "errors"},
    "orchestrate": {"spec", "plan", "state", "launchers", "observe", "checks", "engine", "errors"},
    "bench": {"orchestrate", "observe", "errors"},
    "router": {"errors"},
    "ui": set(),
    "cli": {"orchestrate", "spec", "plan", "state", "checks", "bench", "observe", "ui", "errors", "launchers",
            "router"},
}


def package_of(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "pdserve" and len(parts) > 1 else None


def imports() -> dict[str, set[str]]:
    edges: dict[str, set[str]] = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).parts
        own = rel[0].removesuffix(".py")
        if own in ("__init__", "__main__"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else []
            for name in names:
                target = package_of(name)
                if target and target != own:
                    edges.setdefault(own, set()).add(target)
                elif name == "pdserve" and isinstance(node, ast.ImportFrom):
                    edges.setdefault(own, set()).update(a.name for a in node.names if a.name != "__version__")
    return edges


def test_every_package_is_known_and_imports_only_downward():
    edges = imports()
    packages = {p.name.removesuffix(".py") for p in PKG.iterdir() if not p.name.startswith("__")} - {"configs"}
    assert packages == set(ALLOWED), packages ^ set(ALLOWED)
    bad = {pkg: sorted(targets - ALLOWED[pkg]) for pkg, targets in edges.items() if targets - ALLOWED[pkg]}
    assert not bad, f"imports that run against the layering: {bad}"


def test_no_cycle_between_packages():
    edges = imports()
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in edges.get(node, ()):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in list(edges):
        if node not in state:
            visit(node, [node])
