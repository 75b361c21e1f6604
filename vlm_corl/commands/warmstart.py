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

from vlm_corl import cli
from vlm_corl.config import MemberConfig
from vlm_corl.data.loaders import DataError
from vlm_corl.models.warmstart import Schedule, Slice, labelled_slice, warm_start


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
    part = Slice(args.loader, args.limit, args.skip, args.split, args.path, args.balance_by)
    examples = labelled_slice(part)
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

        warm_start(member, examples, Schedule(args.steps, args.batch_size, args.lr, args.seed), on_step=progress)
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
