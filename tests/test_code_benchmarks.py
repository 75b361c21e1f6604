"""HumanEval and MBPP in their release formats (fixtures written from the documented schemas), graded by running
the model's code against the tests in the sandbox: a whole function, a completion of the prompt, wrong code."""

import gzip
import json

import pytest
from cohort_helpers import write_jsonl

from text_corl.code import extract_code, grade_humaneval, grade_mbpp
from vlm_corl.data.loaders import load_examples
from vlm_corl.members.rollout import Response, RolloutGroup
from vlm_corl.registry import BENCHMARKS

PROMPT = 'from typing import List\n\n\ndef total(xs: List[int]) -> int:\n    """Sum of xs."""\n'
TEST = "def check(candidate):\n    assert candidate([1, 2, 3]) == 6\n    assert candidate([]) == 0\n"


@pytest.fixture
def humaneval(tmp_path):
    rows = [
        {
            "task_id": "HumanEval/0",
            "prompt": PROMPT,
            "canonical_solution": "    return sum(xs)\n",
            "test": TEST,
            "entry_point": "total",
        },
        {"task_id": "HumanEval/1", "prompt": "def one():\n", "test": "def check(f):\n    assert f() == 1\n"},
    ]
    path = tmp_path / "HumanEval.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_humaneval_rows_and_grading_in_the_sandbox(humaneval):
    loaded = load_examples("humaneval", humaneval)
    assert [e.id for e in loaded.examples] == ["HumanEval/0"] and loaded.report.skipped == {"bad_record": 1}
    ex = loaded.examples[0]
    assert PROMPT in ex.question and ex.metadata["entry_point"] == "total"
    whole = "Here it is:\n```python\ndef total(xs: List[int]) -> int:\n    return sum(xs)\n```"
    completion = "```python\n    return sum(xs)\n```"
    assert grade_humaneval(ex, whole)  # List comes from the prompt's imports
    assert grade_humaneval(ex, completion)  # appended to the prompt
    assert not grade_humaneval(ex, "```python\ndef total(xs):\n    return 0\n```")
    assert not grade_humaneval(ex, "```python\nimport socket\nsocket.create_connection(('8.8.8.8', 53))\n```")


def test_mbpp_split_of_the_full_release_and_grading(tmp_path):
    write_jsonl(
        tmp_path / "mbpp.jsonl",
        [
            {
                "task_id": 11,
                "text": "Write a function to add two numbers.",
                "code": "def add(a, b):\n    return a + b",
                "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
                "test_setup_code": "",
            },
            {"task_id": 600, "text": "A validation task.", "code": "", "test_list": ["assert True"]},
        ],
    )
    examples = load_examples("mbpp", tmp_path / "mbpp.jsonl", split="test").examples
    assert [e.id for e in examples] == ["mbpp-11"] and "assert add(1, 2) == 3" in examples[0].question
    assert grade_mbpp(examples[0], "```python\ndef add(a, b):\n    return a + b\n```")
    assert not grade_mbpp(examples[0], "```python\ndef add(a, b):\n    return a - b\n```")


def test_extract_code_takes_the_last_block():
    assert extract_code("a\n```python\nx = 1\n```\nthen\n```py\nx = 2\n```") == "x = 2\n"
    assert extract_code("no block") == "no block"


def test_humaneval_through_evaluation_with_the_code_prompt(tiny_zoo, humaneval, monkeypatch):
    import vlm_corl.evaluation.scoring as ev

    seen = []

    class Canned:
        def generate(self, prompts, params):
            seen.extend(p.text for p in prompts)
            return [RolloutGroup(p, [Response([1], "```python\n    return sum(xs)\n```", "stop")]) for p in prompts]

    monkeypatch.setattr(ev, "make_engine", lambda name, member: Canned())
    bench = BENCHMARKS.get("humaneval")
    result = ev.evaluate_dir(tiny_zoo["qwen3"], bench, ev.benchmark_examples(bench, None, str(humaneval)))
    assert result["accuracy"] == 1.0 and result["score"] == 1.0 and result["metric"] == "pass@1"
    assert "Write your solution as one Python code block" in seen[0] and "\\boxed" not in seen[0]
