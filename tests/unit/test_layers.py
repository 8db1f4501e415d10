"""The import graph runs one way: cli -> bench -> orchestrate -> checks -> supervise -> state -> launchers ->
plan -> spec, with observe, engine, roles and errors below; the CLI imports only the operations (orchestrate.ops,
bench.session), errors and ui; the router imports nothing of the rest but errors and roles. A new import that runs
back up fails here, and so does any cycle between packages or between the modules of one package. Inside
the router, its sub-packages import one way too (front -> legs -> route -> kv, api and telemetry below). And
no file under tests/, scripts/ or benchmarks/ imports a test module: what tests share is in tests/kits/."""

from __future__ import annotations

import ast
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "pdserve"

# package -> the pdserve packages it may import (besides itself)
ALLOWED = {
    "errors": set(),
    "roles": set(),                          # the process roles' names, for every package that plans or reads processes
    "engine": {"router"},                    # router.wire: the keys the entry's patches add for the router
    "observe": {"errors", "roles", "router"},         # router.metric_names: the names status reads back
    "spec": {"errors", "roles", "engine", "router"},  # engine: built-in model names; router: the one source of its defaults
    "plan": {"spec", "roles", "engine", "errors"},
    "launchers": {"plan", "spec", "observe", "errors"},   # spec: the launcher names (LauncherKind)
    "state": {"launchers", "errors"},
    "supervise": {"plan", "spec", "roles", "state", "launchers", "observe", "errors", "router",  # router.wire: the canary's header
                  "engine"},        # engine.shm_names: the names a server's shared memory gets
    "checks": {"plan", "spec", "roles", "observe", "supervise", "launchers", "engine", "errors"},
    "export": {"plan", "spec", "roles", "engine", "errors"},      # renders the plan for another place (kubernetes)
    "orchestrate": {"spec", "plan", "roles", "state", "launchers", "observe", "checks", "engine", "export", "errors"},
    "bench": {"orchestrate", "spec", "roles", "observe", "router", "errors"},   # router: the prefill policies' names
    "router": {"errors", "roles"},                    # roles: a leaf that imports nothing
    "ui": set(),
    "cli": {"orchestrate", "bench", "ui", "errors"},     # orchestrate.ops and bench.session: the operations
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


def assert_no_cycle(edges: dict[str, set[str]]) -> None:
    """Depth-first: an edge back to a module on the current path is a cycle, named in full."""
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            assert state.get(nxt) != 1, "import cycle: " + " -> ".join(path + [nxt])
            if nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])


def test_no_cycle_between_packages():
    assert_no_cycle(imports())


def module_imports() -> dict[str, set[str]]:
    """Module -> the pdserve modules it imports, anywhere in it (a deferred import inside a function is
    still an edge: it only hides the circle until the function runs). `from pdserve.a import b` is an edge
    to the module pdserve.a.b when there is one, else to pdserve.a."""
    modules = {".".join(("pdserve", *p.relative_to(PKG).with_suffix("").parts)).removesuffix(".__init__"): p
               for p in PKG.rglob("*.py")}
    edges: dict[str, set[str]] = {}
    for module, path in modules.items():
        out = edges.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                out.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0 and node.module in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                out.update(subs or {node.module})
                if len(subs) < len(node.names):
                    out.add(node.module)
        out.discard(module)
    return edges


def test_no_cycle_between_modules_of_a_package():
    """Inside a package too, imports run one way: two modules that import each other (even through an
    import deferred into a function) are one module in two files, or share a third that both should import.
    Edges between packages are the test above's; a package's __init__ re-exports its modules."""
    edges = module_imports()
    assert_no_cycle({m: {t for t in targets if package_of(t) == package_of(m) and t != f"pdserve.{package_of(m)}"}
                     for m, targets in edges.items()})


# Inside the router, sub-package -> the sub-packages it may import. Its top-level modules (config, errors, wire,
# identity, conversation) sit below them all and import none of them; __main__, the process, wires everything.
ROUTER_ALLOWED = {
    "front": {"legs", "route", "kv", "api", "telemetry"},   # HTTP front: routes, admission, the observe middleware
    "legs": {"route", "kv", "api", "telemetry"},            # a turn's flow, its P and D legs, calls to servers
    "route": {"kv", "telemetry"},                            # where a turn goes: policies, servers' pools and health
    "kv": set(),                                             # what is remembered of D's KV: entries, stores, held
    "api": set(),                                            # one module per wire format
    "telemetry": set(),                                      # metrics, logs, trace notes
}


def router_part(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["pdserve", "router"] or len(parts) < 3 or parts[2] == "__main__":
        return None
    return parts[2] if parts[2] in ROUTER_ALLOWED else "top"


def test_the_routers_sub_packages_import_one_way():
    parts = {p.name for p in (PKG / "router").iterdir() if p.is_dir() and not p.name.startswith("__")}
    assert parts == set(ROUTER_ALLOWED), parts ^ set(ROUTER_ALLOWED)
    bad = set()
    for module, targets in module_imports().items():
        own = router_part(module)
        for target in targets:
            other = router_part(target)
            if own and other and other != own and other != "top" and other not in ROUTER_ALLOWED.get(own, set()):
                bad.add(f"{module} -> {target}")
    assert not bad, f"router imports against its layering: {sorted(bad)}"


# -- the tests' own imports ----------------------------------------------------------------------------------
REPO = PKG.parent


def imports_of_test_modules() -> list[str]:
    """`file:line module` for each import of a test module (a `test_*` name) under tests/, scripts/ or benchmarks/."""
    found = []
    for top in ("tests", "scripts", "benchmarks"):
        for path in sorted((REPO / top).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom):
                    base = "." * node.level + (node.module or "")
                    names = [base] + [f"{base}.{a.name}" for a in node.names]
                else:
                    continue
                for name in names:      # ours: under tests, relative, or a test_* put on the path (not aiohttp.test_utils)
                    parts = name.lstrip(".").split(".")
                    ours = parts[0] == "tests" or name.startswith(".") or parts[0].startswith("test_")
                    if ours and any(part.startswith("test_") for part in parts):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno} {name}")
                        break
    return found


def test_no_test_module_is_imported_helpers_are_in_kits():
    """What tests share lives in tests/kits/ (fixtures in a conftest.py): a test module imported by another
    file runs its tests twice over or drags a package's fixtures into another, and hides what is shared."""
    assert imports_of_test_modules() == []


# Inside orchestrate, module -> the modules it may import: ops, one operation per command, uses the modules
# cluster.py was split into, by the operations that use them; lookup (find a cluster, its plan, what lives)
# sits below them all.
ORCHESTRATE_ALLOWED = {
    "ops": {"lookup", "start", "stop", "restarts", "view", "secrets"},
    "start": {"lookup", "stop", "restarts", "secrets"},   # up: prepare, supervise until up, apply changes
    "stop": {"lookup"},                          # down
    "restarts": {"lookup"},                      # restart
    "view": {"lookup"},                          # status
    "lookup": set(),
    "secrets": set(),                            # the key `up` hands to a running supervisor
}


def test_orchestrates_modules_import_one_way():
    own = {p.stem for p in (PKG / "orchestrate").glob("*.py")} - {"__init__"}
    assert own == set(ORCHESTRATE_ALLOWED), own ^ set(ORCHESTRATE_ALLOWED)
    bad = {f"{module} -> {target}" for module, targets in module_imports().items()
           if module.startswith("pdserve.orchestrate.") for target in targets
           if target.startswith("pdserve.orchestrate.")
           and target.rsplit(".", 1)[1] not in ORCHESTRATE_ALLOWED[module.rsplit(".", 1)[1]]}
    assert not bad, f"orchestrate imports against its layering: {sorted(bad)}"
