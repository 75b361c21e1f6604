"""A benchmark from a YAML file alone (vlm_corl.evaluation.benchmark_file): read through the eval CLI and in-loop eval,
with field mapping, images, categories and sampled metrics; pass@k by hand; mistakes in the file exit 2."""

import json

import pytest
import yaml
from cohort_helpers import cohort, write_jsonl
from PIL import Image

from vlm_corl import cli
from vlm_corl.commands.eval import main
from vlm_corl.evaluation.scoring import pass_at_k
from vlm_corl.registry import BENCHMARKS


def _png(colour) -> Image.Image:
    return Image.new("RGB", (32, 32), colour)


@pytest.fixture
def bench_dir(tmp_path):
    """A JSONL benchmark in its own field names, with relative image paths, and its YAML file."""
    (tmp_path / "images").mkdir()
    rows = []
    for i, (colour, name) in enumerate([((255, 0, 0), "red"), ((0, 0, 255), "blue")] * 3):
        _png(colour).save(tmp_path / "images" / f"{i}.png")
        rows.append(
            {
                "qid": f"c{i}",
                "problem": "What colour is the image?",
                "solution": name,
                "pic": f"{i}.png",
                "topic": "colour" if i % 2 else "hue",
            }
        )
    write_jsonl(tmp_path / "val.jsonl", rows)
    spec = {
        "name": "colours",
        "data": "val.jsonl",
        "image_root": "images",
        "category": "topic",
        "fields": {"id": "qid", "question": "problem", "answer": "solution", "images": "pic"},
        "answer_type": "text",
        "metric": "maj@3",
        "decoding": {"temperature": 1.0, "max_new_tokens": 6},
    }
    (tmp_path / "colours.yaml").write_text(yaml.safe_dump(spec))
    return tmp_path


def test_pass_at_k_by_hand():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)  # 1 - C(3,2)/C(5,2)
    assert pass_at_k(4, 1, 4) == 1.0


def test_a_yaml_benchmark_runs_through_the_eval_cli(tiny_zoo, bench_dir, capsys):
    bench = BENCHMARKS.get(str(bench_dir / "colours.yaml"))
    assert (bench.name, bench.loader, bench.samples, bench.metric, bench.category) == (
        "colours",
        "jsonl",
        3,
        "maj@3",
        "topic",
    )
    out = bench_dir / "out"
    assert (
        cli.run(
            main,
            ["--models", str(tiny_zoo["qwen2_vl"]), "--benchmarks", str(bench_dir / "colours.yaml"), "--out", str(out)],
        )
        == 0
    )
    r = json.loads((out / "results.json").read_text())[str(tiny_zoo["qwen2_vl"])]["colours"]
    assert r["n"] == 6 and set(r["by_type"]) == {"colour", "hue"} and r["samples"] == 3
    assert r["score"] == r["maj@3"] and {"avg@3", "pass@3"} <= set(r)
    assert all(len(rec["preds"]) == 3 for rec in r["records"])
    assert r["avg@3"] == pytest.approx(sum(rec["n_correct"] for rec in r["records"]) / 18)
    assert r["avg@3"] <= r["pass@3"]  # a question passed at 3 when any sample is right
    assert "| colours | 6 | maj@3 |" in (out / "results.md").read_text()


def test_a_yaml_benchmark_in_a_cohort_file_is_evaluated_in_the_loop(tiny_zoo, bench_dir):
    from vlm_corl.config import config_from_dict
    from vlm_corl.training.loop import run_cohort

    cfg = cohort(
        bench_dir,
        [("q", tiny_zoo["qwen2_vl"])],
        reward={"mode": "self_vote"},
        eval={"every": 1, "benchmarks": [str(bench_dir / "colours.yaml")], "limit": 4},
    )
    run_cohort(config_from_dict(cfg))
    rows = [json.loads(line) for line in (bench_dir / "run" / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["benchmark"], r["n"]) for r in rows] == [
        (0, "colours", 4),
        (1, "colours", 4),
        (2, "colours", 4),
    ]


@pytest.mark.parametrize(
    "change, message",
    [
        ({"metric": "top@3"}, "metric 'top@3' is not accuracy, avg@K, maj@K or pass@K"),
        ({"answer_type": "float"}, "answer_type 'float' is not one of"),
        ({"colour": 1}, "unknown key(s) ['colour']"),
        ({"metric": "avg@4", "decoding": {"temperature": 0.0}}, "needs decoding.temperature > 0"),
        ({"data": "none.jsonl"}, "none.jsonl does not exist"),
    ],
)
def test_a_mistake_in_a_benchmark_file_names_it_and_exits_2(tiny_zoo, bench_dir, capsys, change, message):
    spec = yaml.safe_load((bench_dir / "colours.yaml").read_text()) | change
    (bench_dir / "bad.yaml").write_text(yaml.safe_dump(spec))
    code = cli.run(
        main,
        [
            "--models",
            str(tiny_zoo["qwen2_vl"]),
            "--benchmarks",
            str(bench_dir / "bad.yaml"),
            "--out",
            str(bench_dir / "o"),
        ],
    )
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err


def test_list_names_the_registered_benchmarks(capsys):
    assert cli.run(main, ["--list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()[:-1]]
    assert {
        "easyvqa",
        "math500",
        "gsm8k",
        "amc23",
        "gpqa_diamond",
        "mathvista",
        "mathverse",
        "mathvision",
        "wemath",
    } <= set(names)


class CannedEngine:
    """Answers every question with the same three responses: two say red, one says blue."""

    def __init__(self, member):
        self.member = member

    def generate(self, prompts, params):
        from vlm_corl.members.rollout import Response, RolloutGroup

        assert params.n == 3 and params.temperature == 1.0
        texts = ["<answer>red</answer>", "<answer>blue</answer>", "<answer>red</answer>"]
        return [RolloutGroup(p, [Response([1], t, "stop") for t in texts]) for p in prompts]


def test_sampled_metrics_on_known_answers(tiny_zoo, bench_dir, monkeypatch):
    """3 red and 3 blue questions, each answered red, blue, red: avg@3 = (3 x 2/3 + 3 x 1/3) / 6 = 0.5,
    maj@3 = 0.5 (the red questions), pass@3 = 1 (each question has a right sample); text answers match
    case-insensitively; per category (hue = the red ones, colour = the blue ones)."""
    import vlm_corl.evaluation.scoring as ev

    monkeypatch.setattr(ev, "make_engine", lambda name, member: CannedEngine(member))
    bench = BENCHMARKS.get(str(bench_dir / "colours.yaml"))
    examples = ev.benchmark_examples(bench, None)
    r = ev.evaluate_dir(tiny_zoo["qwen2_vl"], bench, examples)
    assert r["avg@3"] == pytest.approx(0.5) and r["maj@3"] == pytest.approx(0.5) and r["pass@3"] == 1.0
    assert r["score"] == r["maj@3"]
    assert r["by_type"] == pytest.approx({"hue": 2 / 3, "colour": 1 / 3})
    assert [rec["n_correct"] for rec in r["records"]] == [2, 1, 2, 1, 2, 1]
