"""The "base model" step: a short supervised warm start on a small labelled slice.

A randomly initialised tiny model cannot answer at all, so peer agreement has nothing to amplify. This step
plays the role of starting from a pretrained checkpoint: it teaches a member the answer format of its prompt
style and a little of the task from a few labelled examples, then saves it (HF format) as the base model that
label-free training starts from. It is the only training step that reads labels.

    python -m vlm_corl.warmstart --model out/zoo/qwen2_vl --out out/base/qwen2_vl --loader easyvqa \
        --limit 1000 --steps 300
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Callable

from vlm_corl import cli
from vlm_corl.config import MemberConfig
from vlm_corl.data.loaders import DataError, balance_by, load_examples
from vlm_corl.data.records import Example

if TYPE_CHECKING:
    from vlm_corl.members.member import Member

# torch and transformers load in the functions that train (and so after `main` has parsed its arguments):
# `--help` and argument mistakes answer at once

# The response a member is taught for gold answer A, per prompt style (no reasoning: tiny models).
TARGETS = {"answer_tags": "<answer>{answer}</answer>", "boxed": "\\boxed{{{answer}}}"}


def target_ids(member: Member, answer: str) -> list[int]:
    """Token ids of the taught response, ending with the member's end-of-turn token."""
    text = TARGETS[member.prompt_style].format(answer=answer)
    return member.tokenizer(text, add_special_tokens=False)["input_ids"] + [member.eos_token_ids[0]]


def warm_start(
    member: Member,
    examples: list[Example],
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    max_image_pixels: int = 1280 * 28 * 28,
    on_step: Callable[[float], None] | None = None,
) -> list[float]:
    """Supervised fine-tuning (cross-entropy on the response tokens); returns the loss per step (also passed
    to `on_step`, e.g. for a progress bar)."""
    import torch

    from vlm_corl.members.render import Renderer
    from vlm_corl.members.update import response_logprobs

    render = Renderer(member, "original", max_image_pixels, max_prompt_tokens=1 << 30)
    optimizer = torch.optim.AdamW(member.model.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    member.model.train()
    losses = []
    for _ in range(steps):
        batch = [examples[i] for i in torch.randint(len(examples), (batch_size,), generator=gen).tolist()]
        logp, mask = response_logprobs(
            member.model,
            [render(ex).inputs for ex in batch],
            [target_ids(member, ex.answer) for ex in batch],
            member.policy(),
        )
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if on_step is not None:
            on_step(losses[-1])
    return losses


def labelled_slice(
    loader: str,
    path: str | None,
    split: str,
    skip: int,
    size: int,
    balance: str | None,
    mix: Mapping[str, float] | None = None,
) -> list[Example]:
    """`size` labelled examples after the first `skip`; balanced over metadata[balance] when given, or, with
    `mix` too, in those shares per value of metadata[balance] (drawn from the examples that follow `skip`, as
    many as needed to fill every group)."""
    examples = load_examples(loader, path, split=split).examples
    if skip >= len(examples):
        raise DataError(f"skip={skip} leaves no example: {loader}[{split}] has {len(examples)}")
    examples = examples[skip:]
    if mix is not None:
        return mixed_by(examples, balance or "", mix, size)
    return balance_by(examples, balance, size) if balance else examples[:size]


def mixed_by(examples: list[Example], key: str, mix: Mapping[str, float], size: int) -> list[Example]:
    """About `size` examples with metadata[key] in the shares `mix` gives (normalised; values it does not name
    get none), each group the first examples of its kind in source order.

    A skill-weighted warm start (e.g. mostly shape questions for one member, mostly colour for another) makes
    base members whose errors differ by question type."""
    total = sum(mix.values())
    if not mix or total <= 0 or any(v < 0 for v in mix.values()):
        raise DataError(f"a warm-start mix needs non-negative shares that sum above 0 (got {dict(mix)})")
    counts = {value: round(size * share / total) for value, share in mix.items()}
    groups = {value: [ex for ex in examples if str(ex.metadata.get(key)) == value][:n] for value, n in counts.items()}
    short = {value: (len(groups[value]), n) for value, n in counts.items() if len(groups[value]) < n}
    if short:
        raise DataError(f"not enough examples with {key} = {short} (have, need) for the mix {dict(mix)}")
    return [ex for group in groups.values() for ex in group]


def main(argv=None) -> int:
    parser = cli.parser("python -m vlm_corl.warmstart", __doc__)
    parser.add_argument("--model", required=True, help="model directory to start from (e.g. a zoo member)")
    parser.add_argument("--out", required=True, help="where to save the warm-started base model")
    parser.add_argument("--loader", default="easyvqa", help="dataset loader (registry name)")
    parser.add_argument("--path", default=None, help="dataset path, when the loader needs one")
    parser.add_argument("--split", default="train")
    parser.add_argument(
        "--skip", type=cli.non_negative_int, default=0, help="labelled slice starts after this many examples"
    )
    parser.add_argument("--limit", type=cli.positive_int, default=1000, help="size of the labelled slice")
    parser.add_argument(
        "--balance-by",
        default=None,
        metavar="KEY",
        help="take the slice balanced over metadata[KEY] (e.g. question_type for easy-vqa)",
    )
    parser.add_argument("--steps", type=cli.positive_int, default=300)
    parser.add_argument("--batch-size", type=cli.positive_int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    args = cli.parse(parser, argv)
    import torch
    from tqdm import tqdm

    from vlm_corl.distributed.world import default_device
    from vlm_corl.members.member import check_modality, load_member, member_family

    torch.manual_seed(args.seed)
    out = cli.output_dir(args.out, "--out")
    examples = labelled_slice(args.loader, args.path, args.split, args.skip, args.limit, args.balance_by)
    missing = [ex.id for ex in examples if ex.answer is None]
    if missing:
        raise DataError(f"the warm start needs gold answers; {len(missing)} examples have none (e.g. {missing[0]})")
    cfg = MemberConfig(id=out.name, model=args.model)
    check_modality(member_family(cfg, args.model), examples, f"--model {args.model}")
    member = load_member(cfg, device=default_device())
    losses = []
    with tqdm(total=args.steps, desc=f"warm start {out.name}", unit="step", disable=None) as bar:

        def progress(loss: float) -> None:
            losses.append(loss)
            bar.set_postfix(loss=f"{loss:.3f}", refresh=False)
            bar.update()

        warm_start(member, examples, args.steps, args.batch_size, args.lr, args.seed, on_step=progress)
    member.save(out)
    record = {
        "model": args.model,
        "out": args.out,
        "examples": len(examples),
        "steps": args.steps,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }
    (out / "warmstart.json").write_text(json.dumps({**vars(args), **record}, indent=2))
    print(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
