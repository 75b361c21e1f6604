"""The README and docs/ stay true: README.md is at most 200 lines, every relative link (and #anchor) resolves,
every `python -m MODULE` and `corl COMMAND` they name exists, and the installed `corl` answers --help for
itself and for every command, with the module's own flags and exit codes."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cohort_helpers import ENV, ROOT

from vlm_corl.commands import COMMANDS, main

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown page."""
    out = set()
    for line in page.read_text().splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            out.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return out


def test_the_readme_reads_in_five_minutes():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 200


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in anchors(file)):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"


def test_every_command_the_docs_name_exists():
    text = "\n".join(p.read_text() for p in PAGES)
    modules = set(re.findall(r"python3? -m ([a-z_][\w.]*)", text)) - {"venv", "pip"}  # MODULE: a placeholder
    missing = sorted(m for m in modules if importlib.util.find_spec(m) is None)
    assert not missing, f"modules named in the docs that do not exist: {missing}"
    named = set(re.findall(r"\bcorl ([a-z][a-z-]*)", text)) - {"command"}
    assert named <= set(COMMANDS), f"corl commands named in the docs that do not exist: {named - set(COMMANDS)}"
    for name, (module, _) in COMMANDS.items():
        assert importlib.util.find_spec(module) is not None, name
        assert f"`corl {name}`" in (ROOT / "README.md").read_text(), f"the README's command table lacks {name}"


def test_corl_is_installed_and_answers_help_like_python_m(tmp_path, capsys):
    corl = Path(sys.executable).parent / "corl"
    assert corl.is_file(), "the corl console script is missing: pip install -e . (make setup) installs it"
    listed = subprocess.run([corl, "--help"], capture_output=True, text=True, env=ENV, timeout=120)
    assert listed.returncode == 0 and all(f"  {name} " in listed.stdout for name in COMMANDS)
    train = subprocess.run([corl, "train", "--help"], capture_output=True, text=True, env=ENV, timeout=120)
    assert train.returncode == 0 and "--config" in train.stdout
    for name in COMMANDS:  # every command's parser, in this process (as runpy runs it)
        assert main([name, "--help"]) == 0, name
    capsys.readouterr()
    assert main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    bad = tmp_path / "c.yaml"
    bad.write_text("rollout: {n: 1}\n")
    same = [
        subprocess.run(cmd, capture_output=True, text=True, env=ENV, timeout=120, cwd=ROOT)
        for cmd in ([corl, "config", bad], [sys.executable, "-m", "vlm_corl.config", bad])
    ]
    assert [r.returncode for r in same] == [2, 2] and same[0].stderr == same[1].stderr


def test_the_gpu_install_lines_name_the_versions_vllm_runs_with():
    """vLLM's CUDA wheel pins torch and torchvision exactly: a torch installed first in another version is replaced
    by PyPI's build. docs/gpu.md's vLLM install names the torch the vLLM lane pins (Makefile), the torchvision
    paired with it (torch 2.N with torchvision 0.N+15, as the Makefile's own pins are) and the transformers of the
    GPU bundle (Makefile), which pyproject.toml admits; without vLLM, the oldest torch pyproject.toml admits."""
    import tomllib
    from packaging.requirements import Requirement

    make = (ROOT / "Makefile").read_text()
    torchvision = lambda torch: "0.{}.{}".format(int(torch.split(".")[1]) + 15, torch.split(".")[2])  # noqa: E731
    ours = re.search(r"\(VENV\)/bin/pip install torch==(\S+) torchvision==(\S+)", make)
    assert torchvision(ours[1]) == ours[2]
    torch = re.search(r"\(VLLM_VENV\)/bin/pip install torch==(\S+)", make)[1]
    transformers = re.search(r"\btransformers==(\S+)", make)[1]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needs = {r.name: r.specifier for r in map(Requirement, project["dependencies"])}
    assert transformers in needs["transformers"]
    gpu = (ROOT / "docs" / "gpu.md").read_text()
    assert f"pip install torch=={torch} torchvision=={torchvision(torch)} --index-url https://download." in gpu
    assert f'pip install transformers=={transformers} -e ".[deepspeed,vllm]"' in gpu
    oldest = next(s.version for s in needs["torch"] if s.operator == ">=")
    assert f"any CUDA build of torch {oldest} or later" in gpu


def test_the_commands_old_module_names_still_run_them():
    """`python -m vlm_corl.plan` and the other names the commands had before vlm_corl/commands/ run the same
    command, import as the same module, and leave the module's own spec (runpy finds it by its name after)."""
    import importlib

    import vlm_corl
    from vlm_corl.commands import export

    assert importlib.import_module("vlm_corl.export") is export
    assert export.__spec__.name == "vlm_corl.commands.export"
    assert main(["export", "--help"]) == 0  # runpy under the new name, after an import under the old one
    for old, new in vlm_corl.MOVED.items():
        assert importlib.util.find_spec(new) is not None, new
        out = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True, env=ENV, cwd=ROOT)
        assert out.returncode == 0 and out.stdout.startswith(f"usage: python -m {old} "), (old, out.stderr[-500:])
