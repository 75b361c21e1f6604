"""Export a run's trained members as Hugging Face models:
`python -m vlm_corl.export RUN_DIR --out DIR [--merge] [--step N] [--member ID ...]`.

RUN_DIR is a run directory (its newest complete checkpoint, or `--step N`) or one checkpoint
(`RUN/checkpoints/step-N`). Each member goes to DIR/<member>: a fully fine-tuned member as its model
(`from_pretrained` loads it), a LoRA member as its adapter (`PeftModel.from_pretrained` applies it to the base its
adapter_config.json names) or, with `--merge`, as a whole model with the adapter merged into the base's weights,
in the base's dtype. Optimizer states are left behind.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

from vlm_corl import cli
from vlm_corl.config import MemberConfig
from vlm_corl.training.checkpoint import MANIFEST, is_complete, latest_checkpoint
from vlm_corl.errors import UserError
from vlm_corl.members.deepspeed_update import STATE_FILE
from vlm_corl.members.lora import is_adapter_dir
from vlm_corl.members.member import load_member
from vlm_corl.members.state_files import TRAINER_STATE

STATE_PATTERN = re.compile(re.escape(STATE_FILE).replace(r"\{\}", r"[0-9]+"))  # a DeepSpeed optimizer partition


def checkpoint_of(run: Path, step: int | None) -> Path:
    """The checkpoint `run` names: itself, its `--step`, or its newest complete one; UserError otherwise."""
    if (run / MANIFEST).is_file():
        found = run
    elif step is not None:
        found = run / "checkpoints" / f"step-{step}"
    else:
        found = latest_checkpoint(run) if (run / "checkpoints").is_dir() else None
    if found is None or not is_complete(found):
        what = f"step {step}" if step is not None else "a complete checkpoint"
        raise UserError(
            f"{run}: no {what} there; give a run directory (with checkpoints/) or a checkpoint "
            "(RUN/checkpoints/step-N with its manifest.json)"
        )
    return found


def export_member(source: Path, out: Path, merge: bool) -> str:
    """Write one member's checkpoint `source` to `out`; returns what was written ("model", "adapter" or
    "merged model")."""
    if is_adapter_dir(source) and merge:
        member = load_member(MemberConfig(id=source.name, model=str(source), trainable=False), device=None)
        out.mkdir(parents=True, exist_ok=True)
        member.model.save_pretrained(out, safe_serialization=True)
        (member.processor if member.is_vision else member.tokenizer).save_pretrained(out)
        return "merged model"
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != TRAINER_STATE and not STATE_PATTERN.fullmatch(f.name):
            shutil.copy2(f, out / f.name)
    return "adapter" if is_adapter_dir(source) else "model"


def main(argv: list[str] | None = None) -> int:
    parser = cli.parser("python -m vlm_corl.export", __doc__)
    parser.add_argument("run", help="a run directory or one of its checkpoints (RUN/checkpoints/step-N)")
    parser.add_argument("--out", required=True, help="directory that gets one folder per member")
    parser.add_argument("--merge", action="store_true", help="LoRA members: merge the adapter into a whole model")
    parser.add_argument("--step", type=cli.positive_int, default=None, help="the checkpoint's step (default: newest)")
    parser.add_argument("--member", nargs="+", default=None, help="only these members (default: every one)")
    args = parser.parse_args(argv)
    checkpoint = checkpoint_of(Path(args.run), args.step)
    members = list(json.loads((checkpoint / MANIFEST).read_text())["members"])
    unknown = sorted(set(args.member or ()) - set(members))
    if unknown:
        raise UserError(f"--member {', '.join(unknown)}: not in {checkpoint} (it holds {', '.join(members)})")
    with cli.kept_if_written(args.out, "--out") as out:
        for mid in args.member or members:
            what = export_member(checkpoint / mid, out / mid, args.merge)
            print(f"{mid}: {what} -> {out / mid}")
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
