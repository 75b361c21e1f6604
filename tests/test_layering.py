"""The package layering: the core never imports the user tools or text_corl, and heavy optional engines are
imported lazily."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAZY_ONLY = ("vllm", "deepspeed")


def _imports(path: Path, top_level_only: bool) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    names = []
    for node in nodes:
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def _modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_core_never_imports_text_corl():
    offenders = [
        f"{p.relative_to(ROOT)}: {name}"
        for p in _modules("vlm_corl")
        for name in _imports(p, top_level_only=False)
        if name.split(".")[0] == "text_corl"
    ]
    assert offenders == []


# the core: the loop, members, distribution, data, evaluation, configs; the tools (commands) build on it
CORE = ("training", "members", "distributed", "data", "evaluation", "config", "registry.py", "errors.py", "cli.py")
TOOLS = ("commands", "models", "reporting", "experiments", "train", "api")


def test_core_never_imports_the_tools():
    core = [p for c in CORE for p in ([ROOT / "vlm_corl" / c] if c.endswith(".py") else _modules(f"vlm_corl/{c}"))]
    assert len(core) > 40  # the packages exist where this test looks
    offenders = [
        f"{p.relative_to(ROOT)}: {name}"
        for p in core
        for name in _imports(p, top_level_only=False)
        if name.split(".")[:2][0] == "vlm_corl" and len(name.split(".")) > 1 and name.split(".")[1] in TOOLS
    ]
    assert offenders == []


def test_engines_are_not_imported_at_module_level():
    offenders = [
        f"{p.relative_to(ROOT)}: {name}"
        for pkg in ("vlm_corl", "text_corl", "data_tools")
        for p in _modules(pkg)
        for name in _imports(p, top_level_only=True)
        if name.split(".")[0] in LAZY_ONLY
    ]
    assert offenders == []


def test_importing_every_module_loads_no_engine():
    """Import every module of the three packages in a fresh interpreter; vllm/deepspeed must stay unloaded."""
    mods = []
    for pkg in ("vlm_corl", "text_corl", "data_tools"):
        for p in _modules(pkg):
            rel = p.relative_to(ROOT).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if parts[-1] != "__main__":
                mods.append(".".join(parts))
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}: importlib.import_module(m)\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {LAZY_ONLY!r}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _import_graph(package: str = "vlm_corl") -> dict[str, set[str]]:
    """{module: modules of `package` it imports}, module-level and function-level imports alike (a `from a.b
    import c` counts as importing a.b.c when that is a module, else a.b); relative imports resolved."""
    modules = {}
    for p in _modules(package):
        rel = p.relative_to(ROOT).with_suffix("")
        modules[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = name.split(".") if is_package else name.split(".")[:-1]
                    parts = parts[: len(parts) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets.update(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names)
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles_in_the_package():
    """No two modules of vlm_corl import each other, directly or round a loop, at module or function level
    (a lazy import inside a function still ties the two rooms together). The layers: docs/layout.md."""
    graph = _import_graph()
    assert len(graph) > 100 and sum(map(len, graph.values())) > 200  # the graph was read
    assert _cycles(graph) == []


def test_the_cycle_check_sees_a_function_level_cycle():
    """The check above would catch a loop closed by a lazy import (as the rollout factory once closed one)."""
    graph = _import_graph()
    graph["vlm_corl.members.rollout"] = graph["vlm_corl.members.rollout"] | {"vlm_corl.members.engines"}
    assert any({"vlm_corl.members.engines", "vlm_corl.members.rollout"} <= set(c) for c in _cycles(graph))


# The package root holds the core's front door and ground only; every other module lives in the room whose job
# it is (docs/layout.md): commands/, reporting/, models/, training/, ... A new file here fails this test.
ROOT_MODULES = {"__init__.py", "__main__.py", "api.py", "cli.py", "errors.py", "registry.py", "versions.py", "train.py"}


def test_the_package_root_holds_only_its_own_modules():
    found = {p.name for p in (ROOT / "vlm_corl").glob("*.py")}
    assert found == ROOT_MODULES, (
        f"modules at the package root that docs/layout.md does not place: {sorted(found - ROOT_MODULES)}"
        f" (missing: {sorted(ROOT_MODULES - found)}); put a new module in the room whose job it is"
    )


# The rooms' layers, top to bottom (docs/layout.md); a room imports only rooms of its own layer or below
LAYERS = (
    ("train", "__main__", "commands", "experiments"),
    ("__init__", "api"),
    ("reporting",),
    ("training",),
    ("planning",),
    ("evaluation", "models"),
    ("members",),
    ("distributed",),
    ("data",),
    ("config",),
    ("registry", "cli", "versions", "errors"),
)
# The imports that run back up a layer today, each for a reason; a new one fails the test below
UPWARD = {
    ("config", "distributed"),  # loading: the launch's world size, to check a layout while the config is read
    ("config", "members"),  # loading: a DeepSpeed file and an adapter's files checked while the config is read
    ("config", "training"),  # loading: reward mode and tracker names checked against their registries
    ("members", "training"),  # update: the policy loss, one pure function of training/rewards/grpo.py
}


def _room(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _upward(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    layer = {room: depth for depth, rooms in enumerate(LAYERS) for room in rooms}
    found: dict[tuple[str, str], list[str]] = {}
    for source, targets in graph.items():
        for target in targets:
            a, b = _room(source), _room(target)
            if layer[b] < layer[a]:  # a lower depth is a higher layer
                found.setdefault((a, b), []).append(f"{source} -> {target}")
    return found


def test_imports_run_down_the_layers_but_for_the_known_few():
    graph = _import_graph()
    rooms = {_room(m) for m in graph}
    assert rooms == {r for rs in LAYERS for r in rs}, "a room without a layer: add it to LAYERS and docs/layout.md"
    upward = _upward(graph)
    assert set(upward) <= UPWARD, {k: v for k, v in upward.items() if k not in UPWARD}
    assert len(UPWARD) <= 4


def test_the_layer_check_sees_a_new_upward_import():
    graph = _import_graph()
    graph["vlm_corl.members.render"] = graph["vlm_corl.members.render"] | {"vlm_corl.reporting.html"}
    assert ("members", "reporting") in _upward(graph)


# training/'s sub-rooms, top to bottom (docs/layout.md): the loop, then each room imports only those below it
TRAINING_ROOMS = ("loop", "phases", "run", "monitor", "rewards")
TRAINING_UPWARD = {  # the imports running back up, and why
    ("rewards", "run"): "reward_funcs: the slots' type (SlotSpec), for annotations only",
    ("monitor", "run"): "throughput: the slots' type (SlotSpec), for annotations only",
}


def _training_room(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[1] == "training" else None


def _training_upward(graph: dict[str, set[str]]) -> dict[tuple[str, str], list[str]]:
    found: dict[tuple[str, str], list[str]] = {}
    for source, targets in graph.items():
        for target in targets:
            a, b = _training_room(source), _training_room(target)
            if a and b and TRAINING_ROOMS.index(b) < TRAINING_ROOMS.index(a):
                found.setdefault((a, b), []).append(f"{source} -> {target}")
    return found


def test_trainings_sub_rooms_import_down_but_for_the_known_few():
    graph = _import_graph()
    assert {_training_room(m) for m in graph} - {None} == set(TRAINING_ROOMS), "a training module outside its rooms"
    upward = _training_upward(graph)
    assert set(upward) <= set(TRAINING_UPWARD), {k: v for k, v in upward.items() if k not in TRAINING_UPWARD}
    graph["vlm_corl.training.rewards.grpo"] = graph["vlm_corl.training.rewards.grpo"] | {
        "vlm_corl.training.monitor.metrics"
    }
    assert ("rewards", "monitor") in _training_upward(graph)  # the check sees a new one


def test_the_training_modules_old_paths_still_import():
    """Users' scripts import vlm_corl.training.rewards, .callbacks, .reward_funcs (and the other modules' paths from
    before the sub-rooms): each gives the module that moved, or (rewards, now the room) the reward modes' names."""
    import importlib

    import vlm_corl
    from vlm_corl.training.rewards import modes

    assert importlib.import_module("vlm_corl.training.rewards").REWARDS is modes.REWARDS
    assert importlib.import_module("vlm_corl.training.rewards").CohortBatch is modes.CohortBatch
    for old, new in vlm_corl.RELOCATED.items():
        assert importlib.import_module(old) is importlib.import_module(new), old
    assert {"vlm_corl.training.callbacks", "vlm_corl.training.reward_funcs"} <= set(vlm_corl.RELOCATED)


# A function of the trainer reads in one screen: at most 60 lines (its def to its last line) and 6 parameters
# (self and cls not counted), in vlm_corl (the commands included), text_corl and the data tools.
MAX_LINES, MAX_PARAMS = 60, 6
OVER_THE_LIMITS = {  # function: why it may
    "vlm_corl/api.py:CohortTrainer.__init__": "the public API's keyword arguments, one each, as TRL's trainers take",
}


def _over_the_limits(path: Path) -> list[str]:
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = child.args
                params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
                count = len([p for p in params if p.arg not in ("self", "cls")])
                lines = child.end_lineno - min([child.lineno] + [d.lineno for d in child.decorator_list]) + 1
                if lines > MAX_LINES or count > MAX_PARAMS:
                    found.append(f"{path.relative_to(ROOT)}:{prefix}{child.name} ({lines} lines, {count} params)")
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text()), "")
    return found


def test_functions_of_the_trainer_fit_a_screen():
    packages = ("vlm_corl", "text_corl", "data_tools")
    found = [f for package in packages for p in _modules(package) for f in _over_the_limits(p)]
    assert {f.split(" (")[0] for f in found} <= set(OVER_THE_LIMITS), [
        f for f in found if f.split(" (")[0] not in OVER_THE_LIMITS
    ]


def test_the_limits_check_sees_a_long_function(tmp_path, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    long = tmp_path / "long.py"
    long.write_text("def f(a, b, c, d, e, f, g):\n" + "    x = 1\n" * 60)
    assert _over_the_limits(long) == ["long.py:f (61 lines, 7 params)"]
