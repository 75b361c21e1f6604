"""docs/reliability.md names, for every promise, the test that checks it: each named test file and test must exist,
so the page cannot go on citing a test that was renamed or removed."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_test_the_reliability_page_cites_exists():
    text = (ROOT / "docs" / "reliability.md").read_text()
    cited = re.findall(r"`(tests/[\w/]+\.py)((?:::\w+)?)`", text)
    shorthand = re.findall(r"`::(\w+)`", text)  # "::name" after a full citation: the same file
    assert len(cited) >= 20, cited
    defined: dict[str, set[str]] = {}
    for path, _ in cited:
        tree = ast.parse((ROOT / path).read_text())
        defined[path] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    missing = [f"{path}{name}" for path, name in cited if name and name[2:] not in defined[path]]
    every = set().union(*defined.values())
    missing += [f"::{name}" for name in shorthand if name not in every]
    assert not missing, f"docs/reliability.md cites tests that do not exist: {missing}"
