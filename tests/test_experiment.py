"""`python -m vlm_corl.experiments.easyvqa --quick` end to end: the files, the table and the plots exist
(the numbers of a 12-step run mean nothing and are not checked)."""

import json
import subprocess
import sys
from pathlib import Path

from vlm_corl.experiments.easyvqa import METHODS

ROOT = Path(__file__).resolve().parents[1]


def test_quick_experiment_writes_the_table_and_plots(tmp_path):
    out = tmp_path / "x"
    proc = subprocess.run([sys.executable, "-m", "vlm_corl.experiments.easyvqa", "--quick", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert set(results["table"]) == {"base models", *METHODS}
    assert set(results["question_only"]["by_type"]) == {"yes/no", "shape", "color"}
    table = (out / "results.md").read_text()
    for method in ["question-only baseline", "base models", *METHODS]:
        assert f"| {method} |" in table
    for plot in ("test_accuracy", "reward", "agreement", "pseudo_label_acc", "distinct_answers"):
        assert (out / f"{plot}.png").stat().st_size > 1000
    assert all((out / "runs" / Path(r["run_dir"]).name / "summary.json").exists()
               for r in results["seeds"]["0"]["methods"].values())
