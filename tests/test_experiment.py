"""The easy-vqa experiment: its statistics and verdicts against numbers worked by hand, its data (wording-based
question types, skill-weighted warm-start slices), and `--quick` end to end (every method and seed in
results.json, the table's intervals recomputed from the seeds, the probe-vs-gain table), then one method re-run
on its base models with `easyvqa_try`, and that command's mistakes."""

import json
import math

import pytest
from cohort_helpers import python_m

from vlm_corl import cli
from vlm_corl.data.loaders import DataError, easyvqa_question_type, load_easyvqa
from vlm_corl.data.records import Example
from vlm_corl.experiments import easyvqa_analysis as analysis
from vlm_corl.experiments import easyvqa_try
from vlm_corl.experiments.easyvqa import METHODS, RING_COHORTS
from vlm_corl.experiments.easyvqa_data import asked_type, skill_mix
from vlm_corl.experiments.stats import mean_ci, pearson, ranks, spearman, t975
from vlm_corl.warmstart import mixed_by


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
    sig = {"rho": -0.9, "significant": True}
    weak = {"rho": 0.2, "significant": False}
    assert analysis.prediction_verdict(sig, {"rho": 0.8, "significant": True}) == "supported"
    assert analysis.prediction_verdict(weak, {"rho": 0.8, "significant": True}).startswith("partly supported (p_A")
    assert analysis.prediction_verdict({"rho": 0.9, "significant": True}, weak) == "not supported"  # wrong sign
    assert analysis.verdict({"mean": 0.08, "ci": 0.02}, 0.05, above=True) == "supported"
    assert analysis.verdict({"mean": 0.06, "ci": 0.02}, 0.05, above=True) == "inconclusive"
    assert analysis.verdict({"mean": 0.02, "ci": 0.02}, 0.05, above=True) == "not supported"
    assert analysis.verdict({"mean": 0.01, "ci": 0.005}, 0.02, above=False) == "supported"
    assert analysis.verdict({"mean": 0.05, "ci": 0.01}, 0.02, above=False) == "not supported"


def _run(after: dict[str, float]) -> dict:
    return {"eval": {mid: {"accuracy": sum(v.values()) / 3, "by_type": v} for mid, v in after.items()}}


def test_cohort_gains_and_paired_differences_by_hand():
    flat = {"color": 0.5, "shape": 0.3, "yes/no": 0.8}
    results = {
        "bases": {"A": {"test": {"accuracy": sum(flat.values()) / 3, "by_type": flat}}},
        # seed 0: colour +0.3 for one member, +0.0 for the other -> cohort Δ colour +0.15, Δ balanced +0.05
        "seeds": {
            "0": {"m": _run({"A": {**flat, "color": 0.8}, "A2": flat}), "s": _run({"A": flat})},
            "1": {
                "m": _run({"A": {**flat, "color": 0.65}, "A2": {**flat, "color": 0.65}}),
                "s": _run({"A": {**flat, "color": 0.2}}),
            },
        },
    }
    seeded = analysis.per_seed(results, lambda m, mid: "A")
    assert seeded["m"]["0"]["cohort"]["d_color"] == pytest.approx(0.15)
    assert seeded["m"]["0"]["cohort"]["d_accuracy"] == pytest.approx(0.05)
    table = analysis.method_table(seeded)
    assert table["m"]["cohort"]["d_color"]["mean"] == pytest.approx(0.15)  # both seeds +0.15
    assert table["m"]["cohort"]["d_color"]["ci"] == pytest.approx(0.0, abs=1e-12)
    # m − s on Δ balanced: seed 0: 0.05 − 0 = 0.05, seed 1: 0.05 − (−0.1) = 0.15 -> mean 0.1, std 0.0707
    diff = analysis.paired(seeded, "m", "s")
    assert diff["mean"] == pytest.approx(0.1)
    assert diff["ci"] == pytest.approx(12.706 * math.sqrt(0.005) / math.sqrt(2))


def _pair(kappa, acc_sum):
    m = {"kappa": kappa, "acc_sum": acc_sum, "complementarity": 0.2, "same_wrong": 0.1}
    return {"overall": m, "by_type": {"color": m}}


def test_a_cohort_of_three_is_probed_as_the_mean_of_its_pairs():
    pairs = {"A+B": _pair(0.1, 1.2), "A+M": _pair(None, 1.0), "B+M": _pair(0.5, 1.4)}
    p = analysis.cohort_probe(pairs, ["A", "B", "M"])
    assert p["all"]["kappa"] == pytest.approx(0.3) and p["all"]["acc_sum"] == pytest.approx(1.2)  # None left out
    assert analysis.cohort_probe(pairs, ["M", "A"])["color"]["kappa"] is None  # "A+M" found either way round


def test_the_type_as_asked_matches_the_type_of_the_answer_on_every_train_question():
    assert all(asked_type(ex.question) == easyvqa_question_type(ex.answer) for ex in load_easyvqa(None, "train"))


def test_skill_weighted_slices():
    mix = dict(skill_mix("A", 0.8, ("color", "shape")))
    assert mix == {"color/A": 0.8, "color/B": pytest.approx(0.2), "shape/A": 0.8, "shape/B": pytest.approx(0.2)}
    examples = [Example(id=str(i), question="q", metadata={"k": "xy"[i % 2]}) for i in range(20)]
    picked = mixed_by(examples, "k", {"x": 3, "y": 1}, 8)  # 6 x and 2 y, the first of each in source order
    assert [ex.id for ex in picked] == ["0", "2", "4", "6", "8", "10", "1", "3"]
    with pytest.raises(DataError, match="not enough examples"):
        mixed_by(examples, "k", {"x": 1}, 11)
    with pytest.raises(DataError, match="non-negative shares"):
        mixed_by(examples, "k", {"x": -1, "y": 2}, 4)


def test_quick_experiment_end_to_end(tmp_path):
    out = tmp_path / "x"
    proc = python_m("vlm_corl.experiments.easyvqa", "--quick", "--rl-steps", 3, "--out", out, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["split"] == "test" and set(results["seeds"]) == {"0", "1"}
    assert results["budget"]["rl_steps"] == 3 and "3 steps" in (out / "results.md").read_text()
    for methods in results["seeds"].values():
        assert list(methods) == list(METHODS)
        for method, run in methods.items():
            trained = {mid for mid, _, extra in METHODS[method][0] if extra.get("trainable", True)}
            assert set(run["eval"]) == trained, method
            assert json.loads((out / run["run_dir"] / "summary.json").read_text())["steps"] == 3
    # the table's intervals come from the seeds: recompute one member's Δ balanced by hand
    deltas = [
        results["seeds"][s]["ring, complementary A+B"]["eval"]["B"]["accuracy"]
        - results["bases"]["B"]["test"]["accuracy"]
        for s in ("0", "1")
    ]
    cell = results["table"]["ring, complementary A+B"]["B"]["d_accuracy"]
    assert cell["mean"] == pytest.approx(sum(deltas) / 2)
    assert cell["ci"] == pytest.approx(12.706 * abs(deltas[0] - deltas[1]) / math.sqrt(2) / math.sqrt(2))
    pg = results["probe_gain"]
    assert [r["method"] for r in pg["rows"]] == list(RING_COHORTS) and len(RING_COHORTS) >= 6
    assert set(results["cohort_probe"]) == set(METHODS)
    for test in pg["spearman"].values():
        assert test["rho"] is None or -1 <= test["rho"] <= 1
    assert [c["claim"][:3] for c in results["claims"]] == ["(a)", "(b)", "(c)", "(d)", "(e)", "(f)"]
    table = (out / "results.md").read_text()
    for method in ["question-only baseline", *METHODS, "Spearman's rho", "## Claims"]:
        assert method in table
    for plot in (
        "probe_vs_gain",
        "pseudo_label_acc",
        "reward",
        "agreement",
        "distinct_answers",
        "answer_entropy_batch",
    ):
        assert (out / f"{plot}.png").stat().st_size > 1000
    # one method again on the same base models, with overrides, scored on validation
    proc = python_m(
        "vlm_corl.experiments.easyvqa_try",
        *("--bases", out / "base", "--method", "gt-labels", "--limit", 15, "--out", tmp_path / "try"),
        *("train.max_steps=2", "data.batch_size=4", "rollout.n=2"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tried = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(tried["members"]) == {"A", "B"} and tried["overrides"][-1] == "rollout.n=2"
    for mid, m in tried["members"].items():
        # the base's validation score is the probe's: the same 15 balanced validation questions
        probe = json.loads((out / "base" / mid / "probe_records.json").read_text())
        assert m["base"]["balanced"] == pytest.approx(sum(r["correct"] for r in probe) / len(probe))
        assert m["change_points"] == pytest.approx(100 * (m["after"]["balanced"] - m["base"]["balanced"]), abs=0.01)
    assert tried["cohort_change_points"] == pytest.approx(
        sum(m["change_points"] for m in tried["members"].values()) / 2, abs=0.01
    )
    rows = (tmp_path / "try" / "runs" / "gt-labels-seed0" / "metrics.jsonl").read_text().splitlines()
    assert {json.loads(r)["step"] for r in rows} == {1, 2}  # the override trained 2 steps, not the budget's 120


@pytest.mark.parametrize(
    "args, message",
    [
        (["--method", "nope"], "is not a method of the experiment; one of: ring-complementary-a-b"),
        (["--method", "gt-labels"], "no base model A, B there"),
        (["--method", "gt-labels", "rollout.nn=3"], "unknown key 'rollout.nn'"),
        (["--method", "gt-labels", "train.lr=abc"], "train.lr: expected a number"),
    ],
)
def test_easyvqa_try_names_the_mistake(tmp_path, capsys, args, message):
    bases = tmp_path / "base"
    if len(args) > 2:  # base models present: the override is what is wrong
        for b in ("A", "B"):
            (bases / b).mkdir(parents=True)
            (bases / b / "config.json").write_text("{}")
    argv = ["--bases", str(bases), "--out", str(tmp_path / "o"), *args]
    assert cli.run(easyvqa_try.main, argv) == 2
    assert message in capsys.readouterr().err
