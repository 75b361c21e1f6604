"""The collapse guard (`train.on_collapse`) and the best model per member (`eval.keep_best`).

The detectors (training/monitor/collapse.py) flag a slot on the whole batch, inside a category of its questions, or
when its in-loop evaluation on a category falls more than `eval.max_category_drop` below step 0. What the run
then does:

- `warn` (default): the warning is logged and listed in summary.json; training goes on.
- `stop`: the step's rows are written, then the run stops (exit status 3) with one message naming the member,
  the category and the evidence.
- `rollback`: as `stop`, after moving every checkpoint taken at or after the step of the first flag into
  `checkpoints/collapsed/`, so the newest complete checkpoint (what resuming and `python -m vlm_corl.eval RUN`
  take) is the last one from before the collapse was seen.

`eval.keep_best: BENCH` keeps, for every trained member, the weights (HF format) of the in-loop evaluation
with its best score on BENCH in `best/<member>/`, with `best/best.json` ({member: {step, benchmark, score}});
neither `stop` nor `rollback` touches them.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from vlm_corl.training.monitor.collapse import describe
from vlm_corl.training.run.checkpoint import latest_checkpoint, list_checkpoints

if TYPE_CHECKING:
    from vlm_corl.members.member import Member

log = logging.getLogger("vlm_corl")

BEST_DIR, BEST_FILE = "best", "best.json"
COLLAPSED_DIR = "collapsed"
EXIT_STATUS = 3


class CollapseStopped(Exception):
    """The guard stopped the run (`train.on_collapse`: stop | rollback); the message says who, where and why."""

    exit_status = EXIT_STATUS


def stop_message(warning: dict, action: str, checkpoint: Path | None) -> str:
    """The one message a guarded run stops with."""
    where = f" in category {warning['category']!r}" if warning.get("category") is not None else ""
    text = (
        f"collapse guard (train.on_collapse={action}): member {warning['slot']!r}{where} at step "
        f"{warning['step']}: {describe(warning)}"
    )
    if action == "rollback":
        text += (
            f"; rolled back to {checkpoint}, the last checkpoint before it (later ones moved to "
            f"checkpoints/{COLLAPSED_DIR}/)"
            if checkpoint
            else "; no checkpoint was taken before it"
        )
    elif checkpoint:
        text += f"; the newest checkpoint is {checkpoint}"
    return text


def roll_back(run_dir: Path, first_flag_step: int) -> Path | None:
    """Move the checkpoints of steps >= `first_flag_step` into checkpoints/collapsed/ (kept for inspection,
    never resumed from); returns the newest checkpoint left, or None."""
    root = Path(run_dir) / "checkpoints"
    for checkpoint in list_checkpoints(run_dir):
        if int(checkpoint.name.split("-")[1]) >= first_flag_step:
            target = root / COLLAPSED_DIR / checkpoint.name
            shutil.rmtree(target, ignore_errors=True)
            target.parent.mkdir(exist_ok=True)
            checkpoint.rename(target)
            log.warning("collapse guard: moved %s to %s", checkpoint, target)
    return latest_checkpoint(run_dir)


def improved(rows: list[dict], benchmark: str, best: dict[str, dict]) -> list[dict]:
    """The evaluation rows of `benchmark` whose score beats the member's best so far (`best`: {member: {step,
    benchmark, score}}; a first evaluation always does)."""
    return [
        r
        for r in rows
        if r["benchmark"] == benchmark and (r["member"] not in best or r["score"] > best[r["member"]]["score"])
    ]


def save_best(member: Member, run_dir: Path, writer: bool) -> None:
    """Replace `best/<member>/` with the member's current weights; every rank of the member calls it (a
    partitioned member's weights are gathered), the `writer` writes into a temporary directory, then swaps."""
    root = Path(run_dir) / BEST_DIR
    tmp, final, old = root / f".tmp-{member.id}", root / member.id, root / f".old-{member.id}"
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    member.save_weights(tmp, write=writer)
    if writer:
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)


def read_best(run_dir: Path) -> dict[str, dict]:
    """best/best.json of a run ({} when none was kept)."""
    path = Path(run_dir) / BEST_DIR / BEST_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def write_best(run_dir: Path, best: dict[str, dict]) -> None:
    path = Path(run_dir) / BEST_DIR / BEST_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(best, indent=1))
