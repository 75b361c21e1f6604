"""A benchmark from a YAML file alone: `python -m vlm_corl.eval --benchmarks path/to/bench.yaml` or
`eval.benchmarks: [path/to/bench.yaml]` in a cohort file (the benchmark registry resolves such paths here).

    name: geometry_val                    # how results name it (default: the file's stem)
    data: data/geometry_val.jsonl         # .jsonl, .json or .parquet file, or a directory with <split>.<ext>;
                                          # relative to this YAML file
    split: test                           # for a directory (default: test)
    fields: {id: qid, question: problem, answer: solution, choices: options, images: image}  # record field names
    image_root: data/images               # where relative image paths start (default: the data file's folder)
    category: subject                     # a record field to report accuracy by (optional)
    balance_by: subject                   # take --limit examples evenly over its values (optional)
    answer_type: number                   # number | expression | choice | text
    metric: avg@4                         # accuracy | avg@K | maj@K | pass@K (K samples per question)
    decoding: {temperature: 0.6, top_p: 0.95, max_new_tokens: 1024}   # default: greedy, 512 tokens

Every field is checked when the file is read; a mistake names the file and the field.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from vlm_corl.errors import UserError

if TYPE_CHECKING:
    from vlm_corl.evaluation.scoring import Benchmark

ANSWER_TYPES = ("number", "expression", "choice", "text")
METRIC = re.compile(r"(accuracy)|(avg|maj|pass)@([1-9][0-9]*)")
KEYS = {"name", "data", "split", "fields", "image_root", "category", "balance_by", "answer_type", "metric", "decoding"}
DECODING = {"temperature", "top_p", "max_new_tokens"}


class BenchmarkFileError(UserError):
    """A benchmark YAML file that cannot be used (names the file and the field)."""


def load_benchmark_file(path: str | Path) -> Benchmark:
    """The `vlm_corl.evaluation.scoring.Benchmark` a YAML file describes; BenchmarkFileError for any mistake in it."""
    from vlm_corl.evaluation.scoring import Benchmark

    path = Path(path)
    spec = _read(path)
    where = str(path)
    unknown = set(spec) - KEYS
    if unknown:
        raise BenchmarkFileError(f"{where}: unknown key(s) {sorted(unknown)}; valid: {sorted(KEYS)}")
    data = spec.get("data")
    if not isinstance(data, str):
        raise BenchmarkFileError(f"{where}: 'data' must name a .jsonl/.json/.parquet file or a directory")
    data_path = (path.parent / data).resolve()
    answer_type = spec.get("answer_type", "expression")
    if answer_type not in ANSWER_TYPES:
        raise BenchmarkFileError(f"{where}: answer_type {answer_type!r} is not one of {', '.join(ANSWER_TYPES)}")
    metric = str(spec.get("metric", "accuracy"))
    match = METRIC.fullmatch(metric)
    if not match:
        raise BenchmarkFileError(f"{where}: metric {metric!r} is not accuracy, avg@K, maj@K or pass@K")
    decoding = spec.get("decoding") or {}
    if not isinstance(decoding, dict) or set(decoding) - DECODING:
        raise BenchmarkFileError(f"{where}: decoding takes {sorted(DECODING)}, got {decoding!r}")
    fields = spec.get("fields") or {}
    if not isinstance(fields, dict):
        raise BenchmarkFileError(f"{where}: fields maps our names (id, question, answer, ...) to the records' names")
    samples = 1 if match.group(1) else int(match.group(3))
    if samples > 1 and decoding.get("temperature", 0.0) == 0:
        raise BenchmarkFileError(
            f"{where}: metric {metric} samples {samples} answers per question, which needs decoding.temperature > 0"
        )
    options = {"fields": fields}
    if spec.get("image_root") is not None:
        options["image_root"] = str((path.parent / spec["image_root"]).resolve())
    return Benchmark(
        name=str(spec.get("name") or path.stem),
        loader=_loader(data_path),
        split=str(spec.get("split", "test")),
        path=str(data_path),
        balance_by=spec.get("balance_by"),
        category=spec.get("category"),
        temperature=float(decoding.get("temperature", 0.0)),
        top_p=float(decoding.get("top_p", 1.0)),
        max_new_tokens=int(decoding.get("max_new_tokens", 512)),
        options=options,
        answer_type=answer_type,
        metric=metric,
        samples=samples,
    )


def _read(path: Path) -> dict:
    try:
        spec = yaml.safe_load(path.read_text())
    except OSError as err:
        raise BenchmarkFileError(f"{path}: cannot read the benchmark file ({err.strerror or err})") from err
    except yaml.YAMLError as err:
        raise BenchmarkFileError(f"{path}: invalid YAML ({str(err).splitlines()[0]})") from err
    if not isinstance(spec, dict):
        raise BenchmarkFileError(f"{path}: a benchmark file is a mapping (name, data, fields, ...)")
    return spec


def _loader(data: Path) -> str:
    """`jsonl` for JSON Lines (a file or a directory of <split>.jsonl), else `hf` (parquet, json, arrow)."""
    if data.suffix == ".jsonl" or (data.is_dir() and any(data.glob("*.jsonl"))):
        return "jsonl"
    return "hf"
