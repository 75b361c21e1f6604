"""LiveCodeBench code generation in its official release format, graded by running the model's program in
`vlm_corl.evaluation.sandbox` against every public and private test.

    python -m vlm_corl.eval --models DIR --benchmarks livecodebench --data livecodebench=code_generation_lite/ --out OUT

The release (`livecodebench/code_generation_lite` on the Hugging Face hub) is JSON Lines files `test.jsonl`,
`test2.jsonl` … `test6.jsonl`, one problem per line: question_title, question_content, platform (leetcode,
atcoder, codeforces), question_id, contest_id, contest_date (ISO), starter_code, difficulty (easy, medium,
hard), public_test_cases (a JSON list of {input, output, testtype}), private_test_cases (the same JSON, or
base64 of zlib-compressed pickle of that JSON string) and metadata (JSON; "func_name" for functional problems).
Checked against LiveCodeBench's own loader and checker (lcb_runner/benchmarks/code_generation.py and
lcb_runner/evaluation/testing_util.py, LiveCodeBench/LiveCodeBench at 28fef95, July 2025).

Splits are LiveCodeBench's version tags: "release_vN" is test.jsonl … testN.jsonl (release_v6: 1,055 problems,
May 2023 - Apr 2025), "vN" the N-th file alone, "vA_vB" files A to B, "release_latest" every test*.jsonl
present. `start_date`/`end_date` ("YYYY-MM-DD", both inclusive, compared with contest_date as lcb_runner's
--start_date/--end_date do) keep a contest window. A path that is one file is read whole, whatever the split.

The private tests are never unpickled with plain pickle (that runs arbitrary code from a data file): a restricted
unpickler admits plain str/bytes/numbers/lists/dicts and refuses every global, and such a record is a counted
Skip ("unsafe_pickle").
"""

from __future__ import annotations

import base64
import io
import json
import os
import pickle
import re
import zlib
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import NoReturn

from text_corl.code import extract_code
from text_corl.data import jsonl_rows
from vlm_corl.data.loaders import DataError, Skip, missing_path
from vlm_corl.data.records import Example

TIME_LIMIT_S = 6  # per test case, lcb_runner's default --timeout
MAX_PRIVATE_BYTES = 1 << 30  # decompressed size of one record's private tests: a zip bomb is a bad record
VERSIONS = 6  # test.jsonl … test6.jsonl
# lcb_runner prepends these star-imports to every program (stdin and functional), so solutions may use e.g.
# `deque` or `sys` without importing them; the same names must be in scope here for the same verdicts.
_PRELUDE_MODULES = (
    "string",
    "re",
    "datetime",
    "collections",
    "heapq",
    "bisect",
    "copy",
    "math",
    "random",
    "statistics",
    "itertools",
    "functools",
    "operator",
    "io",
    "sys",
    "json",
)
PRELUDE = (
    "".join(f"from {m} import *\n" for m in (*_PRELUDE_MODULES, "builtins", "typing"))
    + "".join(f"import {m}\n" for m in _PRELUDE_MODULES)
    + "sys.setrecursionlimit(50000)\n"
)


def version_files(split: str) -> list[str] | None:
    """The release files of a version tag ("release_v6", "v2", "v1_v3"), or None for "release_latest"."""
    if split == "release_latest":
        return None
    m = re.fullmatch(r"release_v(\d+)|v(\d+)(?:_v(\d+))?", split)
    if m:
        first, last = (1, int(m[1])) if m[1] else (int(m[2]), int(m[3] or m[2]))
        if 1 <= first <= last <= VERSIONS:
            return ["test.jsonl" if n == 1 else f"test{n}.jsonl" for n in range(first, last + 1)]
    raise DataError(
        f"unknown LiveCodeBench split {split!r}: use release_v1 … release_v{VERSIONS}, release_latest, "
        f"v1 … v{VERSIONS} or vA_vB (LiveCodeBench's version tags)"
    )


def load_livecodebench(
    path: str | os.PathLike | None,
    split: str = "release_v6",
    *,
    start_date: str | None = None,
    end_date: str | None = None,
) -> Iterator[Example | Skip]:
    """Problems of a release (see the module docstring) with contest_date in [start_date, end_date].

    Ids: "lcb-<question_id>". metadata: title, platform, difficulty, contest_id, contest_date, func_name (None
    for stdin problems) and tests, every public then private (input, output) pair.
    """
    start, end = (
        None if d is None else _date(d, name) for d, name in ((start_date, "start_date"), (end_date, "end_date"))
    )
    for file in _release_files(path, split):
        for number, row in jsonl_rows(file):
            if isinstance(row, Skip):
                yield row
                continue
            where = f"{file}:{number}"
            try:
                date = datetime.fromisoformat(row["contest_date"])
            except (TypeError, KeyError, ValueError):
                yield Skip("bad_record", f"{where}: no ISO contest_date")
                continue
            if (start and date < start) or (end and date > end):
                continue  # another contest window, as mbpp's other splits: selection, not a bad record
            yield _example(row, where, date)


def _date(text: str, name: str) -> datetime:
    try:
        return datetime.strptime(text, "%Y-%m-%d")
    except ValueError as e:
        raise DataError(f"livecodebench {name} must be YYYY-MM-DD, got {text!r}") from e


def _release_files(path: str | os.PathLike | None, split: str) -> list[Path]:
    if path is None:
        raise DataError(
            "the 'livecodebench' loader needs the code_generation_lite release: a directory of "
            "test*.jsonl files or one of them (--data livecodebench=PATH; nothing is downloaded)"
        )
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise missing_path(path)
    names = version_files(split)
    if names is None:
        names = sorted((p.name for p in path.glob("test*.jsonl")), key=lambda n: (len(n), n))
    missing = [n for n in names if not (path / n).is_file()]
    if missing or not names:
        raise DataError(
            f"{path} lacks {', '.join(missing) or 'any test*.jsonl'} for LiveCodeBench split {split!r}; "
            f"give the directory holding the code_generation_lite release files"
        )
    return [path / n for n in names]


def _example(row: object, where: str, date: datetime) -> Example | Skip:
    if not isinstance(row, dict) or not isinstance(row.get("question_content"), str):
        return Skip("bad_record", f"{where}: needs question_content")
    try:
        tests = _cases(json.loads(row.get("public_test_cases") or "[]")) + _private_cases(row.get("private_test_cases"))
        func_name = json.loads(row.get("metadata") or "{}").get("func_name")
    except _UnsafePickle as e:
        return Skip("unsafe_pickle", f"{where}: private_test_cases: {e}")
    except (
        ValueError,
        TypeError,
        AttributeError,
        KeyError,
        IndexError,
        zlib.error,
        pickle.UnpicklingError,
        EOFError,
    ) as e:  # the ways a malformed JSON, base64, zlib or pickle payload fails to decode
        return Skip("bad_tests", f"{where}: {type(e).__name__}: {e}")
    if not tests:
        return Skip("bad_tests", f"{where}: no test cases")
    starter = row.get("starter_code") or ""
    if starter.strip():
        task = f"Complete this starter code; the tests call its method:\n```python\n{starter}\n```"
    else:
        task = "Read the input from standard input and write the answer to standard output."
    return Example(
        id=f"lcb-{row.get('question_id')}",
        question=f"{row['question_content'].strip()}\n\n{task}",
        source="livecodebench",
        metadata={
            "title": row.get("question_title"),
            "platform": row.get("platform"),
            "difficulty": row.get("difficulty"),
            "contest_id": row.get("contest_id"),
            "contest_date": date.isoformat(),
            "func_name": func_name,
            "tests": tests,
        },
    )


def _cases(items: object) -> list[tuple[str, str]]:
    """(input, output) pairs of a decoded test list; ValueError when it is not a list of such objects."""
    if not isinstance(items, list) or not all(
        isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str) for t in items
    ):
        raise ValueError("test cases must be a list of {input, output} strings")
    return [(t["input"], t["output"]) for t in items]


class _UnsafePickle(pickle.UnpicklingError):
    """A pickle that names a global (a class or function): refused, never imported."""


class _PlainUnpickler(pickle.Unpickler):
    """Builds only what pickle's opcodes make without globals (str, bytes, numbers, lists, dicts, ...)."""

    def find_class(self, module: str, name: str) -> NoReturn:
        raise _UnsafePickle(f"refused global {module}.{name}")

    def persistent_load(self, pid: object) -> NoReturn:
        raise _UnsafePickle("refused persistent id")


def _private_cases(blob: object) -> list[tuple[str, str]]:
    """The private tests: JSON text, or base64 of zlib-compressed pickle of JSON text (the lite release)."""
    if not blob:
        return []
    try:
        text = json.loads(blob)
    except ValueError:  # not JSON: the compressed form
        inflater = zlib.decompressobj()
        data = inflater.decompress(base64.b64decode(blob, validate=True), MAX_PRIVATE_BYTES)
        if inflater.unconsumed_tail:
            raise ValueError(f"private tests decompress to more than {MAX_PRIVATE_BYTES} bytes") from None
        pickled = _PlainUnpickler(io.BytesIO(data)).load()
        if not isinstance(pickled, (str, bytes)):
            raise ValueError(f"the pickle holds a {type(pickled).__name__}, not the JSON text of the tests") from None
        text = json.loads(pickled)
    return _cases(text)


def grade_livecodebench(example: Example, response: str) -> bool:
    """The response's last code block passes every test: stdin problems case by case through `run_io_cases`
    (`sandbox.same_output`: lines stripped, numbers compared as decimals, "1.0" = "1", as lcb_runner compares
    them), functional ones by calling
    `Solution().<func_name>` (or a top-level function of that name) on each case's inputs, one JSON value per
    line, and comparing the result with the JSON-decoded expected output (a tuple counts as a list), as
    lcb_runner does."""
    from vlm_corl.evaluation.sandbox import Limits, run_io_cases, run_tests

    meta = example.metadata
    program = PRELUDE + extract_code(response)
    tests = meta["tests"]
    if meta.get("func_name") is None:
        limits = Limits(wall_s=TIME_LIMIT_S, cpu_s=TIME_LIMIT_S)
        return all(run_io_cases(program, [case], limits)[0].passed for case in tests)  # stops at the first failure
    budget = (TIME_LIMIT_S + 1) * len(tests) + 5  # lcb_runner's whole-problem timeout
    outcome = run_tests(program, functional_harness(meta["func_name"], tests), Limits(wall_s=budget, cpu_s=budget))
    return outcome.passed


def functional_harness(func_name: str, tests: list[tuple[str, str]]) -> str:
    """Test code that calls the method on every case, with lcb_runner's per-case time limit."""
    return f"""
import json as _json, signal as _signal
def _over_time(*_):
    raise TimeoutError("over the {TIME_LIMIT_S} s limit of one test")
_signal.signal(_signal.SIGALRM, _over_time)
_solver = Solution() if isinstance(globals().get("Solution"), type) else None
_method = getattr(_solver, {func_name!r}) if _solver is not None else globals()[{func_name!r}]
for _i, (_input, _output) in enumerate(_json.loads({json.dumps(tests)!r})):
    _signal.alarm({TIME_LIMIT_S})
    _got = _method(*[_json.loads(_line) for _line in _input.split("\\n")])
    _signal.alarm(0)
    _got = list(_got) if isinstance(_got, tuple) else _got
    assert _got == _json.loads(_output), f"test {{_i}}: wrong answer"
"""


def accuracy_by_platform(records: list[dict], examples: list[Example]) -> dict:
    """The second breakdown, next to the one per difficulty: accuracy per platform (`Benchmark.aggregate`)."""
    platform = {ex.id: ex.metadata.get("platform") for ex in examples}
    groups: dict[str, list[float]] = {}
    for r in records:
        groups.setdefault(str(platform[r["id"]]), []).append(r["correct"])
    return {"by_platform": {name: sum(v) / len(v) for name, v in sorted(groups.items())}}
