"""We-Math (testmini: 1,740 records: 360 two-step and 165 three-step problems, each asked whole and step by
step) from its official release, with its four-dimensional metric.

Data, `--data wemath=PATH`: the release's `testmini.json` (or its folder; images from testmini.zip, paths such
as "2steps/image/1-1.png" relative to the JSON file's folder or `image_root`): a JSON list of records with
"ID" (the problem, e.g. "2steps_5", shared by its parts), "key" (the part: "2steps_1", "2steps_2",
"2steps_multi", "3steps_1" … "3steps_multi"), "split", "knowledge concept", "question", "option" ("A. 1 cm;B.
1.5 cm; …; E. No correct answer"), "answer" (a letter), "image_path", "question number", "knowledge concept
description". Or the Hugging Face parquet release We-Math/We-Math (the picture read from "image_path"); with no
path, `datasets.load_dataset("We-Math/We-Math", split="testmini")` when the hub is reachable. Ids are
"<ID>:<key>".

Prompt: the question and "Options: <option>" as released. Grading: the official script takes the first letter
after the response's last "Answer"; here our extraction, and the letter or the option's text.

Scores, verified against evaluation/four_dimensional_metrics.py and accuracy.py of
github.com/We-Math/We-Math: each multi-step problem is classified by its whole question ("multi") and its
steps ("<n>steps_i"):
- IK, insufficient knowledge: multi wrong and some step wrong;
- IG, inadequate generalization: multi wrong and every step right;
- CM, complete mastery: multi right and every step right (strict) / some step right (loose);
- RM, rote memorization: multi right and some step wrong (strict) / every step wrong (loose).
IK, IG and CM are shares of the problems, RM is a share of the problems whose multi is right (CM + RM); the
score is (N - 0.5 IG - RM - IK) / N with counts, strict and loose. The official script hard-codes N = 525 (the
testmini problems); here N is the number of problems whose every part was evaluated (525 on the whole of
testmini; a --limit that cuts a problem leaves it out). accuracy.py's S1 (steps), S2 (two-step multi) and S3
(three-step multi) accuracies come too.
"""

from __future__ import annotations

import os
import re
import string
from collections import Counter, defaultdict
from collections.abc import Iterator
from dataclasses import replace

from vlm_corl.data.loaders import Skip
from vlm_corl.data.records import Example
from vlm_corl.evaluation.benchmarks.common import Release, grade_response, release_examples
from vlm_corl.evaluation.scoring import Benchmark

_KEY = re.compile(r"(\d)steps_(\d|multi)")
_OPTION = re.compile(r"(?:^|;)\s*([A-H])\.\s*")
RELEASE = Release("wemath", hub="We-Math/We-Math", fields={"images": "image_path"})


def load_wemath(
    path: str | os.PathLike | None, split: str = "testmini", *, image_root: str | os.PathLike | None = None
) -> Iterator[Example | Skip]:
    """We-Math records (module doc); metadata keeps every other field of the record (ID, key, option, …)."""
    items = release_examples(RELEASE, path, split, image_root=image_root)
    return (item if isinstance(item, Skip) else _problem(item) for item in items)


def _problem(ex: Example) -> Example | Skip:
    meta, where = ex.metadata, ex.id
    key, option = str(meta.get("key")), str(meta.get("option"))
    if not meta.get("ID") or not _KEY.fullmatch(key):
        return Skip(
            "bad_record",
            f"{where}: needs an ID and a key like 2steps_1 or 2steps_multi (got "
            f"{meta.get('ID')!r}, {meta.get('key')!r})",
        )
    parts = _OPTION.split(option)  # ["", "A", "1 cm", "B", "1.5 cm", ...]
    letters, choices = parts[1::2], tuple(text.strip(" ;") for text in parts[2::2])
    if parts[0].strip() or not letters or letters != list(string.ascii_uppercase[: len(letters)]):
        return Skip("bad_record", f"{where}: option {option!r} is not 'A. …; B. …'")
    if ex.answer not in letters:
        return Skip("bad_record", f"{where}: answer {ex.answer!r} is not one of the options {''.join(letters)}")
    return replace(ex, id=f"{meta['ID']}:{key}", question=f"{ex.question}\nOptions: {option}", choices=choices)


def four_dimensional(records: list[dict], examples: list[Example]) -> dict:
    """We-Math's IK, IG, CM, RM (strict and loose), their counts and scores, and S1-S3 (module doc)."""
    meta = {ex.id: ex.metadata for ex in examples}
    parts: dict[str, dict[str, bool]] = defaultdict(dict)  # problem ID -> {key: answered right}
    for record in records:
        m = meta[record["id"]]
        parts[m["ID"]][m["key"]] = record["correct"] == 1
    strict, loose, steps_right, multi_right = Counter(), Counter(), [], defaultdict(list)
    for answers in parts.values():
        n = int(next(iter(answers))[0])
        steps, multi = [answers.get(f"{n}steps_{i}") for i in range(1, n + 1)], answers.get(f"{n}steps_multi")
        if multi is None or None in steps:
            continue  # not every part was evaluated
        strict_dim, loose_dim = _dimensions(steps, multi)
        strict[strict_dim] += 1
        loose[loose_dim] += 1
        steps_right += steps
        multi_right[f"S{n}"].append(multi)
    total = sum(strict.values())
    if not total:
        return {"four_dimensional": {"problems": 0}}
    counts = {"IK": strict["IK"], "IG": strict["IG"]}  # the same in both modes
    dims = {"problems": total, "IK": strict["IK"] / total, "IG": strict["IG"] / total}
    for mode, c in (("strict", strict), ("loose", loose)):
        counts |= {f"CM_{mode}": c["CM"], f"RM_{mode}": c["RM"]}
        dims[f"CM_{mode}"] = c["CM"] / total
        dims[f"RM_{mode}"] = c["RM"] / (c["CM"] + c["RM"]) if c["CM"] + c["RM"] else None
        dims[f"score_{mode}"] = (total - 0.5 * c["IG"] - c["RM"] - c["IK"]) / total
    accuracy = {
        "S1": sum(steps_right) / len(steps_right),
        **{k: sum(v) / len(v) for k, v in sorted(multi_right.items())},
    }
    return {"four_dimensional": dims, "counts": counts, "steps": accuracy}


def _dimensions(steps: list[bool], multi: bool) -> tuple[str, str]:
    """(strict, loose) dimension of one problem from its steps and its whole question."""
    if not multi:
        return ("IG", "IG") if all(steps) else ("IK", "IK")
    if all(steps):
        return "CM", "CM"
    return "RM", "CM" if any(steps) else "RM"


WEMATH = Benchmark(
    "wemath", "wemath", "testmini", max_new_tokens=1024, grade=grade_response, aggregate=four_dimensional
)
