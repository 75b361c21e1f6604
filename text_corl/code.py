"""Code benchmarks (HumanEval, MBPP) in their official release formats, graded by running the model's program
against the benchmark's tests in `vlm_corl.evaluation.sandbox` (own process, limits, no network).

    python -m vlm_corl.eval --models DIR --benchmarks humaneval --data humaneval=HumanEval.jsonl.gz --out OUT

Loaders put the benchmark's test code in metadata; `grade_humaneval` / `grade_mbpp` take the last ```python
block of a response (or the whole response when there is none) and pass iff every test passes.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

from text_corl.data import release_rows
from vlm_corl.data.loaders import Skip
from vlm_corl.data.records import Example

_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)```", re.DOTALL)
TIME_LIMIT_S = 10.0  # per task, the usual HumanEval/MBPP harness budget


def extract_code(response: str) -> str:
    """The last fenced code block of a response (```python … ```), else the response itself."""
    blocks = _BLOCK.findall(response)
    return blocks[-1] if blocks else response


def load_humaneval(path: str | os.PathLike | None, split: str = "test") -> Iterator[Example | Skip]:
    """HumanEval as openai/human-eval releases it: `HumanEval.jsonl(.gz)` of {"task_id", "prompt",
    "canonical_solution", "test", "entry_point"} (without a path: openai/openai_humaneval from the hub). The
    question shows the function to complete."""
    file, rows = release_rows(
        path, split, (".jsonl", ".jsonl.gz"), "humaneval", ("openai/openai_humaneval", None, split)
    )
    for number, row in rows:
        if isinstance(row, Skip):
            yield row
        elif not isinstance(row, dict) or not all(
            isinstance(row.get(k), str) for k in ("prompt", "test", "entry_point")
        ):
            yield Skip("bad_record", f"{file}:{number}: needs prompt, test and entry_point strings")
        else:
            question = f"Complete this Python function and return the whole function:\n```python\n{row['prompt']}```"
            yield Example(
                id=str(row.get("task_id") or f"humaneval-{number}"),
                question=question,
                source="humaneval",
                metadata={"prompt": row["prompt"], "test": row["test"], "entry_point": row["entry_point"]},
            )


def load_mbpp(path: str | os.PathLike | None, split: str = "test") -> Iterator[Example | Skip]:
    """MBPP as google-research releases it: `mbpp.jsonl` of {"task_id", "text", "code", "test_list",
    "test_setup_code"} (the sanitized release names the text "prompt"). With the full file, split "test" is
    task ids 11-510, "train" 601-974, "validation" 511-600, "prompt" 1-10 (the paper's split); a directory
    holding <split>.jsonl is read whole. The question shows the tests, as the MBPP prompt does."""
    file, rows = release_rows(path, split, (".jsonl",), "mbpp", ("google-research-datasets/mbpp", "full", split))
    ranges = {"test": (11, 510), "train": (601, 974), "validation": (511, 600), "prompt": (1, 10)}
    whole = path is not None and Path(file).name.startswith("mbpp") and split in ranges  # the hub's are split
    for number, row in rows:
        if isinstance(row, Skip):
            yield row
            continue
        text = row.get("text") or row.get("prompt") if isinstance(row, dict) else None
        tests = row.get("test_list") if isinstance(row, dict) else None
        if not isinstance(text, str) or not isinstance(tests, list) or not tests:
            yield Skip("bad_record", f"{file}:{number}: needs text (or prompt) and a test_list")
            continue
        task = row.get("task_id", number)
        if whole and isinstance(task, int) and not ranges[split][0] <= task <= ranges[split][1]:
            continue  # another split of the full release
        question = f"{text}\nYour code should pass these tests:\n" + "\n".join(tests)
        yield Example(
            id=f"mbpp-{task}",
            question=question,
            source="mbpp",
            metadata={"tests": tests, "setup": row.get("test_setup_code") or ""},
        )


def grade_humaneval(example: Example, response: str) -> bool:
    """The response's function (or, when it does not define the entry point, the prompt + the response as a
    completion) passes the task's `check(entry_point)`."""
    from vlm_corl.evaluation.sandbox import Limits, run_tests

    meta = example.metadata
    code = extract_code(response)
    program = code if re.search(rf"def\s+{re.escape(meta['entry_point'])}\s*\(", code) else meta["prompt"] + code
    # The prompt's imports (typing, math, …) are in scope for a rewritten function too.
    header = "\n".join(line for line in meta["prompt"].splitlines() if line.startswith(("import ", "from ")))
    outcome = run_tests(
        f"{header}\n{program}",
        f"{meta['test']}\ncheck({meta['entry_point']})",
        Limits(wall_s=TIME_LIMIT_S, cpu_s=TIME_LIMIT_S),
    )
    return outcome.status == "passed"


def grade_mbpp(example: Example, response: str) -> bool:
    """The response's code passes every assert of the task's test_list (after its setup code)."""
    from vlm_corl.evaluation.sandbox import Limits, run_tests

    meta = example.metadata
    outcome = run_tests(
        extract_code(response),
        meta["setup"] + "\n" + "\n".join(meta["tests"]),
        Limits(wall_s=TIME_LIMIT_S, cpu_s=TIME_LIMIT_S),
    )
    return outcome.status == "passed"
