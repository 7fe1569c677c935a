"""The import graph keeps the layout's layering: walks every import, including function-level ones.

Layers, top to bottom:
- entry points (`app/train.py`, `prepare`, `regenerate`, `evaluate`, `advise`, `report`, `instructions`),
  `app/run/`, `app/bench/`: may import
  anything;
- `actors/`: thin Ray shells over the layer below; never import `app/run/`, `app/bench/` or entry points;
- everything else in `app/` (config, data, pool, model, training, tiny and the shared leaves at the top:
  messages, devices, faults, and every module of the storage package): never imports `actors/` or
  anything above it. A shared leaf imports no other project module but another shared leaf (faults
  keeps its markers where storage says).
No import cycles anywhere.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.helpers import ROOT

ENTRY_POINTS = {"app.train", "app.prepare", "app.regenerate", "app.evaluate", "app.advise", "app.report",
                "app.instructions"}
LEAF_PACKAGES = ("app.storage",)  # packages at app/'s top whose every module is a shared leaf
TOP_LEVEL_LEAVES = {"app", "app.messages", "app.devices", "app.faults", "app.ray_cluster", "app.metric_names",
                    "app.storage", "app.storage.roots", "app.storage.publish", "app.storage.uri_storage",
                    "app.storage.fetch", "app.storage.local_cache", "app.storage.names",
                    "app.storage.orphans", "app.storage.fence", "app.storage.conditional",
                    "app.storage.pins", "app.storage.cache_use", "app.storage.claim", "app.storage.owner"}
UPPER_PACKAGES = ("app.run", "app.bench")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    files = [*sorted((ROOT / "app").rglob("*.py")), *sorted((ROOT / "actors").rglob("*.py"))]
    return {module_name(p): p for p in files}


def resolve(name: str, modules: dict[str, Path]) -> str | None:
    """The longest project module that `name` (a module or `module.attribute`) refers to."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(path: Path, modules: dict[str, Path]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            if n.split(".")[0] in ("app", "actors") and (target := resolve(n, modules)):
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    modules = all_modules()
    return {m: imports_of(p, modules) - {m} for m, p in modules.items()}


def layer(mod: str) -> int:
    """2 = entry/run/bench, 1 = actors, 0 = the rest."""
    if mod in ENTRY_POINTS or mod.startswith(UPPER_PACKAGES):
        return 2
    return 1 if mod.startswith("actors") else 0


def test_no_module_imports_a_higher_layer():
    bad = [f"{m} -> {t}" for m, targets in graph().items() for t in targets if layer(t) > layer(m)]
    assert bad == []


def test_only_run_bench_and_entry_points_import_actors():
    bad = [f"{m} -> {t}" for m, ts in graph().items() for t in ts
           if t.startswith("actors") and not m.startswith("actors") and layer(m) != 2]
    assert bad == []


def cycles(g: dict[str, set[str]]) -> list[str]:
    """Every circle of a graph found by a depth-first walk, as "a -> b -> a"."""
    found: list[str] = []
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(g.get(m, ())):
            if state.get(t) == 1:
                found.append(" -> ".join(stack[stack.index(t):] + [t]))
            elif t not in state:
                visit(t, stack + [t])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    return found


def test_no_import_cycles():
    assert cycles(graph()) == []


def test_app_top_level_holds_only_entry_points_and_shared_leaves():
    top = {module_name(p) for p in (ROOT / "app").glob("*.py")}
    assert top <= ENTRY_POINTS | TOP_LEVEL_LEAVES, sorted(top - ENTRY_POINTS - TOP_LEVEL_LEAVES)
    in_leaf_packages = {m for m in all_modules() if m.startswith(tuple(f"{p}." for p in LEAF_PACKAGES))}
    assert in_leaf_packages <= TOP_LEVEL_LEAVES, sorted(in_leaf_packages - TOP_LEVEL_LEAVES)
    assert leaf_imports_outside_leaves(graph()) == {}


def leaf_imports_outside_leaves(g: dict[str, set[str]]) -> dict[str, set[str]]:
    """Shared leaves that import a project module other than a shared leaf, with those imports."""
    return {m: g[m] - TOP_LEVEL_LEAVES for m in TOP_LEVEL_LEAVES if g.get(m, set()) - TOP_LEVEL_LEAVES}


def test_a_leaf_may_import_a_leaf_but_nothing_else():
    g = {"app.faults": {"app.storage"}, "app.storage": {"app.config.schema"}, "app.messages": set()}
    assert leaf_imports_outside_leaves(g) == {"app.storage": {"app.config.schema"}}


def test_the_walker_sees_function_level_imports_and_cycles(tmp_path):
    """The checks above can fail: a function-level import is found and resolved to its module."""
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from actors.drafter import DrafterActor\n    from app import metric_names\n")
    found = imports_of(p, all_modules())
    assert found == {"actors.drafter", "app.metric_names"}


def ray_imports(path: Path) -> set[str]:
    """The `ray` modules a file imports, at its top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        found.update(n for n in names if n.split(".")[0] == "ray")
    return found


def test_the_pool_is_plain_python(tmp_path):
    """app/pool is tested without Ray: none of its modules imports ray, even inside a function (the pool actor,
    actors/hs_pool.py, makes the Ray calls). The check can fail: a function-level import is found."""
    pool = sorted((ROOT / "app" / "pool").glob("*.py"))
    assert len(pool) > 1 and {module_name(p): ray_imports(p) for p in pool if ray_imports(p)} == {}
    p = tmp_path / "m.py"
    p.write_text("def f():\n    from ray.exceptions import RayError\n")
    assert ray_imports(p) == {"ray.exceptions"}


RUN_TOP = {"app.run", "app.run.driver", "app.run.plan", "app.run.lease", "app.run.lease_record", "app.run.placement",
           "app.run.topology", "app.run.supervisor", "app.run.run_supervisor", "app.run.sweep", "app.run.finish",
           "app.run.preflight"}  # supervisor: the stream's loop; run_supervisor: each run's part of it; sweep: the
# run list; finish: how each run ends; preflight: the checks;
# lease_record: what a lease record says and when it is stale
RUN_ROOMS = ("supervise", "elastic", "evaluate", "outputs")


def run_room(mod: str) -> str:
    """`app.run.elastic.grow` -> `app.run.elastic`; a lifecycle module at app/run/'s top is its own room."""
    parts = mod.split(".")
    return ".".join(parts[:3]) if len(parts) > 3 else mod


def test_app_run_holds_the_lifecycle_files_and_four_rooms():
    top = {module_name(p) for p in (ROOT / "app" / "run").glob("*.py")}
    rooms = {p.name for p in (ROOT / "app" / "run").iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert top == RUN_TOP and rooms == set(RUN_ROOMS)
    assert all((ROOT / "app" / "run" / r / "__init__.py").read_text().strip() for r in RUN_ROOMS)


def test_run_rooms_import_neither_the_loop_nor_each_other_in_a_circle():
    """The supervisor and the driver sit above the four rooms; between rooms, arrows run one way only."""
    g = graph()
    up = [f"{m} -> {t}" for m, ts in g.items() for t in ts
          if m.startswith(tuple(f"app.run.{r}." for r in RUN_ROOMS)) and t in ("app.run.supervisor", "app.run.driver")]
    assert up == []
    rooms: dict[str, set[str]] = {}
    for m, ts in g.items():
        if m.startswith("app.run."):
            rooms.setdefault(run_room(m), set()).update(run_room(t) for t in ts
                                                        if t.startswith("app.run.") and run_room(t) != run_room(m))
    assert cycles(rooms) == []


def test_the_rooms_of_app_import_each_other_without_a_circle():
    """Folder by folder (app/model, app/config, ... and actors/), arrows run one way: a function-level import
    from app/config into app/model once drew app/config <-> app/model, with no module-level cycle."""
    packages = {p.name for p in (ROOT / "app").iterdir() if p.is_dir() and (p / "__init__.py").exists()}

    def room(mod: str) -> str:
        parts = mod.split(".")
        return "actors" if parts[0] == "actors" else (f"app.{parts[1]}" if len(parts) > 1 and parts[1] in packages
                                                       else mod)

    rooms: dict[str, set[str]] = {}
    for m, ts in graph().items():
        rooms.setdefault(room(m), set()).update(room(t) for t in ts if room(t) != room(m))

    assert cycles(rooms) == []
