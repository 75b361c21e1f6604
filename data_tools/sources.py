"""Readers of the training-set releases that `python -m data_tools.prepare` converts.

Each reader is a `vlm_corl.data.loaders` loader, `(path, split, **options) -> Iterable[Example | Skip]`, so that
`load_examples` applies the project's own checks (empty question, duplicate id, images that do not decode) and
counts every dropped row by reason; the reader adds the reasons only it can see. `SOURCES[name].splits(path)`
lists the splits a release holds (none: the path is not that release). Images stay encoded (bytes, or the
file's path) until prepare writes them.

Schemas, as verified (and where):

- math: Hendrycks MATH, `MATH/<split>/<subject>/<n>.json` = {problem, level: "Level N", type, solution}; the
  answer is the solution's last \\boxed{} (hendrycks/math README; verl's examples/data_preprocess/math_dataset.py
  takes the same last box). Rows are read subject by subject (sorted), then by number.
- dapo_math_17k: BytedTsinghua-SIA/DAPO-Math-17k `data/dapo-math-17k.parquet` = {data_source, prompt: [{role,
  content}], ability, reward_model: {ground_truth, style}, extra_info: {index}}; the user message wraps the
  problem in "Solve the following math problem step by step. The last line … \\n\\n" and "\\n\\nRemember to put
  your answer on its own line after \\"Answer:\\"." (loaders in elliot-zzh/from-transparent-to-opaque and
  AISBench's dapo_math config). Each problem appears many times: repeats are dropped ("duplicate_problem").
- geometry3k: hiyouga/geometry3k `data/{train,validation,test}-00000-of-00001.parquet` = {images: [Image],
  problem ("<image>Find x."), answer} (its dataset card; verl's examples/data_preprocess/geo3k.py), or the
  InterGPS release (lupantech/InterGPS README) `<split>/<id>/data.json` = {id, problem_text, choices: [4],
  answer: "A".."D", problem_type_graph, problem_type_goal, …} + `img_diagram.png`, splits train/val/test.
- multimodal_open_r1_8k_verified: lmms-lab/multimodal-open-r1-8k-verified parquet = {image, problem, solution
  ("<think>…</think>\\n\\n<answer>X</answer>"), original_question, original_answer}; the answer is the last
  <answer> of the solution (EvolvingLMMs-Lab/open-r1-multimodal local_scripts/prepare_hf_data.py builds it so).
- mmr1_math_rl: MMR1/MMR1-Math-RL-Data-v0 `data/{train,validation}-00000-of-00001.parquet` = {images, problem,
  answer}, the EasyR1 layout (MMR1's EasyR1 recipe reads it with prompt_key problem, answer_key answer,
  image_key images). Only indirectly verified: the dataset card itself was not found.

The "<image>" placeholders of the EasyR1-style problems are removed: the renderer places the images itself.
"""

from __future__ import annotations

import json
import os
import re
import string
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from text_corl.data import jsonl_rows
from vlm_corl.data.answers import extract_answer
from vlm_corl.data.loaders import DataError, Skip, _open_hf, example_from_row
from vlm_corl.data.records import Example

DEFAULT_LEVELS = (3, 4, 5)
_IMAGE_TOKEN = re.compile(r"<image>\s*")
_DAPO_HEAD = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
_DAPO_TAIL = '\n\nRemember to put your answer on its own line after "Answer:".'


@dataclass(frozen=True)
class Source:
    """A release format: its reader (a loader), its splits and what a --src of it looks like."""

    read: Callable[..., Iterator[Example | Skip]]
    splits: Callable[[Path], list[str]]
    expected: str


# ---------------------------------------------------------------------------------------------------------
# Hendrycks MATH


def math_splits(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if any(p.glob("*/*.json"))) if path.is_dir() else []


def read_math(
    path: str | os.PathLike,
    split: str,
    *,
    levels: tuple[int, ...] = DEFAULT_LEVELS,
    rephrased: str | os.PathLike | None = None,
) -> Iterator[Example | Skip]:
    """MATH problems of `levels` with a boxed answer; `rephrased` (JSON Lines, one row per problem of the
    split, all levels, in reading order) gives each its paraphrase (see `rephrasings`)."""
    files = sorted((Path(path) / split).glob("*/*.json"), key=lambda f: (f.parent.name, _number(f.stem)))
    wordings = rephrasings(rephrased, files, Path(path) / split) if rephrased is not None else None
    for index, file in enumerate(files):
        rel = f"{split}/{file.parent.name}/{file.name}"  # the MATH-500 id form: "test/precalculus/807.json"
        try:
            row = json.loads(file.read_bytes())
            problem, solution, level = row["problem"], row["solution"], row.get("level", "")
        except (OSError, ValueError, KeyError, TypeError) as e:
            yield Skip("bad_record", f"{rel}: {type(e).__name__}: {e}")
            continue
        number = _number(str(level).removeprefix("Level "))
        if number not in levels:
            yield Skip("level_not_kept", f"{rel}: {level!r} (--levels {','.join(map(str, levels))})")
            continue
        answer = extract_answer(solution, "boxed")
        if answer is None:
            yield Skip("no_boxed_answer", f"{rel}: the solution has no \\boxed{{}} answer")
            continue
        yield Example(
            id=rel,
            question=problem,
            answer=answer,
            source="math",
            paraphrases=() if wordings is None else (wordings[index],),
            metadata={"level": number, "subject": row.get("type"), "solution": solution},
        )


def _number(text: str) -> int | float:
    return int(text) if text.isdigit() else float("inf")  # "Level ?" and odd file names sort last, match no level


_WORDING_KEYS = ("rewritten", "problem", "question")  # Co-rewarding's rephrased MATH names it "rewritten"


def rephrasings(path: str | os.PathLike, files: list[Path], folder: Path) -> list[str]:
    """Row i of the rephrased file is the rewording of files[i]. Rows are objects with the wording under one of
    _WORDING_KEYS; a row's "original", when present, must be that problem. Raises DataError naming both files on
    a count mismatch or a misaligned row."""
    rows = list(jsonl_rows(Path(path)))
    if len(rows) != len(files):
        raise DataError(
            f"--rephrased {path} has {len(rows)} rows but {folder} has {len(files)} problems: the rows "
            f"must align one to one with the split's problems (all levels, subjects sorted, then by "
            f"number)"
        )
    wordings = []
    for (number, row), file in zip(rows, files):
        wording = next((row[k] for k in _WORDING_KEYS if isinstance(row, dict) and isinstance(row.get(k), str)), None)
        if wording is None:
            raise DataError(
                f"--rephrased {path}:{number}: no rephrased problem (a string under one of {', '.join(_WORDING_KEYS)})"
            )
        original = row.get("original")
        if isinstance(original, str) and original.strip() != _problem_text(file).strip():
            raise DataError(
                f"--rephrased {path}:{number} rewords another problem than {file}: the rows are not in "
                f"the split's order"
            )
        wordings.append(wording)
    return wordings


def _problem_text(file: Path) -> str:
    """The problem of a MATH file, or "" when it cannot be read (read_math counts that file as a bad record)."""
    try:
        problem = json.loads(file.read_bytes()).get("problem")
    except (OSError, ValueError, AttributeError):
        return ""
    return problem if isinstance(problem, str) else ""


# ---------------------------------------------------------------------------------------------------------
# Parquet releases (read through vlm_corl.data.loaders's Hugging Face reader)


def parquet_splits(path: Path) -> list[str]:
    """The splits `datasets` infers from the file names (train-00000-of-00001.parquet, …); one file is "train"."""
    if path.is_file() and path.suffix == ".parquet":
        return ["train"]
    if not (path.is_dir() and any(path.rglob("*.parquet"))):
        return []
    from datasets.data_files import get_data_patterns

    return [str(split) for split in get_data_patterns(str(path))]


def parquet_rows(path: str | os.PathLike, split: str) -> Iterator[tuple[int, dict]]:
    """(row number, row) of a split, image columns left as stored ({"bytes", "path"})."""
    import datasets

    datasets.disable_progress_bars()  # one bar per split converted, and the summary says it all
    with tempfile.TemporaryDirectory() as cache:  # datasets converts to Arrow here, not in the user's cache
        dataset = _open_hf(Path(path), split, cache)
        number = 0
        for batch in dataset.with_format("arrow").iter(batch_size=256):
            for row in batch.to_pylist():
                yield number, row
                number += 1


def _easyr1_rows(path, split: str, source: str, answer: Callable[[Example], str | None] | None = None):
    """images/problem/answer rows (EasyR1's layout) as Examples without "<image>" placeholders."""
    root = Path(path) if Path(path).is_dir() else Path(path).parent
    for number, row in parquet_rows(path, split):
        item = example_from_row(
            row,
            fallback_id=f"{source}-{split}-{number:06d}",
            source=source,
            image_root=root.resolve(),
            fields={"question": "problem"},
        )
        if isinstance(item, Skip):
            yield item
            continue
        item = replace(
            item, question=_IMAGE_TOKEN.sub("", item.question).strip(), answer=answer(item) if answer else item.answer
        )
        yield item if item.answer and item.answer.strip() else Skip("no_answer", f"{item.id}: no answer")


def read_dapo(path: str | os.PathLike, split: str) -> Iterator[Example | Skip]:
    """DAPO-Math-17k's distinct problems, without the instruction wrapper; ids "dapo-<extra_info.index>"."""
    seen: set[str] = set()
    for number, row in parquet_rows(path, split):
        try:
            content = next(m["content"] for m in row["prompt"] if m.get("role") == "user")
            answer, index = row["reward_model"]["ground_truth"], row["extra_info"]["index"]
            problem = content.removeprefix(_DAPO_HEAD).removesuffix(_DAPO_TAIL).strip()
        except (KeyError, TypeError, AttributeError, StopIteration):
            yield Skip("bad_record", f"row {number}: needs a user prompt, reward_model.ground_truth, extra_info.index")
            continue
        if problem in seen:
            yield Skip("duplicate_problem", f"row {number} (index {index}): the problem of an earlier row")
            continue
        seen.add(problem)
        if not answer:
            yield Skip("no_answer", f"row {number} (index {index}): empty ground_truth")
            continue
        yield Example(
            id=f"dapo-{index}",
            question=problem,
            answer=str(answer),
            source="dapo_math_17k",
            metadata={"data_source": row.get("data_source")},
        )


def read_open_r1(path: str | os.PathLike, split: str) -> Iterator[Example | Skip]:
    """multimodal-open-r1-8k-verified: the answer is the last <answer>…</answer> of the solution."""
    return _easyr1_rows(
        path,
        split,
        "multimodal_open_r1_8k_verified",
        lambda ex: extract_answer(str(ex.metadata.get("solution") or ""), "answer_tags"),
    )


def read_mmr1(path: str | os.PathLike, split: str) -> Iterator[Example | Skip]:
    """MMR1-Math-RL-Data-v0 (images, problem, answer)."""
    return _easyr1_rows(path, split, "mmr1_math_rl")


# ---------------------------------------------------------------------------------------------------------
# Geometry3K: hiyouga's parquet or the InterGPS folders


def _intergps(path: Path) -> bool:
    return path.is_dir() and any(path.glob("*/*/data.json"))


def geometry3k_splits(path: Path) -> list[str]:
    if _intergps(path):
        return sorted(p.name for p in path.iterdir() if any(p.glob("*/data.json")))
    return parquet_splits(path)


def read_geometry3k(path: str | os.PathLike, split: str) -> Iterator[Example | Skip]:
    """Geometry3K from either release; InterGPS problems keep their four choices (listed in the question too,
    as the rewriter and the model see only the question) and their letter answer."""
    if not _intergps(Path(path)):
        yield from _easyr1_rows(path, split, "geometry3k")
        return
    folders = sorted((Path(path) / split).glob("*/data.json"), key=lambda f: _number(f.parent.name))
    for file in folders:
        try:
            row = json.loads(file.read_bytes())
            text, choices, answer = row["problem_text"], [str(c) for c in row["choices"]], str(row["answer"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            yield Skip("bad_record", f"{file}: {type(e).__name__}: {e}")
            continue
        listing = "\n".join(f"({string.ascii_uppercase[i]}) {c}" for i, c in enumerate(choices))
        yield Example(
            id=f"geometry3k-{row.get('id', file.parent.name)}",
            question=f"{text}\nChoices:\n{listing}",
            images=(str((file.parent / "img_diagram.png").resolve()),),
            answer=answer,
            choices=tuple(choices),
            source="geometry3k",
            metadata={k: row[k] for k in ("problem_type_graph", "problem_type_goal") if k in row},
        )


SOURCES: dict[str, Source] = {
    "math": Source(read_math, math_splits, "the Hendrycks MATH release folder, MATH/<split>/<subject>/<n>.json"),
    "dapo_math_17k": Source(read_dapo, parquet_splits, "DAPO-Math-17k's parquet file, or a folder holding it"),
    "geometry3k": Source(
        read_geometry3k,
        geometry3k_splits,
        "hiyouga/geometry3k's parquet files, or the InterGPS folders <split>/<id>/data.json",
    ),
    "multimodal_open_r1_8k_verified": Source(
        read_open_r1, parquet_splits, "lmms-lab/multimodal-open-r1-8k-verified's parquet files"
    ),
    "mmr1_math_rl": Source(read_mmr1, parquet_splits, "MMR1-Math-RL-Data-v0's parquet files"),
}
