"""The evaluation command: `python -m vlm_corl.eval --models DIR [DIR …] --benchmarks a,b --out DIR`.

A benchmark is a dataset (any registered loader), a decoding setting and a grading rule, registered in
`vlm_corl.registry.BENCHMARKS`. Models are loaded exactly as cohort members are (same rendering, same engine),
so evaluation sees what training sees. Writes `results.json` (per model, per benchmark, per question type,
and every prediction) and `results.md`. The library it runs is `vlm_corl.evaluation.scoring`.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_corl import cli
from vlm_corl.config.schema import RolloutConfig, VllmConfig
from vlm_corl.errors import UserError
from vlm_corl.registry import BENCHMARKS

if TYPE_CHECKING:
    from vlm_corl.evaluation.scoring import Benchmark
    from vlm_corl.members.member import Member


def main(argv: list[str] | None = None) -> int:
    parser = eval_parser()
    args = cli.parse(parser, argv)
    if args.list:
        print(benchmark_list())
        return 0
    _check_arguments(parser, args)
    # checked before the evaluation, not after it; removed again if the evaluation fails before writing
    with cli.kept_if_written(args.out, "--out") as out:
        _evaluate(args, out)
    return 0


def eval_parser() -> argparse.ArgumentParser:
    """The command's flags."""
    parser = cli.parser("python -m vlm_corl.eval", __doc__)
    parser.add_argument("--list", action="store_true", help="list the registered benchmarks and exit")
    parser.add_argument("--models", nargs="+", help="model directories (HF format)")
    parser.add_argument(
        "--benchmarks",
        help="comma-separated registered names or benchmark YAML files (see --list)",
    )
    parser.add_argument("--out", help="directory for results.json and results.md")
    parser.add_argument(
        "--limit",
        type=cli.positive_int,
        default=None,
        help="examples per benchmark, at least 1 (balanced by type where defined); leave it out for every example",
    )
    parser.add_argument(
        "--data",
        action="append",
        default=[],
        metavar="BENCH=PATH",
        help="data path for a benchmark whose loader needs one, e.g. math500=path/to/math500 "
        "(default: the copy shipped in text_corl)",
    )
    parser.add_argument(
        "--engine",
        choices=("hf", "vllm"),
        default="hf",
        help="answer sampler: hf (transformers, any machine) | vllm (one engine per model)",
    )
    parser.add_argument(
        "--hf-static-cache",
        choices=("auto", "on", "off"),
        default="auto",
        help="hf: decode over a static KV cache, steps replayed as CUDA graphs (auto: on CUDA), as "
        "rollout.hf_static_cache does in training",
    )
    parser.add_argument(
        "--max-prompt-tokens",
        type=cli.positive_int,
        default=4096,
        help="vllm: longest prompt the engines make room for (with the benchmarks' max_new_tokens)",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.8,
        help="vllm: share of GPU memory all the engines take together (split among the models)",
    )
    parser.add_argument(
        "--kv-cache-bytes",
        type=cli.positive_int,
        default=None,
        help="vllm on a CPU: KV cache bytes of all engines together (the share above is of RAM there)",
    )
    return parser


def _check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The flags' mistakes, named before anything loads (parser.error exits 2)."""
    missing = [
        flag
        for flag, value in (("--models", args.models), ("--benchmarks", args.benchmarks), ("--out", args.out))
        if not value
    ]
    if missing:
        parser.error(f"the following arguments are required: {', '.join(missing)} (or --list)")
    bad_data = [item for item in args.data if "=" not in item]
    if bad_data:
        parser.error(f"--data takes BENCH=PATH, got {bad_data}")
    if args.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise UserError("--engine vllm needs vLLM: pip install -e '.[vllm]' (or use --engine hf)")


def _evaluate(args: argparse.Namespace, out: Path) -> None:
    """Every model of --models on every benchmark; results.json and results.md written to `out`."""
    # torch and transformers load only now: `--help` and argument mistakes answer at once
    from vlm_corl.distributed.world import default_device
    from vlm_corl.evaluation.scoring import (
        benchmark_examples,
        check_models,
        evaluate_member,
        results_markdown,
        write_results,
    )
    from vlm_corl.members.member import load_member
    from vlm_corl.members.prompt_format import member_config

    names = [name for name in args.benchmarks.split(",") if name]
    benches = {name: BENCHMARKS.get(name) for name in names}
    paths = dict(item.split("=", 1) for item in args.data)
    dirs = model_dirs(args.models)
    examples = {name: benchmark_examples(bench, args.limit, paths.get(name)) for name, bench in benches.items()}
    for name in benches:
        check_models({d.name: d for d in dirs}, examples[name])
    results: dict[str, dict] = {}
    engines = []  # vLLM engines live as long as the process (closing one tears down vLLM's shared state)
    for model_dir in dirs:
        member = load_member(member_config(model_dir), device=default_device())  # an export's prompt format
        engine, room = _engine(args, member, list(benches.values()), examples, share=1 / len(dirs))
        engines.append(engine if args.engine == "vllm" else None)
        for name, bench in benches.items():
            results.setdefault(str(model_dir), {})[bench.name] = evaluate_member(
                member, examples[name], bench, progress=True, engine=engine, max_prompt_tokens=room
            )
    write_results(out, results, results_markdown(results))


def model_dirs(paths: list[str]) -> list[Path]:
    """The models `--models` names: a model directory itself (with config.json, or a LoRA member's adapter
    directory, applied to the base model it names), every model of a cohort
    checkpoint (`RUN/checkpoints/step-N`: the members and teachers its manifest lists), or those of a run
    directory's newest complete checkpoint. A path that does not exist is kept, for `check_models` to report."""
    from vlm_corl.members.adapter_files import is_adapter_dir
    from vlm_corl.training.run.checkpoint import MANIFEST, is_complete, latest_checkpoint

    found = []
    for raw in paths:
        path = Path(raw)
        if not path.exists() or (path / "config.json").is_file() or is_adapter_dir(path):
            found.append(path)
            continue
        checkpoint = latest_checkpoint(path) if (path / "checkpoints").is_dir() else path
        if checkpoint is None or not is_complete(checkpoint):
            raise UserError(
                f"--models {raw}: not a model directory (no config.json), a LoRA adapter directory (no "
                "adapter_config.json), a complete cohort checkpoint "
                "(RUN/checkpoints/step-N with its manifest.json) or a run directory holding one"
            )
        found += [checkpoint / mid for mid in json.loads((checkpoint / MANIFEST).read_text())["members"]]
    return found


def _engine(args, member: Member, benches: list[Benchmark], examples: dict, share: float):
    """The sampler for one model and the longest prompt it takes: the HF engine (--hf-static-cache; no limit), or
    a vLLM engine with room for --max-prompt-tokens plus the longest benchmark answer."""
    from vlm_corl.evaluation.scoring import EVAL_IMAGE_PIXELS
    from vlm_corl.members.engines import make_engine

    if args.engine == "hf":
        return make_engine("hf", member, RolloutConfig(hf_static_cache=args.hf_static_cache)), 1 << 30
    budget = VllmConfig(gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_memory_bytes=args.kv_cache_bytes)
    rollout = RolloutConfig(
        engine="vllm",
        max_prompt_tokens=args.max_prompt_tokens,
        max_new_tokens=max(b.max_new_tokens for b in benches),
        vllm=budget,
    )
    images = max(len(ex.images) for exs in examples.values() for ex in exs)
    return make_engine("vllm", member, rollout, images, share, EVAL_IMAGE_PIXELS), args.max_prompt_tokens


def benchmark_list() -> str:
    """One line per registered benchmark: name, loader and split, decoding, metric."""
    lines = []
    for name in BENCHMARKS.names():
        b = BENCHMARKS.get(name)
        decoding = "greedy" if b.temperature == 0 else f"T={b.temperature} top-p {b.top_p}"
        lines.append(f"{name:16s} {b.loader}[{b.split}]  {decoding}, {b.max_new_tokens} tokens, {b.metric}")
    lines.append("(or a benchmark YAML file: see vlm_corl.evaluation.benchmark_file)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(cli.run(main))
