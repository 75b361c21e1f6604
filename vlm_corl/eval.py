"""Evaluation: `python -m vlm_corl.eval --models DIR [DIR …] --benchmarks a,b --out DIR`.

A benchmark is a dataset (any registered loader), a decoding setting and a grading rule, registered in
`vlm_corl.registry.BENCHMARKS`. Models are loaded exactly as cohort members are (same rendering, same engine),
so evaluation sees what training sees. Writes `results.json` (per model, per benchmark, per question type,
and every prediction) and `results.md`.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from vlm_corl import cli
from vlm_corl.answers import answers_equivalent, extract_answer
from vlm_corl.config import MemberConfig
from vlm_corl.data import balance_by, load_examples
from vlm_corl.member import Member, check_modality, load_member, member_family
from vlm_corl.records import Example
from vlm_corl.registry import BENCHMARKS
from vlm_corl.render import Renderer
from vlm_corl.rollout import SamplingParams, make_engine


@dataclass(frozen=True)
class Benchmark:
    """A dataset split to evaluate on, and how.

    balance_by: a metadata key (e.g. "question_type"); the examples are then taken round-robin across its
    values, so a `limit` gives every type the same share (easy-vqa is 74% yes/no otherwise).
    """

    name: str
    loader: str
    split: str
    path: str | None = None
    balance_by: str | None = None
    temperature: float = 0.0  # greedy, as the paper evaluates multimodal benchmarks
    top_p: float = 1.0
    max_new_tokens: int = 64


# Found through the `vlm_corl.benchmarks` entry point (pyproject.toml), like text_corl's: a module-level
# registration would run twice under `python -m vlm_corl.eval` (as __main__, then as vlm_corl.eval).
EASYVQA = Benchmark("easyvqa", "easyvqa", "test", balance_by="question_type")


def benchmark_examples(bench: Benchmark, limit: int | None, path: str | None = None) -> list[Example]:
    """The benchmark's examples, balanced across `balance_by` values when set, at most `limit`."""
    examples = load_examples(bench.loader, path or bench.path, split=bench.split).examples
    return balance_by(examples, bench.balance_by, limit) if bench.balance_by else examples[:limit]


def evaluate_member(member: Member, examples: list[Example], bench: Benchmark, batch_size: int = 64,
                    max_image_pixels: int = 1280 * 28 * 28, progress: bool = False) -> dict:
    """Accuracy of `member` on `examples` (overall and per question type) and every prediction; `progress`
    shows a bar (with ETA) on a terminal."""
    render = Renderer(member, "original", max_image_pixels, max_prompt_tokens=1 << 30)
    engine = make_engine("hf", member)
    params = SamplingParams(n=1, temperature=bench.temperature, top_p=bench.top_p, max_new_tokens=bench.max_new_tokens)
    records = []
    bar = tqdm(total=len(examples), desc=f"eval {member.id} on {bench.name}", unit="q",
               disable=None if progress else True)
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        bar.update(len(chunk))
        groups = engine.generate([render(ex) for ex in chunk], params)
        for ex, group in zip(chunk, groups):
            text = group.responses[0].text
            pred = extract_answer(text, member.prompt_style, ex.choices)
            records.append({
                "id": ex.id, "type": ex.metadata.get(bench.balance_by) if bench.balance_by else None,
                "pred": pred, "gold": ex.answer, "correct": answers_equivalent(ex.answer, pred, ex.choices),
                "response": text,
            })
    bar.close()
    return {"accuracy": _acc(records), "by_type": _by_type(records), "n": len(records), "records": records}


def _acc(records: list[dict]) -> float:
    return sum(r["correct"] for r in records) / max(len(records), 1)


def _by_type(records: list[dict]) -> dict[str, float]:
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        if r["type"] is not None:
            groups[r["type"]].append(r)
    return {t: _acc(rs) for t, rs in sorted(groups.items())}


def check_models(models: dict[str, str], examples: list[Example]) -> None:
    """Before evaluating any: every model directory names a family and can read the examples (no text-only
    model on image questions)."""
    for name, path in models.items():
        check_modality(member_family(MemberConfig(id=name, model=str(path)), path), examples, f"model {name} ({path})")


def evaluate_dir(model_dir: str | Path, bench: Benchmark, examples: list[Example], name: str | None = None,
                 progress: bool = False) -> dict:
    """Load a saved model (zoo member or checkpoint) as a frozen member and evaluate it."""
    cfg = MemberConfig(id=name or Path(model_dir).name, model=str(model_dir), trainable=False)
    return evaluate_member(load_member(cfg), examples, bench, progress=progress)


def results_markdown(results: dict) -> str:
    """A table: one row per model, one column per benchmark (and per question type)."""
    lines = ["| model | benchmark | n | accuracy | by type |", "|---|---|---|---|---|"]
    for model, benches in results.items():
        for bench, r in benches.items():
            types = ", ".join(f"{t} {a:.3f}" for t, a in r["by_type"].items())
            lines.append(f"| {model} | {bench} | {r['n']} | {r['accuracy']:.3f} | {types} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = cli.parser("python -m vlm_corl.eval", __doc__)
    parser.add_argument("--models", nargs="+", required=True, help="model directories (HF format)")
    parser.add_argument("--benchmarks", required=True, help=f"comma-separated; available: {', '.join(BENCHMARKS.names())}")
    parser.add_argument("--out", required=True, help="directory for results.json and results.md")
    parser.add_argument("--limit", type=cli.positive_int, default=None,
                        help="examples per benchmark, at least 1 (balanced by type where defined); leave it out "
                             "for every example")
    parser.add_argument("--data", action="append", default=[], metavar="BENCH=PATH",
                        help="data path for a benchmark whose loader needs one, e.g. math500=path/to/math500 "
                             "(default: the copy shipped in text_corl)")
    args = parser.parse_args(argv)
    bad_data = [item for item in args.data if "=" not in item]
    if bad_data:
        parser.error(f"--data takes BENCH=PATH, got {bad_data}")
    out = cli.output_dir(args.out, "--out")  # checked before the evaluation, not after it
    names = [name for name in args.benchmarks.split(",") if name]
    benches = {name: BENCHMARKS.get(name) for name in names}
    paths = dict(item.split("=", 1) for item in args.data)
    models = {Path(m).name: m for m in args.models}
    examples = {name: benchmark_examples(bench, args.limit, paths.get(name)) for name, bench in benches.items()}
    for name in benches:
        check_models(models, examples[name])
    results: dict[str, dict] = {}
    for name, bench in benches.items():
        for model_dir in args.models:
            results.setdefault(str(model_dir), {})[name] = evaluate_dir(model_dir, bench, examples[name], progress=True)
    write_results(out, results, results_markdown(results))
    return 0


def write_results(out: Path, results: dict, markdown: str) -> None:
    """results.json + results.md in `out` (created), and the markdown on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown)
    print(markdown)


if __name__ == "__main__":
    sys.exit(cli.run(main))
