"""The easy-vqa experiment: its statistics, collapse rule and verdicts against numbers worked by hand, the
methods it plans from the probe, its resumable jobs, its data (wording-based question types), and `--quick` end
to end (every method and seed in results.json, the table's intervals recomputed from the seeds, a restart that
skips every finished job), then one method re-run on its base models with `easyvqa_try`, and that command's
mistakes."""

import dataclasses
import json
import math

import pytest
from cohort_helpers import python_m

from vlm_corl import cli
from vlm_corl.data.loaders import DataError, easyvqa_question_type, load_easyvqa
from vlm_corl.data.records import Example
from vlm_corl.evaluation.stats import mean_ci, pearson, ranks, spearman, t975
from vlm_corl.experiments import easyvqa_analysis as analysis
from vlm_corl.experiments import easyvqa_design as design
from vlm_corl.experiments import easyvqa_try
from vlm_corl.experiments.easyvqa import constant_share, finished, save_result
from vlm_corl.experiments.easyvqa_data import asked_type
from vlm_corl.models.warmstart import mixed_by


def test_t_interval_by_hand():
    assert t975(1) == 12.706 and t975(4) == 2.776 and t975(30) == 2.042
    assert t975(60) == pytest.approx(2.000, abs=1e-3) and t975(120) == pytest.approx(1.980, abs=1e-3)
    # 1..5: mean 3, sample std sqrt(2.5), half-width 2.776 * sqrt(2.5) / sqrt(5) = 2.776 / sqrt(2)
    r = mean_ci([1, 2, 3, 4, 5])
    assert r["mean"] == 3 and r["std"] == pytest.approx(math.sqrt(2.5)) and r["n"] == 5
    assert r["ci"] == pytest.approx(2.776 / math.sqrt(2))
    assert mean_ci([0.25]) == {"mean": 0.25, "ci": 0.0, "std": 0.0, "n": 1}
    with pytest.raises(ValueError):
        mean_ci([])
    with pytest.raises(ValueError):
        t975(0)


def test_spearman_by_hand():
    assert ranks([10, 20, 20, 30]) == [1, 2.5, 2.5, 4]
    assert ranks([3, 1, 2]) == [3, 1, 2]
    # d = 1, -1, 1, -1, 0: rho = 1 - 6 * 4 / (5 * 24) = 0.8
    assert spearman([1, 2, 3, 4, 5], [2, 1, 4, 3, 5]) == pytest.approx(0.8)
    assert spearman([1, 2, 3], [30, 20, 10]) == pytest.approx(-1.0)
    # ties: ranks x = 1, 2.5, 2.5, 4 and y = 1, 2, 3, 4: sxy = 4.5, sxx = 4.5, syy = 5
    assert spearman([1, 2, 2, 3], [1, 2, 3, 4]) == pytest.approx(4.5 / math.sqrt(4.5 * 5))
    assert spearman([1, 1, 1], [1, 2, 3]) is None and pearson([1], [2]) is None
    # rho 0.8 over 5: t = 0.8 * sqrt(3 / 0.36) = 2.309 < t(0.975, 3) = 3.182
    test = analysis.rank_test([1, 2, 3, 4, 5], [2, 1, 4, 3, 5])
    assert test["t"] == pytest.approx(0.8 * math.sqrt(3 / 0.36)) and not test["significant"]
    assert analysis.rank_test(list(range(8)), list(range(8)))["significant"]


def test_verdicts_by_hand():
    assert analysis.verdict({"mean": 0.08, "ci": 0.02}, 0.05, above=True) == "supported"
    assert analysis.verdict({"mean": 0.06, "ci": 0.02}, 0.05, above=True) == "inconclusive"
    assert analysis.verdict({"mean": 0.02, "ci": 0.02}, 0.05, above=True) == "not supported"
    assert analysis.verdict({"mean": 0.01, "ci": 0.005}, 0.02, above=False) == "supported"
    assert analysis.verdict({"mean": 0.05, "ci": 0.01}, 0.02, above=False) == "not supported"
    assert analysis.all_of(["supported", "supported"]) == "supported"
    assert analysis.all_of(["supported", "inconclusive"]) == "inconclusive"
    assert analysis.all_of(["inconclusive", "not supported"]) == "not supported"


MAJORITY = {"color": {"share": 0.2}, "shape": {"share": 0.4}, "yes/no": {"share": 0.6}}


def brief(by_type, answers=None):
    spread = {"color": {"red": 5, "blue": 5}, "shape": {"circle": 5, "rectangle": 5}, "yes/no": {"yes": 5, "no": 5}}
    return {"accuracy": sum(by_type.values()) / 3, "by_type": by_type, "answers": {**spread, **(answers or {})}}


def test_a_collapsed_type_counts_as_no_gain():
    assert analysis.collapsed({"rectangle": 9, "circle": 1}, 0.4)  # 90% one answer, gold 40%
    assert not analysis.collapsed({"rectangle": 8, "circle": 2}, 0.4)
    assert not analysis.collapsed({"no": 10}, 0.95)  # the gold answers are that constant too
    assert not analysis.collapsed({}, 0.4)
    base = brief({"color": 0.5, "shape": 0.3, "yes/no": 0.8})
    after = brief({"color": 0.6, "shape": 0.4, "yes/no": 0.7}, {"shape": {"rectangle": 10}})
    d = analysis.member_deltas(after, base, MAJORITY)
    assert d["d_shape"] == pytest.approx(0.1) and d["collapsed_shape"] == 1.0 and d["g_shape"] == 0.0
    assert d["g_color"] == pytest.approx(0.1) and d["g_yes/no"] == pytest.approx(-0.1)
    assert d["d_accuracy"] == pytest.approx(0.1 / 3) and d["gain"] == pytest.approx(0.0)
    worse = brief({"color": 0.5, "shape": 0.2, "yes/no": 0.8}, {"shape": {"rectangle": 10}})
    assert analysis.member_deltas(worse, base, MAJORITY)["g_shape"] == pytest.approx(-0.1)  # a loss stays a loss


def test_constant_share_by_hand():
    evals = {
        "a": {"preds": [("shape", "rectangle"), ("shape", "rectangle"), ("color", "red"), ("color", "blue")]},
        "b": {"preds": [("shape", "rectangle"), ("shape", "circle"), ("color", "red"), ("color", "red")]},
    }
    assert constant_share(evals) == {"shape": 0.5, "color": 0.5}


def _results(after_by_seed, majority=MAJORITY):
    flat = {"color": 0.5, "shape": 0.3, "yes/no": 0.8}
    return {
        "bases": {"A": {"test": brief(flat)}},
        "majority": majority,
        "methods": {"m": {"trained": {"A": "A", "A2": "A"}}, "s": {"trained": {"A": "A"}}},
        "seeds": {
            seed: {
                method: {"eval": {mid: brief({**flat, **v}) for mid, v in members.items()}, "constant": {"color": 0}}
                for method, members in methods.items()
            }
            for seed, methods in after_by_seed.items()
        },
    }


def test_cohort_gains_and_paired_differences_by_hand():
    # seed 0: colour +0.3 for one member, +0.0 for the other -> cohort Δ colour +0.15, gain +0.05
    results = _results(
        {
            "0": {"m": {"A": {"color": 0.8}, "A2": {}}, "s": {"A": {}}},
            "1": {"m": {"A": {"color": 0.65}, "A2": {"color": 0.65}}, "s": {"A": {"color": 0.2}}},
        }
    )
    seeded = analysis.per_seed(results)
    assert seeded["m"]["0"]["cohort"]["d_color"] == pytest.approx(0.15)
    assert seeded["m"]["0"]["cohort"]["gain"] == pytest.approx(0.05)
    assert seeded["m"]["0"]["cohort"]["constant_color"] == 0
    table = analysis.method_table(seeded)
    assert table["m"]["cohort"]["d_color"]["mean"] == pytest.approx(0.15)  # both seeds +0.15
    assert table["m"]["cohort"]["d_color"]["ci"] == pytest.approx(0.0, abs=1e-12)
    # m − s on the gain: seed 0: 0.05 − 0 = 0.05, seed 1: 0.05 − (−0.1) = 0.15 -> mean 0.1, std 0.0707
    diff = analysis.paired(seeded, "m", "s")
    assert diff["mean"] == pytest.approx(0.1)
    assert diff["ci"] == pytest.approx(12.706 * math.sqrt(0.005) / math.sqrt(2))


def _ranking():
    """A probe ranking (best first) in the shape `rank_cohorts` gives, over every candidate cohort."""
    names = list(design.candidates())
    # family sets of three first, from most to least headroom; then the rest
    order = sorted(names, key=lambda n: (n.count("+") != 2, names.index(n)))
    return [{"cohort": n, "members": [m for m, _, _ in design.candidates()[n]]} for n in order]


def test_the_methods_follow_the_pick():
    methods = design.plan_methods(_ranking(), design.FULL)
    by_role = {m.role: m for m in methods if m.role}
    pick = by_role["pick"]
    assert pick.cohort == "qwen2_vl+qwen2_5_vl+mllama" and pick.mode == "peers_ema" and pick.seeds == 5
    assert by_role["pick_peers"].mode == "peers" and by_role["pick_peers"].trained == pick.trained
    assert list(pick.trained) == ["qwen2_vl", "qwen2_5_vl", "mllama"]
    homog = by_role["homogeneous"]  # equal size, one family
    recipes = design.base_recipes(design.FULL)
    assert [recipes[b].family for b in homog.trained.values()] == ["qwen2_vl"] * 3 and homog.cohort == "homogeneous 3"
    assert homog.mode == pick.mode
    assert len({recipes[b].init_seed for b in homog.trained.values()}) == 3  # three initialisations
    assert by_role["self_vote"].trained == by_role["gt"].trained == pick.trained
    para = by_role["paraphrased"]
    assert [view for _, _, view, _ in para.runs[0]] == ["original", "paraphrase:1", "paraphrase:2"]
    frozen = by_role["frozen"]  # one run per member: it trains, its peers are frozen copies
    assert len(frozen.runs) == 3 and frozen.seeds == 1
    assert [[t for *_, t in run] for run in frozen.runs] == [
        [True, False, False],
        [False, True, False],
        [False, False, True],
    ]
    assert frozen.trained == pick.trained
    spread = [m for m in methods if "spread" in m.tags]
    assert {m.seeds for m in spread} == {design.FULL.spread_seeds}
    assert [m.mode for m in spread if m.cohort.count("+") == 1] == ["ring", "ring"]  # pairs: the ring
    assert "qwen2_vl+qwen2_5_vl+mllama+gemma3+internvl" in {m.cohort for m in spread}
    assert len({m.name for m in methods}) == len(methods)
    label_free = [m for m in methods if m.mode in ("peers", "peers_ema", "ring") and m.role != "frozen"]
    assert len(label_free) >= 8  # the probe-vs-gain analysis


def test_a_job_result_is_reused_only_with_its_key(tmp_path):
    path = tmp_path / "result.json"
    assert finished(path, {"a": 1}) is None
    save_result(path, {"x": 2}, {"a": 1})
    assert finished(path, {"a": 1}) == {"x": 2, "key": {"a": 1}}
    assert finished(path, {"a": 2}) is None  # another budget or config: done again
    assert not path.with_suffix(".tmp").exists()
    assert (
        design.base_recipes(design.FULL)["qwen2_vl_c"].slice_start
        == design.base_recipes(design.FULL)["mllama"].slice_start
    )


def test_the_type_as_asked_matches_the_type_of_the_answer_on_every_train_question():
    assert all(asked_type(ex.question) == easyvqa_question_type(ex.answer) for ex in load_easyvqa(None, "train"))


def test_mixed_warm_start_slices():
    examples = [Example(id=str(i), question="q", metadata={"k": "xy"[i % 2]}) for i in range(20)]
    picked = mixed_by(examples, "k", {"x": 3, "y": 1}, 8)  # 6 x and 2 y, the first of each in source order
    assert [ex.id for ex in picked] == ["0", "2", "4", "6", "8", "10", "1", "3"]
    with pytest.raises(DataError, match="not enough examples"):
        mixed_by(examples, "k", {"x": 1}, 11)
    with pytest.raises(DataError, match="non-negative shares"):
        mixed_by(examples, "k", {"x": -1, "y": 2}, 4)


@pytest.mark.slow  # ~1.5 min on 2 cores: `make test-e2e`, which CI runs after `make test`
def test_quick_experiment_end_to_end(tmp_path):
    out = tmp_path / "x"
    proc = python_m("vlm_corl.experiments.easyvqa", "--quick", "--rl-steps", 3, "--out", out, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["split"] == "test" and set(results["seeds"]) == {"0", "1"}
    assert results["budget"]["rl_steps"] == 3 and "3 steps" in (out / "results.md").read_text()
    methods = results["methods"]
    roles = {m["role"]: name for name, m in methods.items() if m["role"]}
    assert set(roles) == {"pick", "pick_peers", "homogeneous", "self_vote", "gt", "pick_ring", "paraphrased", "frozen"}
    # the probe ranked every candidate and the pick is its best cohort of three or more families
    ranking = results["probe"]["ranking"]
    assert len(ranking) == len(design.candidates())
    best = next(r for r in ranking if "+" in r["cohort"] and len(r["members"]) >= 3)
    assert methods[roles["pick"]]["cohort"] == best["cohort"]
    for seed, runs in results["seeds"].items():
        for name, run in runs.items():
            assert int(seed) < methods[name]["seeds"]
            assert set(run["eval"]) == set(methods[name]["trained"]), name
            for run_dir in run["run_dirs"]:
                summary = json.loads((out / run_dir / "summary.json").read_text())
                assert summary["steps"] == 3
                rows = [json.loads(line) for line in (out / run_dir / "metrics.jsonl").read_text().splitlines()]
                assert any(k.startswith("category/shape/") for k in rows[-1])  # the per-category guard is on
    assert len(results["seeds"]["0"]["frozen peers"]["run_dirs"]) == len(methods[roles["frozen"]]["trained"])
    # the table's intervals come from the seeds: recompute one member's gain by hand
    pick = roles["pick"]
    mid = next(iter(methods[pick]["trained"]))
    gains = [
        analysis.member_deltas(
            results["seeds"][s][pick]["eval"][mid], results["bases"][mid]["test"], results["majority"]
        )["gain"]
        for s in ("0", "1")
    ]
    cell = results["table"][pick][mid]["gain"]
    assert cell["mean"] == pytest.approx(sum(gains) / 2)
    assert cell["ci"] == pytest.approx(12.706 * abs(gains[0] - gains[1]) / math.sqrt(2) / math.sqrt(2))
    assert len(results["probe_gain"]["rows"]) >= 8
    assert [c["claim"][:3] for c in results["claims"]] == ["(a)", "(b)", "(c)", "(d)", "(e)", "(f)", "(g)"]
    table = (out / "results.md").read_text()
    for text in ["majority-class reference", "question-only baseline", *methods, "Spearman's rho", "## Claims"]:
        assert text in table
    for plot in ("probe_vs_gain", "pseudo_label_acc", "reward", "agreement", "distinct_answers"):
        assert (out / f"{plot}.png").stat().st_size > 1000
    # a restart skips every finished job: no base model or run is touched again
    stamps = {p: p.stat().st_mtime_ns for p in out.glob("*/*/*.json") if p.name in ("base.json", "result.json")}
    assert len(stamps) == len(design.base_recipes(design.QUICK)) + sum(
        len(m["runs"]) * m["seeds"] for m in methods.values()
    )
    proc = python_m("vlm_corl.experiments.easyvqa", "--quick", "--rl-steps", 3, "--out", out, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert json.loads((out / "results.json").read_text())["table"] == results["table"]
    # --publish: the results and plots to a docs folder (an old plot removed), the README block from them
    docs, readme = tmp_path / "docs", tmp_path / "README.md"
    docs.mkdir()
    (docs / "old_plot.png").write_bytes(b"png")
    readme.write_text("intro\n<!-- easyvqa-summary: regenerated -->\nstale\n<!-- /easyvqa-summary -->\nrest\n")
    proc = python_m(
        "vlm_corl.experiments.easyvqa", "--out", out, "--plots-only", "--publish", docs, "--readme", readme, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    published = json.loads((docs / "results.json").read_text())
    assert readme.read_text() == (
        "intro\n<!-- easyvqa-summary: regenerated -->\n"
        + analysis.summary_md(published)
        + "<!-- /easyvqa-summary -->\nrest\n"
    )
    assert "stale" not in readme.read_text() and not (docs / "old_plot.png").exists()
    assert sorted(p.name for p in docs.glob("*.png")) == sorted(published["plots"])
    # one method again on the same base models, with overrides, scored on validation
    proc = python_m(
        "vlm_corl.experiments.easyvqa_try",
        *("--bases", out / "base", "--method", "gt-labels", "--limit", 15, "--out", tmp_path / "try"),
        *("train.max_steps=2", "data.batch_size=4", "rollout.n=2"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tried = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(tried["members"]) == set(methods["gt (labels)"]["trained"]) and tried["overrides"][-1] == "rollout.n=2"
    for mid, m in tried["members"].items():
        # the base's validation score: the same 15 balanced validation questions
        assert m["base"]["balanced"] == pytest.approx(results["bases"][mid]["validation"]["accuracy"])
        assert m["change_points"] == pytest.approx(100 * (m["after"]["balanced"] - m["base"]["balanced"]), abs=0.01)
    rows = (tmp_path / "try" / "runs" / "gt-labels-seed0" / "metrics.jsonl").read_text().splitlines()
    assert {json.loads(r)["step"] for r in rows} == {1, 2}  # the override trained 2 steps, not the budget's 480


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "gt-labels"], "no built base model gemma3, internvl, mllama"),
        (["--method", "nope"], "is not a method of the experiment; one of: peers-ema-picked-"),
        (["--method", "gt-labels", "rollout.nn=3"], "unknown key 'rollout.nn'"),
        (["--method", "gt-labels", "train.lr=abc"], "train.lr: expected a number"),
    ],
)
def test_easyvqa_try_names_the_mistake(tmp_path, capsys, args, message):
    bases = tmp_path / "base"
    if args[1] != "gt-labels" or len(args) > 2:  # base models present: the method or an override is wrong
        record = {"id": "q0", "type": "color", "preds": ["red", "blue"], "gold": "red"}
        for b in design.base_recipes(design.FULL):
            (bases / b).mkdir(parents=True)
            views = design.views(design.MAX_VIEWS) if b == design.PARAPHRASED else ["original"]
            samples = {design.probe_key(b, v): [record] for v in views}
            (bases / b / "probe_samples.json").write_text(json.dumps(samples))
    argv = ["--bases", str(bases), "--out", str(tmp_path / "o"), *args]
    assert cli.run(easyvqa_try.main, argv) == 2
    assert message in capsys.readouterr().err


def test_the_readme_summary_is_the_published_experiment():
    """The experiment page's summary block is regenerated from docs/easyvqa/results.json (`--publish`), never
    edited."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    results = json.loads((root / "docs" / "easyvqa" / "results.json").read_text())
    readme = (root / "docs" / "experiment.md").read_text()
    expected = analysis.replace_block(readme, analysis.README_BLOCK, analysis.summary_md(results))
    assert readme == expected, "docs/experiment.md's easyvqa-summary block drifted: rerun the experiment's --publish"
    # the published run is the full experiment on test, not a --quick or --tune one
    assert results["split"] == "test"
    assert {k: v for k, v in results["budget"].items() if k not in ("seeds",)} == {
        k: v for k, v in dataclasses.asdict(design.FULL).items() if k not in ("seeds",)
    }
    for plot in results["plots"]:
        assert (root / "docs" / "easyvqa" / plot).is_file()
