"""Report the problems of a record dataset: `python -m data_tools.validate PATH`.

PATH is a JSON Lines file in the "jsonl" loader's format (what `data_tools.prepare` writes) or a directory of
them (every <split>.jsonl). Every split is read with `vlm_corl.data.load_examples`, whose checks are reported as
they are: undecodable_line, bad_record, empty_question, duplicate_id, missing_image, corrupt_image,
zero_size_image, unreadable_image, oversized_image. The records it keeps are then checked for:

    missing_answer        no answer, or a blank one
    unparseable_answer    neither a plain-word answer nor one math-verify reads a mathematical object from
                          (it then keeps the bare string, which only the very same string equals)
    choice_out_of_range   a letter answer past the last choice (choices A-D, answer "E")
    answer_not_a_choice   with choices, an answer that names none of them by letter or by text
    unloadable_split      a split that cannot be read at all, or of which no record survives

A record is reported under its first problem only. The table gives each problem's count and its first few
records. Exit status: 0 when there is no problem, 1 when there is any, 2 on a user error (no such path, a
directory without .jsonl files).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from data_tools.prepare import quiet_load_warnings
from vlm_corl import cli
from vlm_corl.data.answers import VERIFY_TIMEOUT_S, choice_letter, normalize_answer
from vlm_corl.data.answers.normalize import is_word_answer
from vlm_corl.data.loaders import DataError, LoadReport, load_examples
from vlm_corl.data.records import Example
from vlm_corl.errors import UserError

SAMPLES = 3  # records named per problem in the table
_LETTER = re.compile(r"\(?([A-Z])\)?\.?")


def split_files(path: Path) -> dict[str, Path]:
    """split name -> file: the file itself (named by its stem), or every .jsonl file of a directory."""
    if path.is_file():
        return {path.stem: path}
    if path.is_dir():
        found = {file.stem: file for file in sorted(path.glob("*.jsonl"))}
        if found:
            return found
        raise UserError(f"{path} holds no .jsonl file; give a record file or the directory data_tools.prepare wrote")
    raise UserError(f"{path} does not exist: give a record file (.jsonl) or a directory of them")


def answer_problem(example: Example, parses: dict[str, bool]) -> str | None:
    """The problem of the example's answer, if any; `parses` caches math-verify's verdict per answer."""
    answer = (example.answer or "").strip()
    if not answer:
        return "missing_answer"
    if example.choices:
        letter = _LETTER.fullmatch(answer)
        if letter and ord(letter[1]) - ord("A") >= len(example.choices):
            return "choice_out_of_range"
        return "answer_not_a_choice" if choice_letter(answer, example.choices) is None else None
    normal = normalize_answer(answer)
    if is_word_answer(normal):
        return None  # compared as text
    if normal not in parses:
        parses[normal] = math_parses(normal)
    return None if parses[normal] else "unparseable_answer"


def math_parses(answer: str) -> bool:
    """Whether math-verify reads a mathematical object from a (normalised) answer, parsed as vlm_corl.data.answers
    parses it, inside \\boxed{}. Its own timeout is a SIGALRM, which works here: a command's main thread."""
    from math_verify import parse

    parsed = parse("\\boxed{" + answer + "}", parsing_timeout=int(VERIFY_TIMEOUT_S))  # an alarm takes an int
    return any(not isinstance(item, str) for item in parsed)


def validate(path: Path) -> tuple[dict[str, LoadReport], LoadReport]:
    """Each split's load report, and one report of the problems found on the records kept ("kept": clean)."""
    reports: dict[str, LoadReport] = {}
    extra = LoadReport("validate", str(path), "all")
    parses: dict[str, bool] = {}
    for split, file in split_files(path).items():
        try:
            with quiet_load_warnings():
                loaded = load_examples("jsonl", file, split=split)
        except DataError as e:
            extra.skip("unloadable_split", f"{split}: {str(e).splitlines()[0].rstrip(':')}")
            continue
        reports[split] = loaded.report
        for ex in loaded.examples:
            problem = answer_problem(ex, parses)
            if problem is None:
                extra.kept += 1
            else:
                extra.skip(problem, f"{split}: {ex.id}")
    return reports, extra


def table(reports: dict[str, LoadReport], extra: LoadReport) -> tuple[str, int]:
    """The problem table, and the number of problems in it."""
    rows: dict[str, list] = {}
    for split, report in reports.items():
        for reason, count in report.skipped.items():
            row = rows.setdefault(reason, [0, []])
            row[0] += count
            row[1].extend(f"{split}: {s}" for s in report.samples[reason])
    for reason, count in extra.skipped.items():
        rows.setdefault(reason, [0, []])[0] += count
        rows[reason][1].extend(extra.samples[reason])
    total = sum(count for count, _ in rows.values())
    lines = [f"{'problem':22s} {'count':>6s}  examples"]
    lines += [f"{reason:22s} {count:6d}  {'; '.join(samples[:SAMPLES])}" for reason, (count, samples) in rows.items()]
    return "\n".join(lines), total


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser(
        "python -m data_tools.validate",
        __doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=__doc__,
    )
    parser.add_argument("path", type=Path, help="a record file (.jsonl) or a directory of them")
    args = cli.parse(parser, argv)
    reports, extra = validate(args.path)
    text, problems = table(reports, extra)
    records = sum(r.kept + r.total_skipped for r in reports.values())
    print(
        f"{args.path}: {records} records in {len(reports)} split(s) ({', '.join(reports) or 'none readable'}); "
        f"{problems} problem(s)"
    )
    if problems:
        print(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
