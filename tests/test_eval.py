"""`python -m vlm_corl.eval` on both registries' benchmarks: easy-vqa (vision) and MATH-500 (text, via text_corl)."""

import json
from pathlib import Path

import pytest

from vlm_corl.eval import main

MATH500 = Path(__file__).resolve().parents[1].parent / "shared/data/math500"


def test_eval_writes_results_for_a_vision_and_a_text_benchmark(tiny_zoo, tmp_path):
    main(["--models", str(tiny_zoo["qwen2_vl"]), "--benchmarks", "easyvqa", "--limit", "6", "--out", str(tmp_path / "v")])
    vision = json.loads((tmp_path / "v" / "results.json").read_text())[str(tiny_zoo["qwen2_vl"])]["easyvqa"]
    assert vision["n"] == 6 and set(vision["by_type"]) == {"yes/no", "shape", "color"}
    assert "| easyvqa | 6 |" in (tmp_path / "v" / "results.md").read_text()
    if not MATH500.exists():
        pytest.skip(f"MATH-500 not found at {MATH500}")
    main(["--models", str(tiny_zoo["qwen3"]), "--benchmarks", "math500", "--limit", "2",
          "--data", f"math500={MATH500}", "--out", str(tmp_path / "t")])
    text = json.loads((tmp_path / "t" / "results.json").read_text())[str(tiny_zoo["qwen3"])]["math500"]
    assert text["n"] == 2 and len(text["records"]) == 2
