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
TOOLS = ("zoo", "warmstart", "demo", "probe", "headroom", "report", "experiments", "train", "eval")


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
