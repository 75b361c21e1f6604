"""Write a paraphrase cache: a model rewrites each question's wording, keeping its answer.

    python -m data_tools.paraphrase --data IN --model DIR --out OUT [--n 2] [--loader jsonl] [--split train]
        [--limit N] [--engine hf|vllm] [--batch-size 16] [--samples 2n] [--temperature 0.7] [--top-p 0.95]
        [--max-new-tokens 256] [--max-prompt-tokens 2048] [--scenario] [--seed 0] [--kv-cache-bytes B]

The rewriter (a local Hugging Face model directory, text or vision-language) is served by the project's own
rollout engine and prompted through its own chat template with PROMPT (or SCENARIO_PROMPT with --scenario,
which also lets it change the story around the question). A vision-language rewriter sees the example's images;
a text rewriter sees the text only. It samples --samples responses per question (default 2 x n); each must be
exactly one <paraphrase>...</paraphrase> block (an optional leading <think>...</think> is allowed), and the
wording inside must pass vlm_corl.data.paraphrases.check_paraphrase: not empty, not identical to the question,
the same numbers (as a multiset), every [asy] diagram and every answer option verbatim and in order, and a
length within 0.5-3x the question's. The first n that pass are kept; the others are dropped and counted by
reason. Images are never changed: only text is written.

Output (OUT, JSONL, one line per example, in dataset order; the format `vlm_corl.data.paraphrases.read_cache` reads
and training uses through data.paraphrases=OUT):

    {"id": <example id>, "source_question": <the question>, "paraphrases": [<up to n wordings>],
     "rewriter": <--model as given>, "prompt": <the prompt template; "{question}" marks the slot>,
     "mode": "wording" | "scenario", "dropped": {<reason>: <responses>}, "surplus": <passing responses not
     needed>, "sampling": {"samples", "temperature", "top_p", "max_new_tokens", "seed"}}

An example whose responses all fail still gets its line (with no paraphrases), so it is not retried.
Resumable: ids already in OUT are skipped and lines are appended and flushed after every batch, so a crash
loses at most the batch in flight (a torn last line is removed on restart). OUT must have been written with
the same rewriter and prompt. Examples whose prompt is longer than --max-prompt-tokens are skipped without a
line (rerun with a higher limit).

At the end a JSON summary goes to stdout. Its totals cover every loaded example's line in OUT, from this run
and earlier ones: "examples", "already_done" (lines found at start), "with_line", "responses", "kept"
(paraphrases), "dropped" (responses by reason: no_block, unclosed_block, multiple_blocks, text_outside_block,
truncated, empty, identical, numbers_changed, diagram_changed, options_changed, too_short, too_long,
duplicate), "examples_short" (fewer than n paraphrases, including examples without a line),
"paraphrases_per_example". "this_run" counts this run alone: "rewritten", "prompt_too_long", "responses",
"kept", "surplus" (responses that passed after n were kept), "dropped", "paraphrases_per_example".
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_corl import cli
from vlm_corl.config.schema import DataConfig, MemberConfig, RolloutConfig, VllmConfig
from vlm_corl.data.images import load_image
from vlm_corl.data.loaders import load_examples
from vlm_corl.data.paraphrases import (
    CLOSE_TAG,
    MAX_LENGTH_RATIO,
    MIN_LENGTH_RATIO,
    CacheError,
    CacheRecord,
    read_cache,
    select_paraphrases,
)
from vlm_corl.data.records import Example
from vlm_corl.errors import UserError

if TYPE_CHECKING:
    from vlm_corl.members.engines import RolloutEngine
    from vlm_corl.members.member import Member
    from vlm_corl.members.rollout import Prompt, SamplingParams

# torch and the engines load in the functions that rewrite (after `main` has parsed its arguments): `--help`
# and argument mistakes answer at once

_RULES = (
    "Rules:\n"
    "- Copy every number, formula and diagram ([asy]...[/asy]) exactly as written, and add no new numbers.\n"
    "- If the question lists answer options, copy them exactly and in the same order.\n"
    "- If the question refers to an image or a figure, keep that reference.\n"
    "- Do not solve the question, do not add hints, and do not leave out any information.\n"
    "Reply with the rewritten question only, between <paraphrase> and </paraphrase>.\n\n"
    "Question:\n{question}"
)
PROMPT = (
    "Rewrite the question below in different words. The rewritten question must ask exactly the same thing "
    "and have exactly the same answer.\n" + _RULES
)
SCENARIO_PROMPT = (
    "Rewrite the question below in different words. You may also change its story or setting (names, "
    "objects, places), but the rewritten question must keep every quantity and relation and have exactly the "
    "same answer.\n" + _RULES
)


def render(member: Member, example: Example, template: str, max_image_pixels: int) -> Prompt:
    """The rewriting request for one example, in the rewriter's chat template (images only for a VLM)."""
    text = template.replace("{question}", example.question)  # not str.format: questions are full of LaTeX braces
    from vlm_corl.members.rollout import Prompt

    images = [load_image(src, max_pixels=max_image_pixels) for src in example.images] if member.is_vision else []
    chat_text = member.apply_chat_template(text, len(images), None)
    return Prompt(example.id, chat_text, images, member.process(chat_text, images))


def _end_last_line(out: Path, tail: bytes, start: int) -> None:
    """A last line without its newline: a whole record (a file edited by hand) gets its newline; the start of
    a record (this command killed while appending) is removed; anything else is not ours to delete."""
    try:
        complete = isinstance(json.loads(tail), dict)
    except ValueError:
        complete = False
    if complete:
        with open(out, "ab") as handle:
            handle.write(b"\n")
        return
    if not tail.lstrip().startswith(b'{"'):
        raise CacheError(
            f"{out}: its last line is not a paraphrase record ({tail[:40]!r}...); nothing was removed: is --out "
            "the right file?"
        )
    print(f"{out}: removing a torn last line ({len(tail)} bytes) left by an interrupted run", file=sys.stderr)
    with open(out, "r+b") as handle:
        handle.truncate(start)


def resume(out: Path, rewriter: str, template: str) -> set[str]:
    """Ids already in OUT (none if it does not exist), after removing a torn last line left by a crash.

    Raises CacheError when OUT was written with another rewriter or prompt: one cache, one provenance.
    """
    if not out.exists():
        return set()
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        _end_last_line(out, data[keep:], keep)
    records = read_cache(out)
    for record in records.values():
        if Path(record.rewriter).resolve() != Path(rewriter).resolve():
            raise CacheError(
                f"{out}: id {record.id!r} was written by rewriter {record.rewriter!r}, not {rewriter!r}; "
                f"resume with the same --model or choose another --out"
            )
        if record.prompt != template:
            raise CacheError(
                f"{out}: id {record.id!r} was written with another prompt (mode "
                f"{record.metadata.get('mode')!r}: check --scenario); resume with the same prompt or "
                f"choose another --out"
            )
    return set(records)


@dataclass(frozen=True)
class Rewriting:
    """How `rewrite` asks for and judges paraphrases: the provenance every line records (`rewriter`, the prompt
    `template` with its "{question}" slot, `mode`: wording | scenario), `n` paraphrases kept per example out
    of the responses `params` samples, `batch_size` questions per engine call, prompts longer than
    `max_prompt_tokens` skipped, images shrunk to `max_image_pixels`, and the paraphrase's length bounds as
    ratios of the question's (`min_ratio`, `max_ratio`)."""

    rewriter: str
    template: str
    mode: str
    n: int
    params: SamplingParams
    batch_size: int
    max_prompt_tokens: int
    max_image_pixels: int = DataConfig().max_image_pixels
    min_ratio: float = MIN_LENGTH_RATIO
    max_ratio: float = MAX_LENGTH_RATIO

    def provenance(self) -> dict:
        """What each cache line records of how it was written: rewriter, prompt, mode and sampling."""
        sampling = {
            "samples": self.params.n,
            **{k: getattr(self.params, k) for k in ("temperature", "top_p", "max_new_tokens", "seed")},
        }
        return {"rewriter": self.rewriter, "prompt": self.template, "mode": self.mode, "sampling": sampling}


def rewrite(examples: list[Example], member: Member, engine: RolloutEngine, out: Path, settings: Rewriting) -> dict:
    """Rewrite `examples` in batches as `settings` says, appending one cache line per example to `out` (flushed
    per batch).

    Returns counts: {"rewritten", "prompt_too_long", "responses", "kept", "surplus", "dropped": {reason: n},
    "paraphrases_per_example": {count: examples}}.
    """
    s, provenance = settings, settings.provenance()
    totals = {"rewritten": 0, "prompt_too_long": 0, "responses": 0, "kept": 0, "surplus": 0}
    dropped, per_example = Counter(), Counter()  # drops by reason; examples by paraphrases kept
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "a", encoding="utf-8") as handle:
        for start in range(0, len(examples), s.batch_size):
            batch, prompts = _rendered(
                member, examples[start : start + s.batch_size], s.template, s.max_image_pixels, s.max_prompt_tokens
            )
            totals["prompt_too_long"] += len(examples[start : start + s.batch_size]) - len(batch)
            if not prompts:
                continue
            lines = []
            for ex, group in zip(batch, engine.generate(prompts, s.params)):
                record = _cache_record(ex, group, s.n, (s.min_ratio, s.max_ratio), provenance)
                totals["responses"] += len(group.responses)
                totals["kept"] += len(record.paraphrases)
                totals["surplus"] += record.metadata["surplus"]
                dropped.update(record.metadata["dropped"])
                per_example[len(record.paraphrases)] += 1
                lines.append(record.to_json() + "\n")
            handle.write("".join(lines))
            handle.flush()
            os.fsync(handle.fileno())
            totals["rewritten"] += len(batch)
            print(f"{start + len(batch)}/{len(examples)} examples: {totals['kept']} paraphrases kept", file=sys.stderr)
    return {
        **totals,
        "dropped": dict(dropped.most_common()),
        "paraphrases_per_example": {str(k): v for k, v in sorted(per_example.items())},
    }


def _cache_record(ex: Example, group, n: int, ratios: tuple[float, float], provenance: dict) -> CacheRecord:
    """One example's cache line: the paraphrases kept from its rewriter's responses, what was dropped and why,
    and the surplus beyond `n`; `provenance`: rewriter, prompt, mode and sampling."""
    kept, drops, surplus = select_paraphrases(
        ((r.text, r.finish_reason == "length") for r in group.responses), ex.question, n, ex.choices, *ratios
    )
    return CacheRecord(
        id=ex.id,
        source_question=ex.question,
        paraphrases=tuple(kept),
        rewriter=provenance["rewriter"],
        prompt=provenance["prompt"],
        metadata={
            "mode": provenance["mode"],
            "dropped": dict(drops),
            "surplus": surplus,
            "sampling": provenance["sampling"],
        },
    )


def _rendered(
    member, examples: list[Example], template: str, max_image_pixels: int, max_prompt_tokens: int
) -> tuple[list[Example], list]:
    """The examples whose rewriting prompt fits `max_prompt_tokens`, and those prompts."""
    kept, prompts = [], []
    for ex in examples:
        prompt = render(member, ex, template, max_image_pixels)
        if prompt.inputs["input_ids"].shape[1] <= max_prompt_tokens:
            kept.append(ex)
            prompts.append(prompt)
    return kept, prompts


def cache_totals(out: Path, examples: list[Example], n: int) -> dict:
    """Totals over the cache lines of `examples` (this run's and earlier runs'): what training will see."""
    records = read_cache(out) if out.exists() else {}
    rows = [records[ex.id] for ex in examples if ex.id in records]
    dropped: Counter = Counter()
    for row in rows:
        dropped.update(row.metadata.get("dropped", {}))
    per_example = Counter(len(records[ex.id].paraphrases) if ex.id in records else 0 for ex in examples)
    return {
        "with_line": len(rows),
        "responses": sum(row.metadata.get("sampling", {}).get("samples", 0) for row in rows),
        "kept": sum(len(row.paraphrases) for row in rows),
        "dropped": dict(dropped.most_common()),
        "examples_short": sum(v for k, v in per_example.items() if k < n),
        "paraphrases_per_example": {str(k): v for k, v in sorted(per_example.items())},
    }


def main(argv: list[str] | None = None) -> int:
    """The command: load the dataset, skip the examples OUT already holds, rewrite the others, print the summary."""
    parser = _parser()
    args = cli.parse(parser, argv)
    samples = args.samples or 2 * args.n
    if args.n < 1 or samples < args.n:
        parser.error(f"need --n >= 1 and --samples >= --n (got n={args.n}, samples={samples})")
    template, mode = (SCENARIO_PROMPT, "scenario") if args.scenario else (PROMPT, "wording")
    if args.out.is_dir():
        raise UserError(
            f"--out {args.out} is a directory; give the paraphrase cache's file name "
            f"(e.g. {args.out}/paraphrases.jsonl)"
        )
    cli.output_dir(args.out.parent, "the directory of --out")
    loaded = load_examples(args.loader, args.data, args.split, args.limit)
    done = resume(args.out, args.model, template)  # CacheError: a cache written by another rewriter or prompt
    if loaded.report.skipped:
        print(loaded.report.summary(), file=sys.stderr)
    pending = [ex for ex in loaded.examples if ex.id not in done]
    # Model code only when there is work: a finished cache resumes without loading anything.
    counts = _rewrite_pending(args, pending, samples, template, mode) if pending else {}
    summary = {
        "examples": len(loaded.examples),
        "already_done": len(loaded.examples) - len(pending),
        **cache_totals(args.out, loaded.examples, args.n),
        "this_run": counts,
        "out": str(args.out),
    }
    print(json.dumps(summary, indent=2))
    return 0


def _rewrite_pending(args: argparse.Namespace, pending: list[Example], samples: int, template: str, mode: str) -> dict:
    """Load the rewriter and its engine as the arguments say, and `rewrite` the `pending` examples."""
    import torch
    from transformers.utils import logging as hf_logging

    from vlm_corl.members.engines import make_engine
    from vlm_corl.members.member import load_member
    from vlm_corl.members.rollout import SamplingParams

    hf_logging.disable_progress_bar()
    device = args.device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
    member = load_member(MemberConfig(id="rewriter", model=args.model, trainable=False), device=device)
    # The engine reads only its length budget (and vLLM settings) from the rollout config.
    rollout = RolloutConfig(
        max_new_tokens=args.max_new_tokens,
        max_prompt_tokens=args.max_prompt_tokens,
        vllm=VllmConfig(kv_cache_memory_bytes=args.kv_cache_bytes),
    )
    engine = make_engine(args.engine, member, rollout, max((len(ex.images) for ex in pending), default=1))
    params = SamplingParams(
        n=samples,
        temperature=args.temperature,
        top_p=args.top_p,
        max_new_tokens=args.max_new_tokens,
        stop=(CLOSE_TAG,),
        seed=args.seed,
    )
    settings = Rewriting(
        rewriter=args.model,
        template=template,
        mode=mode,
        n=args.n,
        params=params,
        batch_size=args.batch_size,
        max_prompt_tokens=args.max_prompt_tokens,
        min_ratio=args.min_length_ratio,
        max_ratio=args.max_length_ratio,
    )
    return rewrite(pending, member, engine, args.out, settings)


def _parser() -> argparse.ArgumentParser:
    """The command's arguments: what to rewrite, with which model, into which cache (then `_add_sampling`)."""
    parser = cli.parser(
        "python -m data_tools.paraphrase",
        __doc__,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--data", required=True, help="dataset path, as the loader takes it (file or directory)")
    parser.add_argument("--model", required=True, help="rewriter: a local Hugging Face model directory")
    parser.add_argument("--out", required=True, type=Path, help="paraphrase cache to write or resume (JSONL)")
    parser.add_argument("--n", type=cli.positive_int, default=2, help="paraphrases to keep per example (default 2)")
    parser.add_argument(
        "--loader",
        default="jsonl",
        help="loader registry name or module:function (jsonl, hf, math500, ...; see vlm_corl.data.loaders)",
    )
    parser.add_argument("--split", default="train", help="dataset split, for a --data directory (default train)")
    parser.add_argument("--limit", type=cli.positive_int, default=None, help="use the first N examples of the dataset")
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf", help="rollout engine (default hf)")
    parser.add_argument(
        "--batch-size", type=cli.positive_int, default=16, help="questions per engine call (default 16)"
    )
    _add_sampling(parser)
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help="vLLM KV cache size in bytes (set it on a CPU, where vLLM otherwise takes a share of RAM)",
    )
    parser.add_argument(
        "--device",
        type=cli.device,
        default=None,
        help="device for the rewriter (default: cuda if available, else cpu)",
    )
    return parser


def _add_sampling(parser: argparse.ArgumentParser) -> None:
    """The arguments that say how responses are sampled and which of them pass."""
    parser.add_argument(
        "--samples", type=cli.positive_int, default=None, help="responses sampled per question (default 2 x n)"
    )
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (default 0.7)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass (default 0.95)")
    parser.add_argument(
        "--max-new-tokens", type=cli.positive_int, default=256, help="longest response in tokens (default 256)"
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=2048,
        help="skip questions whose rewriting prompt is longer (default 2048)",
    )
    parser.add_argument(
        "--min-length-ratio",
        type=float,
        default=MIN_LENGTH_RATIO,
        help=f"shortest paraphrase / question length (default {MIN_LENGTH_RATIO})",
    )
    parser.add_argument(
        "--max-length-ratio",
        type=float,
        default=MAX_LENGTH_RATIO,
        help=f"longest paraphrase / question length (default {MAX_LENGTH_RATIO})",
    )
    parser.add_argument(
        "--scenario", action="store_true", help="let the rewriter change the story/setting too, not only the wording"
    )
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")


if __name__ == "__main__":
    sys.exit(cli.run(main))
