"""Scoring models on benchmarks: the `Benchmark` record, its examples, one member's evaluation (the same
loading, rendering and engine as training), graders and metrics (accuracy, avg@k, maj@k, pass@k), and the
results files. The command around it is `python -m vlm_corl.eval`."""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from vlm_corl.config import MemberConfig
from vlm_corl.config.schema import DataConfig
from vlm_corl.data.answers import answers_equivalent, extract_answer, plurality_vote
from vlm_corl.data.answers.normalize import normalize_answer
from vlm_corl.data.loaders import balance_by, load_examples
from vlm_corl.data.records import Example
from vlm_corl.distributed.world import default_device
from vlm_corl.members.engines import RolloutEngine, make_engine
from vlm_corl.members.member import Member, check_modality, load_member, member_family
from vlm_corl.members.prompt_format import member_config
from vlm_corl.members.render import PromptTooLong, Renderer, Wording
from vlm_corl.members.rollout import SamplingParams


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
    options: dict = field(default_factory=dict)  # loader options (field names, image root)
    category: str | None = None  # metadata key accuracy is reported by (default: balance_by)
    answer_type: str = "expression"  # number | expression | choice | text: "text" compares normalised strings
    metric: str = "accuracy"  # accuracy | avg@K | maj@K | pass@K (the headline number)
    samples: int = 1  # K answers sampled per question
    prompt_style: str | None = None  # the instruction after the question (render.PROMPT_STYLES); None: the member's
    grade: Callable[[Example, str], bool] | None = None  # grades a whole response (code); None: extract + compare
    # scores beyond per-record correctness (We-Math's four dimensions, a second breakdown) from the records and
    # their examples, in order; results.json keeps them under "aggregate", results.md lists them under the table
    aggregate: Callable[[list[dict], list[Example]], dict] | None = None


# Found through the `vlm_corl.benchmarks` entry point (pyproject.toml), like text_corl's: a module-level
# registration would run twice under `python -m vlm_corl.eval` (as __main__, then as vlm_corl.eval).
EASYVQA = Benchmark("easyvqa", "easyvqa", "test", balance_by="question_type")


def benchmark_examples(bench: Benchmark, limit: int | None, path: str | None = None) -> list[Example]:
    """The benchmark's examples, balanced across `balance_by` values when set, at most `limit` (read only up to
    `limit` when not balanced: a stream, `eval_dataset`'s, is read no further)."""
    upto = None if bench.balance_by else limit
    examples = load_examples(bench.loader, path or bench.path, split=bench.split, limit=upto, **bench.options).examples
    return balance_by(examples, bench.balance_by, limit) if bench.balance_by else examples[:limit]


EVAL_BATCH = 64  # questions per engine call
EVAL_IMAGE_PIXELS = DataConfig().max_image_pixels  # as in training: larger images are downscaled


def evaluate_member(
    member: Member,
    examples: list[Example],
    bench: Benchmark,
    progress: bool = False,
    engine: RolloutEngine | None = None,
    max_prompt_tokens: int = 1 << 30,
) -> dict:
    """Accuracy of `member` on `examples` (overall and per category), every prediction, and with K samples per
    question avg@K, maj@K and pass@K; `progress` shows a bar (with ETA) on a terminal.

    `engine` samples the answers (default: the HF engine on the member's module; a vLLM engine must leave room
    for `max_prompt_tokens` + the benchmark's max_new_tokens). A question whose prompt is longer is left out of
    the scores and counted (`skipped_too_long`)."""
    records, answered = sample_records(member, examples, bench, progress, engine, max_prompt_tokens)
    result = score_records(records, [examples[i] for i in answered], bench)
    result["skipped_too_long"] = len(examples) - len(answered)
    return result


def sample_records(
    member: Member,
    examples: list[Example],
    bench: Benchmark,
    progress: bool = False,
    engine: RolloutEngine | None = None,
    max_prompt_tokens: int = 1 << 30,
) -> tuple[list[dict], list[int]]:
    """The graded record of every question `member` answered (`grade_record`) and its position in `examples`
    (see `evaluate_member`); the records of several shards of a benchmark join into one `score_records`."""
    render = Renderer(member, "original", EVAL_IMAGE_PIXELS, max_prompt_tokens, Wording(style=bench.prompt_style))
    engine = engine or make_engine("hf", member)
    params = SamplingParams(
        n=bench.samples, temperature=bench.temperature, top_p=bench.top_p, max_new_tokens=bench.max_new_tokens
    )
    key = bench.category or bench.balance_by
    records, answered = [], []
    bar = tqdm(
        total=len(examples), desc=f"eval {member.id} on {bench.name}", unit="q", disable=None if progress else True
    )
    for start in range(0, len(examples), EVAL_BATCH):
        prompts, kept = [], []
        for i in range(start, min(start + EVAL_BATCH, len(examples))):
            try:
                prompts.append(render(examples[i]))
                kept.append(i)
            except PromptTooLong:
                pass
        bar.update(min(EVAL_BATCH, len(examples) - start))
        if prompts:
            groups = engine.generate(prompts, params)
            records += [grade_record(examples[i], g, bench, member.prompt_style, key) for i, g in zip(kept, groups)]
            answered += kept
    bar.close()
    return records, answered


def score_records(records: list[dict], examples: list[Example], bench: Benchmark) -> dict:
    """The scores of a benchmark's records (`examples`: theirs, in order): accuracy overall and per category,
    the sampled metrics with K samples, the headline score, the benchmark's own aggregate."""
    result = {
        "accuracy": _acc(records),
        "by_type": _by_type(records),
        "n": len(records),
        "records": records,
        "metric": bench.metric,
        "samples": bench.samples,
        "decoding": {"temperature": bench.temperature, "top_p": bench.top_p, "max_new_tokens": bench.max_new_tokens},
    }
    if bench.samples > 1:
        result.update(sampled_metrics(records, bench))
    result["score"] = result.get(bench.metric, result["accuracy"])
    if bench.aggregate is not None:
        result["aggregate"] = bench.aggregate(records, examples)
    return result


def grade_record(ex: Example, group, bench: Benchmark, prompt_style: str, key: str | None) -> dict:
    """One question's record: its first prediction and response, the share of its samples graded right, and
    with K samples every prediction, the number right and whether their plurality vote is right."""
    texts = [r.text for r in group.responses]
    preds = [extract_answer(t, prompt_style, ex.choices) for t in texts]  # shown in the records
    if bench.grade is not None:  # the whole response is graded (its own rules, or code run against tests)
        right = [bench.grade(ex, t) for t in texts]
    else:
        right = [grade_answer(ex.answer, p, ex.choices, bench.answer_type) for p in preds]
    record = {
        "id": ex.id,
        "type": ex.metadata.get(key) if key else None,
        "pred": preds[0],
        "gold": ex.answer,
        "correct": sum(right) / len(right),
        "response": texts[0],
    }
    if bench.samples > 1:
        record.update(preds=preds, n_correct=sum(right))
        if bench.grade is None:  # a majority needs extracted answers to vote on
            vote = plurality_vote(preds, choices=ex.choices)
            record["maj_correct"] = grade_answer(ex.answer, vote, ex.choices, bench.answer_type)
    return record


def sampled_metrics(records: list[dict], bench: Benchmark) -> dict[str, float]:
    """avg@K, maj@K (where answers are extracted) and pass@K (unbiased, with n = k = K) over the records."""
    k, n = bench.samples, max(len(records), 1)
    metrics = {f"avg@{k}": _acc(records)}
    if bench.grade is None:
        metrics[f"maj@{k}"] = sum(r["maj_correct"] for r in records) / n
    metrics[f"pass@{k}"] = sum(pass_at_k(k, r["n_correct"], k) for r in records) / n
    return metrics


def grade_answer(gold: str | None, pred: str | None, choices: Sequence[str] | None, answer_type: str) -> bool:
    """Whether `pred` answers `gold`: normalised string equality for free text, math-verify equivalence (and
    choice letters vs option texts) otherwise."""
    if gold is None or pred is None:
        return False
    if answer_type == "text":
        return normalize_answer(pred).casefold() == normalize_answer(gold).casefold()
    return answers_equivalent(gold, pred, choices)


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased pass@k estimate from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)."""
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


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


def evaluate_dir(
    model_dir: str | Path,
    bench: Benchmark,
    examples: list[Example],
    name: str | None = None,
    progress: bool = False,
    view: str = "original",
) -> dict:
    """Load a saved model (zoo member or checkpoint) as a frozen member and evaluate it; `view`: the question's
    wording it sees (a member's `view`; an example without that paraphrase is asked in its own wording)."""
    cfg = member_config(model_dir, name, view=view)  # an exported model's prompt format (prompt_format.json)
    return evaluate_member(load_member(cfg, device=default_device()), examples, bench, progress=progress)


def results_markdown(results: dict) -> str:
    """A table: one row per model and benchmark: its metric, accuracy (avg over samples), per category, decoding;
    then one line per benchmark with aggregate scores (`Benchmark.aggregate`)."""
    lines = [
        "| model | benchmark | n | metric | score | accuracy | by category | decoding |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model, benches in results.items():
        for bench, r in benches.items():
            types = ", ".join(f"{t} {a:.3f}" for t, a in r["by_type"].items())
            d = r.get("decoding", {})
            decoding = "greedy" if not d.get("temperature") else f"T={d['temperature']}, top-p {d['top_p']}"
            score = r.get("score", r["accuracy"])
            lines.append(
                f"| {model} | {bench} | {r['n']} | {r.get('metric', 'accuracy')} | {score:.3f} "
                f"| {r['accuracy']:.3f} | {types} | {decoding} |"
            )
    extra = [
        f"- {model} / {bench}: {_compact(r['aggregate'])}"
        for model, benches in results.items()
        for bench, r in benches.items()
        if r.get("aggregate")
    ]
    return "\n".join(lines + ([""] + extra if extra else [])) + "\n"


def _compact(scores: dict) -> str:
    """One line for a benchmark's aggregate scores: "by_level: 1 0.500, 2 0.250; IK 0.167, ..."."""

    def show(value: object) -> str:
        return f"{value:.3f}" if isinstance(value, float) else str(value)

    flat = ", ".join(f"{k} {show(v)}" for k, v in scores.items() if not isinstance(v, dict))
    nested = [
        f"{k}: " + ", ".join(f"{t} {show(v)}" for t, v in d.items()) for k, d in scores.items() if isinstance(d, dict)
    ]
    return "; ".join(([flat] if flat else []) + nested)


def write_results(out: Path, results: dict, markdown: str) -> None:
    """results.json + results.md in `out` (created), and the markdown on stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(markdown)
    print(markdown)
