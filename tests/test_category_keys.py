"""Category keys safe for a path (issue 56): a category's name is one level of a metric key and a tracker tag
(easy-vqa's `yes/no` made TensorBoard show `category/yes/no/agreement` as two levels), while the report still
names the category as it is and joins rows written before the keys were made safe."""

from __future__ import annotations

from vlm_corl.reporting.run_plots import category_lines
from vlm_corl.training.monitor.category_metrics import STATS, path_safe, pooled, window_metrics
from vlm_corl.training.monitor.metrics import MetricsSink


def _stats(*categories: str) -> dict:
    """One step's `category_stats` of one question per category, its answers "yes" and "no"."""
    one = {"questions": 1, **{k: [1.0, 2] for k in STATS}, "answers": {"yes": 1, "no": 1}}
    return {c: {k: (list(v) if isinstance(v, list) else v) for k, v in one.items()} for c in categories}


class Recorder:
    """A tracker that keeps the tags it is given."""

    def __init__(self):
        self.tags: list[str] = []

    def scalars(self, values, step):
        self.tags += list(values)


def test_a_category_is_one_level_of_every_key_and_tag(tmp_path):
    assert [path_safe(c) for c in ("yes/no", "a b:c", "Algebra", "x.y-z_1", "ö")] == [
        "yes_no",
        "a_b_c",
        "Algebra",
        "x.y-z_1",
        "_",
    ]
    window = window_metrics([_stats("yes/no", "number theory")])
    assert {k.split("/")[1] for k in window} == {"yes_no", "number_theory"}
    assert all(k.count("/") == 2 for k in window) and window["category/yes_no/agreement"] == 0.5
    recorder = Recorder()
    MetricsSink(tmp_path, [recorder]).write([{"step": 1, "member": "qwen", **window}])
    assert recorder.tags and all(t.count("/") == 3 and t.startswith("qwen/category/") for t in recorder.tags)
    assert "qwen/category/yes_no/agreement" in recorder.tags


def test_the_report_names_the_category_as_it_is_and_joins_old_rows():
    """Step 1 as a run before the change wrote it (`category/yes/no/...`), steps 2-3 as now: one line a member,
    labelled with the real name (from `category_stats`), with every step."""
    old = {"step": 1, "member": "qwen", "category/yes/no/agreement": 0.2}
    new = [
        {"step": s, "member": "qwen", "category_stats": _stats("yes/no"), **window_metrics([_stats("yes/no")])}
        for s in (2, 3)
    ]
    lines = category_lines([old, *new])
    assert list(lines) == ["qwen: yes/no"]
    assert [(r["step"], r["agreement"]) for r in lines["qwen: yes/no"]] == [(1, 0.2), (2, 0.5), (3, 0.5)]
    assert pooled(r["category_stats"] for r in new)["yes/no"]["questions"] == 2  # the collapse rules' real names
