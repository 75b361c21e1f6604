"""The README's demo table is the demo's own JSON (issue 37): `python -m vlm_corl.demo --seed S --publish
docs/demo` writes docs/demo/demo-seed<S>.json and the README block from them; this fails when they drift apart.
Also the shipped base models the demo copies: one per member of the demo cohort, loadable."""

from __future__ import annotations

import json
from pathlib import Path

from vlm_corl.commands.demo import README_BLOCK, SHIPPED_BASES, config_members, load_seeds, readme_table

ROOT = Path(__file__).resolve().parents[1]


def test_the_readme_demo_table_is_the_recorded_runs():
    runs = load_seeds(ROOT / "docs" / "demo")
    assert [r["seed"] for r in runs] == [0, 1, 2]  # the band is measured over three seeds
    text = (ROOT / "README.md").read_text()
    start = text.index(f"<!-- {README_BLOCK}:")
    body = text[text.index("-->\n", start) + 4 : text.index(f"<!-- /{README_BLOCK} -->")]
    assert body == readme_table(runs)
    for run in runs:  # the bar, on this machine kind: every recorded seed gains at least +1.0 points
        assert run["gain_points"] >= 1.0, run["seed"]
        assert run["seconds"] <= 8 * 60 and run["processes"] == 2


def test_every_demo_member_has_a_shipped_base_model():
    members = config_members(str(ROOT / "configs" / "cohorts" / "tiny_easyvqa.yaml"), [])
    for mid in members:
        config = json.loads((SHIPPED_BASES / mid / "config.json").read_text())
        assert config["model_type"] == "qwen2_vl" and (SHIPPED_BASES / mid / "model.safetensors").is_file()
