"""Export a run's trained members as Hugging Face models:
`python -m vlm_corl.export RUN_DIR --out DIR [--merge] [--step N] [--member ID ...] [--overwrite]`.

RUN_DIR is a run directory (its newest complete checkpoint, or `--step N`) or one checkpoint
(`RUN/checkpoints/step-N`). Each member goes to DIR/<member>: a fully fine-tuned member as its model
(`from_pretrained` loads it), a LoRA member as its adapter (`PeftModel.from_pretrained` applies it to the base its
adapter_config.json names) or, with `--merge`, as a whole model with the adapter merged into the base's weights,
in the base's dtype. Optimizer states are left behind. Each member also gets a model card (README.md: base model,
peers, reward, steps, data, the run's evaluations, the prompt format; a metadata header the Hub reads:
base_model, library_name, pipeline_tag, tags, evaluation results) and prompt_format.json, which `corl eval`
reads back so an export is asked as training asked it. Both describe the exported checkpoint from its own record
(`vlm_corl.reporting.model_card`): the config saved with that step, not the run's latest, and the reward
functions the run called; the card's transformers snippet asks a text member in text, a vision member with its
image, with the chat-template variables training used. Files are written readable by all (0644).

DIR must be new or empty: an export beside another one would mix them (an adapter next to full weights, and
loading the folder gives the other run's weights). `--overwrite` replaces DIR whole: the export is written to a
fresh folder beside it and swapped in by renames, so a failure or crash never leaves the two mixed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

from vlm_corl import cli
from vlm_corl.config import MemberConfig
from vlm_corl.errors import UserError
from vlm_corl.members.adapter_files import is_adapter_dir

# torch and transformers load only once the arguments are parsed (the functions below import what they use):
# `--help` and argument mistakes answer at once


def checkpoint_of(run: Path, step: int | None) -> Path:
    """The checkpoint `run` names: itself, its `--step`, or its newest complete one; UserError otherwise."""
    from vlm_corl.training.run.checkpoint import MANIFEST, is_complete, latest_checkpoint

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
    from vlm_corl.members.deepspeed_update import STATE_FILE
    from vlm_corl.members.member import load_member
    from vlm_corl.members.state_files import TRAINER_STATE

    optimizer_partition = re.compile(re.escape(STATE_FILE).replace(r"\{\}", r"[0-9]+"))  # DeepSpeed's, per rank
    if is_adapter_dir(source) and merge:
        member = load_member(MemberConfig(id=source.name, model=str(source), trainable=False), device=None)
        out.mkdir(parents=True, exist_ok=True)
        member.model.save_pretrained(out, safe_serialization=True)
        (member.processor if member.is_vision else member.tokenizer).save_pretrained(out)
        return "merged model"
    out.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.is_file() and f.name != TRAINER_STATE and not optimizer_partition.fullmatch(f.name):
            shutil.copy2(f, out / f.name)
    return "adapter" if is_adapter_dir(source) else "model"


def readable_by_all(folder: Path) -> None:
    """Exported files 0644 and folders 0755: an export is shared (checkpoints may be written private)."""
    for path in [folder, *folder.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)


def used_entries(out: Path) -> list[str]:
    """The sorted names in `out` when it is a directory holding anything; [] when it is absent, empty or not a
    directory (`cli.output_dir` names the last case)."""
    return sorted(p.name for p in out.iterdir()) if out.is_dir() else []


def check_out(out: Path, overwrite: bool, checkpoint: Path) -> bool:
    """Whether `--out` holds something this export replaces (only with `--overwrite`); a used `--out` without it,
    or one holding the checkpoint being exported, is a UserError."""
    entries = used_entries(out)
    if not entries:
        return False
    if not overwrite:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise UserError(
            f"--out {out} is not empty (it holds {shown}): an export there would sit beside those files and "
            "loading it could give their weights; give a new or empty folder, or --overwrite to replace it whole"
        )
    if checkpoint.resolve().is_relative_to(out.resolve()):
        raise UserError(
            f"--out {out} holds the checkpoint being exported ({checkpoint}); --overwrite would delete it: choose "
            "another folder"
        )
    return True


@contextlib.contextmanager
def replaced_whole(out: Path) -> Iterator[Path]:
    """A fresh folder beside `out` for the body to write into. When the body succeeds it takes `out`'s place
    (the old one renamed away, the new one renamed in, the old removed); when it fails it is removed and `out` is
    left as it was. Same parent, so each rename is atomic: at any moment `out` is the old export or the new one
    (or, after a crash between the two renames, absent with both beside it as hidden folders), never a mix."""
    target = out.resolve()  # a symlinked --out: replace the folder it points to, beside it
    try:
        fresh = Path(tempfile.mkdtemp(prefix=f".{target.name}.export-", dir=target.parent))
        os.chmod(fresh, stat.S_IMODE(target.stat().st_mode))  # mkdtemp's 0700 would change who can read it
    except OSError as err:
        raise UserError(
            f"--out {out}: cannot write a folder beside it in {target.parent} ({err.strerror or err}); --overwrite "
            "needs that (the new export is swapped in by a rename), or give a new folder"
        ) from err
    try:
        yield fresh
    except BaseException:
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    old = fresh.with_name(fresh.name.replace(".export-", ".replaced-", 1))
    try:
        target.rename(old)
    except OSError as err:
        shutil.rmtree(fresh, ignore_errors=True)
        raise UserError(f"--out {out} cannot be replaced ({err.strerror or err}); give a new folder") from err
    try:
        fresh.rename(target)
    except BaseException:
        old.rename(target)  # put the old export back rather than leave no --out
        shutil.rmtree(fresh, ignore_errors=True)
        raise
    try:
        shutil.rmtree(old)
    except OSError as err:  # the new export is in place; only the old copy's space is left to free
        print(f"warning: could not remove the replaced export {old} ({err}); remove it by hand", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """`python -m vlm_corl.export`: write the checkpoint's members (all, or `--member`) into `--out`."""
    parser = cli.parser("python -m vlm_corl.export", __doc__)
    parser.add_argument("run", help="a run directory or one of its checkpoints (RUN/checkpoints/step-N)")
    parser.add_argument("--out", required=True, help="new or empty directory that gets one folder per member")
    parser.add_argument("--merge", action="store_true", help="LoRA members: merge the adapter into a whole model")
    parser.add_argument("--step", type=cli.positive_int, default=None, help="the checkpoint's step (default: newest)")
    parser.add_argument("--member", nargs="+", default=None, help="only these members (default: every one)")
    parser.add_argument(
        "--overwrite", action="store_true", help="replace a non-empty --out whole (nothing of it is kept)"
    )
    args = cli.parse(parser, argv)
    from vlm_corl.reporting.model_card import write_card
    from vlm_corl.training.run.checkpoint import MANIFEST

    checkpoint = checkpoint_of(Path(args.run), args.step)
    members = list(json.loads((checkpoint / MANIFEST).read_text())["members"])
    unknown = sorted(set(args.member or ()) - set(members))
    if unknown:
        raise UserError(f"--member {', '.join(unknown)}: not in {checkpoint} (it holds {', '.join(members)})")
    out = Path(args.out)
    # checked before anything is written: a refused export leaves --out exactly as it was
    replace = check_out(out, args.overwrite, checkpoint)
    written = []
    with replaced_whole(out) if replace else cli.kept_if_written(out, "--out") as where:
        for mid in args.member or members:
            kind = export_member(checkpoint / mid, where / mid, args.merge)
            write_card(checkpoint, mid, where / mid)
            readable_by_all(where / mid)
            written.append(f"{mid}: {kind} + model card -> {out / mid}")
    print("\n".join(written))  # once the export is in place (with --overwrite: after the swap)
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
