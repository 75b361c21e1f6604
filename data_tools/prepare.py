"""Convert a training-set release on local disk into the project's records: one JSON Lines file per split.

    python -m data_tools.prepare --format NAME --src LOCAL --out DIR [--levels 3,4,5] [--rephrased PATH]

Formats: math (Hendrycks MATH), dapo_math_17k, geometry3k (hiyouga's parquet or the InterGPS folders),
multimodal_open_r1_8k_verified, mmr1_math_rl; their schemas, and where they were verified, are in
data_tools/sources.py. Nothing is downloaded.

Output, what the "jsonl" loader reads (`vlm_corl.data.loaders.load_examples("jsonl", DIR, split=...)`):

    DIR/<split>.jsonl   {"id", "question", "images": ["images/<file>", ...] (relative to the file), "answer",
                         "choices": [...] or null, "paraphrases": [...], <the release's other fields>}
    DIR/images/         every image as a file, in its own encoding
    DIR/prepare_report.json   {"format", "src", "out", "splits": {<split>: {"kept", "skipped", "samples", ...}}}

Every row not written is counted by reason, the reader's (no_boxed_answer, level_not_kept, no_answer,
duplicate_problem, bad_record) and load_examples' (empty_question, duplicate_id, missing_image,
corrupt_image, ...); the counts are printed at the end and written to prepare_report.json. Existing
<split>.jsonl files in DIR are replaced. A --src that is not the named release ends with one error line (exit 2).

math only: --levels keeps those difficulty levels (default 3,4,5); --rephrased PATH adds a rewording of every
train problem as its paraphrase (view "paraphrase:1"): JSON Lines, row i for the train split's i-th problem of
all levels, subjects in sorted order then by number, each row an object with the wording under "rewritten",
"problem" or "question" and optionally the "original" problem, which must match. A count mismatch is an error.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import re
import sys
from collections.abc import Iterator
from pathlib import Path

from PIL import Image

from data_tools.sources import DEFAULT_LEVELS, SOURCES
from vlm_corl import cli
from vlm_corl.data.loaders import DataError, LoadReport, load_examples
from vlm_corl.data.records import Example, ImageSource, TableImage


def levels_arg(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated MATH levels, each 1-5."""
    try:
        levels = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected levels like 3,4,5, got {text!r}") from None
    if not levels or not all(1 <= level <= 5 for level in levels):
        raise argparse.ArgumentTypeError(f"MATH levels are 1 to 5, got {text!r}")
    return levels


def record(example: Example, images: list[str]) -> dict:
    """The JSON object of one example, its images given as paths relative to the output file. A release field
    named like a record field (a "question" column beside the "problem" read as the question) gets "release_"."""
    fields = {
        "id": example.id,
        "question": example.question,
        "images": images,
        "answer": example.answer,
        "choices": None if example.choices is None else list(example.choices),
        "paraphrases": list(example.paraphrases),
    }
    return {**fields, **{f"release_{k}" if k in fields else k: v for k, v in example.metadata.items()}}


def save_image(src: ImageSource, folder: Path, stem: str, used: set[str]) -> str:
    """Write one image into `folder` under a name made from `stem` (unique in `used`); its path from the output."""
    data = src.read() if isinstance(src, TableImage) else src if isinstance(src, bytes) else Path(src).read_bytes()
    extension = Image.open(io.BytesIO(data)).format.lower().replace("jpeg", "jpg")  # load_examples decoded it once
    base = re.sub(r"[^A-Za-z0-9._-]+", "_", stem)
    name, n = f"{base}.{extension}", 1
    while name in used:  # ids that differ only in characters a file name cannot hold
        name, n = f"{base}-{n}.{extension}", n + 1
    used.add(name)
    folder.mkdir(exist_ok=True)
    (folder / name).write_bytes(data)
    return f"{folder.name}/{name}"


def write_split(out: Path, split: str, examples: list[Example], used: set[str]) -> Path:
    """DIR/<split>.jsonl with every example, its images saved into DIR/images/."""
    file = out / f"{split}.jsonl"
    with open(file, "w", encoding="utf-8") as handle:
        for ex in examples:
            images = [save_image(src, out / "images", f"{ex.id}-{k}", used) for k, src in enumerate(ex.images)]
            handle.write(json.dumps(record(ex, images), ensure_ascii=False) + "\n")
    return file


def release_splits(fmt: str, src: Path, rephrased: Path | None = None) -> list[str]:
    """The splits of the release at `src`; DataError naming the path and what a release of `fmt` looks like."""
    source = SOURCES[fmt]
    if not src.exists():
        raise DataError(f"--src {src} does not exist: give {source.expected}, on local disk (nothing is downloaded)")
    splits = source.splits(src)
    if not splits:
        raise DataError(f"--src {src} is not {source.expected}")
    if rephrased is not None and "train" not in splits:
        raise DataError(f"--rephrased rewords the train split, but {src} has only {', '.join(splits)}")
    return splits


def prepare(
    fmt: str,
    src: Path,
    out: Path,
    splits: list[str],
    levels: tuple[int, ...] | None = None,
    rephrased: Path | None = None,
) -> dict[str, LoadReport]:
    """Convert `splits` of the release at `src` into `out`; the load report of each split."""
    read = SOURCES[fmt].read
    reports, used = {}, set()
    for split in splits:
        options = (
            {}
            if fmt != "math"
            else {"levels": levels or DEFAULT_LEVELS, "rephrased": rephrased if split == "train" else None}
        )
        with quiet_load_warnings():
            loaded = load_examples(f"{read.__module__}:{read.__name__}", src, split, **options)
        write_split(out, split, loaded.examples, used)
        loaded.report.loader = fmt  # the report names the format, not the reader function
        reports[split] = loaded.report
    return reports


@contextlib.contextmanager
def quiet_load_warnings() -> Iterator[None]:
    """Without load_examples' warning of dropped records: the data tools print their own table of them."""
    data_log = logging.getLogger("vlm_corl.data.loaders")
    level = data_log.level
    data_log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        data_log.setLevel(level)


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(
        "python -m data_tools.prepare",
        __doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
    )
    parser.add_argument("--format", required=True, choices=sorted(SOURCES), help="the release's format")
    parser.add_argument("--src", required=True, type=Path, help="the release on local disk (file or folder)")
    parser.add_argument("--out", required=True, type=Path, help="output directory: <split>.jsonl, images/, report")
    parser.add_argument(
        "--levels",
        type=levels_arg,
        default=None,
        help=f"math: levels to keep (default {','.join(map(str, DEFAULT_LEVELS))})",
    )
    parser.add_argument("--rephrased", type=Path, default=None, help="math: row-aligned rewordings of the train split")
    args = cli.parse(parser, argv)
    if args.format != "math" and (args.levels or args.rephrased):
        parser.error("--levels and --rephrased are for --format math")
    splits = release_splits(args.format, args.src, args.rephrased)
    out = cli.output_dir(args.out, "--out")
    reports = prepare(args.format, args.src, out, splits, args.levels, args.rephrased)
    summary = {
        "format": args.format,
        "src": str(args.src),
        "out": str(out),
        "splits": {split: report.as_dict() for split, report in reports.items()},
    }
    (out / "prepare_report.json").write_text(json.dumps(summary, indent=2) + "\n")
    for split, report in reports.items():
        print(f"{report.summary()}\n  -> {out / f'{split}.jsonl'}")
    print(f"report: {out / 'prepare_report.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
