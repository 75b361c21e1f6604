"""LiveCodeBench in its code_generation_lite release format (fixtures written from the schema of LiveCodeBench's
own loader): release files and the contest window, private tests compressed or plain, a pickle that would run
code refused, and grading in the sandbox for stdin and functional problems."""

import base64
import json
import pickle
import zlib

import pytest
from cohort_helpers import write_jsonl

from text_corl.livecodebench import grade_livecodebench, version_files
from vlm_corl.data.loaders import DataError, load_examples
from vlm_corl.registry import BENCHMARKS


def compressed(obj) -> str:
    """The lite release's form of private tests: base64 of zlib of a pickle."""
    return base64.b64encode(zlib.compress(pickle.dumps(obj))).decode()


class RunsCode:
    """A pickled object whose unpickling would create a file: the restricted unpickler must refuse it."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def problem(qid, date, *, platform="atcoder", difficulty="easy", public, private, starter="", func_name=None):
    return {
        "question_title": f"title {qid}",
        "question_content": f"Problem {qid}.",
        "platform": platform,
        "question_id": qid,
        "contest_id": "c1",
        "contest_date": date,
        "starter_code": starter,
        "difficulty": difficulty,
        "public_test_cases": json.dumps(public),
        "private_test_cases": private,
        "metadata": json.dumps({"func_name": func_name} if func_name else {}),
    }


def stdin_case(i, o):
    return {"input": i, "output": o, "testtype": "stdin"}


def call_case(i, o):
    return {"input": i, "output": o, "testtype": "functional"}


@pytest.fixture
def release(tmp_path):
    marker = tmp_path / "pwned"
    write_jsonl(
        tmp_path / "test.jsonl",
        [
            problem(
                "abc001_a",
                "2023-06-01T00:00:00",
                public=[stdin_case("1 2\n", "3\n")],
                private=json.dumps([stdin_case("2 2\n", "4\n")]),
            ),  # before the v6 window
        ],
    )
    for n in (2, 3, 4, 5):
        (tmp_path / f"test{n}.jsonl").write_text("")
    write_jsonl(
        tmp_path / "test6.jsonl",
        [
            problem(
                "abc400_a",
                "2025-03-01T12:00:00",
                public=[stdin_case("1 2\n", "3\n")],
                private=compressed(json.dumps([stdin_case("5 5\n", "10\n"), stdin_case("0 0\n", "0\n")])),
            ),
            problem(
                "3500",
                "2025-02-10T00:00:00",
                platform="leetcode",
                difficulty="medium",
                func_name="pairSum",
                starter="class Solution:\n    def pairSum(self, nums: List[int], k: int) -> List[int]:\n        ",
                public=[call_case("[1, 2]\n3", "[3, 3]")],
                private=json.dumps([call_case("[4]\n0", "[4, 0]")]),
            ),
            problem(
                "abc401_b",
                "2025-04-01T00:00:00",
                public=[stdin_case("1\n", "1\n")],
                private=compressed(RunsCode(str(marker))),
            ),
        ],
    )
    with open(tmp_path / "test6.jsonl", "a") as f:
        f.write("{not json\n")
    return tmp_path, marker


def test_the_v6_window_tests_decoded_and_a_code_running_pickle_refused(release):
    path, marker = release
    bench = BENCHMARKS.get("livecodebench")
    loaded = load_examples("livecodebench", path, split=bench.split, **bench.options)
    assert [e.id for e in loaded.examples] == ["lcb-abc400_a", "lcb-3500"]
    assert loaded.report.skipped == {"unsafe_pickle": 1, "bad_json": 1} and not marker.exists()
    stdin, functional = loaded.examples
    assert stdin.metadata["tests"] == [("1 2\n", "3\n"), ("5 5\n", "10\n"), ("0 0\n", "0\n")]
    assert stdin.metadata["func_name"] is None and "standard input" in stdin.question
    assert functional.metadata["func_name"] == "pairSum" and "def pairSum(self" in functional.question
    assert (functional.metadata["platform"], functional.metadata["difficulty"]) == ("leetcode", "medium")
    # The whole release without a window, and a single file read whole.
    assert len(load_examples("livecodebench", path, split="release_v6").examples) == 3
    assert [e.id for e in load_examples("livecodebench", path / "test.jsonl").examples] == ["lcb-abc001_a"]


def test_split_names_follow_livecodebench_version_tags(release):
    assert version_files("release_v2") == ["test.jsonl", "test2.jsonl"]
    assert version_files("v6") == ["test6.jsonl"] and version_files("v4_v5") == ["test4.jsonl", "test5.jsonl"]
    with pytest.raises(DataError, match="unknown LiveCodeBench split 'v7'"):
        version_files("v7")
    path, _ = release
    (path / "test3.jsonl").unlink()
    with pytest.raises(DataError, match="lacks test3.jsonl"):
        load_examples("livecodebench", path, split="release_v6")
    with pytest.raises(DataError, match="start_date must be YYYY-MM-DD"):
        load_examples("livecodebench", path / "test.jsonl", start_date="March 2025")


def test_grading_stdin_and_functional_problems_in_the_sandbox(release):
    path, _ = release
    stdin, functional = load_examples("livecodebench", path, split="v6").examples[:2]
    # No import: LiveCodeBench's prelude provides sys, as lcb_runner's does.
    assert grade_livecodebench(stdin, "```python\na, b = map(int, sys.stdin.read().split())\nprint(a + b)\n```")
    # Passes the public case, fails a private one.
    assert not grade_livecodebench(stdin, "```python\nprint(3)\n```")
    # A tuple counts as the expected list; List comes from the prelude's typing import.
    solution = (
        "```python\nclass Solution:\n    def pairSum(self, nums: List[int], k: int) -> List[int]:\n"
        "        return (sum(nums), k)\n```"
    )
    assert grade_livecodebench(functional, solution)
    assert not grade_livecodebench(functional, solution.replace("sum(nums)", "nums[0]"))


def test_benchmark_defaults_and_accuracy_per_platform(release):
    bench = BENCHMARKS.get("livecodebench")
    assert (bench.temperature, bench.top_p, bench.metric, bench.prompt_style, bench.category) == (
        0.6,
        0.95,
        "pass@1",
        "code",
        "difficulty",
    )
    examples = load_examples("livecodebench", release[0], split="release_v6").examples
    records = [
        {"id": "lcb-abc001_a", "correct": 1.0},
        {"id": "lcb-abc400_a", "correct": 0.0},
        {"id": "lcb-3500", "correct": 1.0},
    ]
    assert bench.aggregate(records, examples) == {"by_platform": {"atcoder": 0.5, "leetcode": 1.0}}
