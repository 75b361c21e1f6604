"""Cohort probe (issue 5 item 3): the pairwise maths against numbers worked by hand, the recommendation on
hand-built evaluation records, one CLI run on two tiny zoo models (files and table, not numbers), and every number
flag's mistakes refused (exit 2 naming the flag) before any model loads."""

import json
import math

import pytest

from vlm_corl import cli
from vlm_corl.commands.probe import main, model_names, probe_parser
from vlm_corl.evaluation.pairs import (
    COLLAPSE_WARNING,
    accuracy_sum,
    accuracy_sum_se,
    both_wrong_rate,
    cohen_kappa,
    complementarity,
    pair_report,
    probe,
    same_wrong_rate,
)

# Ten questions. A right on 1-6, B right on 1-4 and 7.
#   both right 1-4 (4), A only 5-6 (2), B only 7 (1), both wrong 8-10 (3)
#   p_o = 7/10, p_A = .6, p_B = .5, p_e = .6*.5 + .4*.5 = .5, kappa = (.7 - .5) / (1 - .5) = .4
A = [1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
B = [1, 1, 1, 1, 0, 0, 1, 0, 0, 0]


def test_pairwise_maths_worked_by_hand():
    assert cohen_kappa(A, B) == pytest.approx(0.4)
    assert complementarity(A, B) == pytest.approx(0.3)
    assert accuracy_sum(A, B) == pytest.approx(1.1)
    assert both_wrong_rate(A, B) == pytest.approx(0.3)
    # c_A + c_B = [2,2,2,2,1,1,1,0,0,0]: mean 1.1, population variance 6.9/10, s.e. = sqrt(.69/10)
    assert accuracy_sum_se(A, B) == pytest.approx(math.sqrt(0.069))
    # Both wrong on 8-10: the same wrong answer on 8 only; two missing answers (10) are not an agreement.
    pa = ["x"] * 7 + ["red", "blue", None]
    pb = ["x"] * 7 + ["red", "green", None]
    assert same_wrong_rate(A, B, pa, pb) == pytest.approx(0.1)


def test_kappa_other_cases_by_hand():
    # p_o = 3/5, p_A = .6, p_B = .2, p_e = .12 + .32 = .44: kappa = .16 / .56 = 2/7
    assert cohen_kappa([1, 1, 1, 0, 0], [1, 0, 0, 0, 0]) == pytest.approx(2 / 7)
    assert cohen_kappa([1, 1, 0, 0], [0, 0, 1, 1]) == pytest.approx(-1.0)  # perfectly complementary
    assert complementarity([1, 1, 0, 0], [0, 0, 1, 1]) == 1.0
    assert cohen_kappa([1, 0, 1], [1, 0, 1]) == 1.0
    assert cohen_kappa([1, 1], [0, 0]) == 0.0  # p_e = 0, p_o = 0
    # Degenerate: p_e = 1 (both constant and equal) -> kappa undefined -> None
    assert cohen_kappa([1, 1, 1], [1, 1, 1]) is None
    assert cohen_kappa([0, 0], [0, 0]) is None
    assert cohen_kappa([], []) is None
    with pytest.raises(ValueError):
        cohen_kappa([1, 0], [1])


def _records(correct: str, types: str, wrong: dict[int, str] | None = None) -> list[dict]:
    """Six questions; gold "g<i>"; a right answer predicts gold, a wrong one "w<i>" unless given in `wrong`."""
    out = []
    for i, (c, t) in enumerate(zip(correct, types)):
        pred = f"g{i}" if c == "1" else (wrong or {}).get(i, f"w{i}")
        out.append(
            {"id": f"q{i}", "type": {"c": "color", "s": "shape"}[t], "pred": pred, "gold": f"g{i}", "correct": c == "1"}
        )
    return out


TYPES = "ccccss"
# X 5/6, Y 4/6 (errors nested in X's, same wrong answer on q5), Z 2/6 (right where X and Y are wrong).
#   X+Y: sum 9/6, kappa (5*6 - (5*4 + 1*2)) / (36 - 22) = 8/14;   shape: 1/2 + 0 = .5 < 1 -> flagged
#   X+Z: sum 7/6, kappa (1*6 - (5*2 + 1*4)) / (36 - 14) = -8/22
#   Y+Z: sum 6/6 = 1 (not > 1), kappa (0 - (4*2 + 2*4)) / (36 - 16) = -.8: lowest kappa, yet ranked last
MODELS = {
    "X": _records("111110", TYPES, {5: "circle"}),
    "Y": _records("111100", TYPES, {5: "circle"}),
    "Z": _records("000011", TYPES),
}


def test_pair_report_on_hand_built_records():
    r = pair_report(MODELS["X"], MODELS["Y"])
    assert r["overall"]["kappa"] == pytest.approx(8 / 14)
    assert r["overall"]["acc_sum"] == pytest.approx(9 / 6)
    assert r["overall"]["same_wrong"] == pytest.approx(1 / 6)  # q5, both "circle"
    assert r["overall"]["both_wrong"] == pytest.approx(1 / 6)
    assert r["by_type"]["color"]["kappa"] is None  # both right on every colour question
    assert r["by_type"]["shape"]["acc_sum"] == pytest.approx(0.5)
    assert r["by_type"]["shape"]["same_wrong"] == pytest.approx(0.5)
    assert r["collapse_types"] == ["shape"]
    # Records are matched by id, not by position.
    assert pair_report(MODELS["X"], MODELS["Y"][::-1])["overall"] == r["overall"]
    with pytest.raises(ValueError, match="different questions"):
        pair_report(MODELS["X"], MODELS["Y"][:5])


def test_recommendation_prefers_p_sum_above_one_then_low_kappa():
    report = probe(MODELS)
    order = [(p["a"], p["b"]) for p in report["pairs"]]
    assert order == [("X", "Z"), ("X", "Y"), ("Y", "Z")]
    assert [p["rank"] for p in report["pairs"]] == [1, 2, 3]
    assert report["pairs"][0]["overall"]["kappa"] == pytest.approx(-8 / 22)
    assert report["pairs"][2]["overall"]["kappa"] == pytest.approx(-0.8)
    rec = report["recommendation"]
    assert rec["ring_pair"] == ["X", "Z"] and rec["viable"]
    assert any(f.startswith("X + Y: shape") and COLLAPSE_WARNING in f for f in rec["flags"])
    assert report["models"]["X"]["accuracy"] == pytest.approx(5 / 6)
    assert report["models"]["Y"]["by_type"] == {"color": 1.0, "shape": 0.0}
    assert "p_A + p_B > 1" in report["rule"]


def test_recommendation_when_no_pair_clears_one():
    weak = {"P": _records("100000", TYPES), "Q": _records("010000", TYPES)}
    rec = probe(weak)["recommendation"]
    assert not rec["viable"] and "No pair has p_A + p_B > 1" in rec["text"]
    assert len(rec["flags"]) == 2  # both types
    with pytest.raises(ValueError):
        probe({"P": weak["P"]})


def test_model_names(tmp_path):
    assert list(model_names([str(tmp_path / "a" / "qwen"), str(tmp_path / "b" / "qwen")])) == ["a/qwen", "b/qwen"]
    assert model_names(["q=" + str(tmp_path / "x"), str(tmp_path / "y")]) == {
        "q": str(tmp_path / "x"),
        "y": str(tmp_path / "y"),
    }


def test_cli_on_two_tiny_zoo_models(tiny_zoo, tmp_path, capsys):
    out = tmp_path / "probe"
    assert (
        main(
            [
                "--models",
                str(tiny_zoo["qwen2_vl"]),
                str(tiny_zoo["mllama"]),
                "--benchmark",
                "easyvqa",
                "--limit",
                "12",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    assert "## Models" in table and "| rank | pair |" in table and "## Recommendation" in table
    report = json.loads((out / "probe.json").read_text())
    names = list(report["models"])
    assert len(names) == 2 and report["n"] == 12 and len(report["pairs"]) == 1
    assert set(report["pairs"][0]["by_type"]) == {"color", "shape", "yes/no"}
    assert sorted(report["recommendation"]["ring_pair"]) == sorted(names)
    assert (out / "probe.md").read_text().startswith("# Cohort probe: easyvqa [test], 12 questions")
    # the label headroom of the one cohort, from 4 sampled answers per question, under every topology
    assert "## Label headroom of every cohort (K = 4 samples at temperature 1.0" in table
    (cohort,) = report["headroom"]["ranking"]
    assert cohort["members"] == names and cohort["n"] == 12
    assert set(cohort["modes"]) == {"ring", "peers", "soft", "self_vote", "gt"}
    assert cohort["modes"]["self_vote"]["headroom"]["all"]["mean"] == 0.0
    assert cohort["modes"]["peers"]["headroom"] == cohort["modes"]["ring"]["headroom"]  # of two: the same


# flag, bad value, what the message says (after "argument FLAG: ")
BAD_NUMBERS = [
    ("--temperature", "-1", "must be a finite number above 0 (got -1)"),  # would sample the inverted distribution
    ("--temperature", "0", "must be a finite number above 0 (got 0)"),  # greedy: K identical answers
    ("--temperature", "nan", "must be a finite number above 0 (got nan)"),
    ("--temperature", "hot", "expected a number, got 'hot'"),
    ("--skip", "-5", "must be at least 0 (got -5)"),
    ("--skip", "1.5", "expected a whole number, got '1.5'"),
    ("--limit", "0", "must be at least 1 (got 0)"),
    ("--samples", "-2", "must be at least 1 (got -2)"),
]


@pytest.mark.parametrize("flag, value, message", BAD_NUMBERS, ids=[f"{f} {v}" for f, v, _ in BAD_NUMBERS])
def test_a_bad_number_exits_2_naming_the_flag_before_any_model_loads(tmp_path, capsys, flag, value, message):
    missing = [str(tmp_path / "a"), str(tmp_path / "b")]  # never opened: the arguments are refused first
    with pytest.raises(SystemExit) as exit_:
        cli.run(main, ["--models", *missing, flag, value])
    assert exit_.value.code == 2
    assert f"argument {flag}: {message}" in capsys.readouterr().err


def test_good_numbers_parse():
    args = probe_parser().parse_args(["--models", "a", "b", "--skip", "0", "--temperature", "0.7", "--samples", "1"])
    assert (args.skip, args.temperature, args.samples, args.limit) == (0, 0.7, 1, 600)
