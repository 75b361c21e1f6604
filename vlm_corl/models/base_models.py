"""Base models: a zoo member warm-started on a labelled slice of easy-vqa train (supervised, short), the stand-in
for a pretrained checkpoint in the demo and the easy-vqa experiment.

A `BaseRecipe` names the zoo family and size, the slice (balanced over question types, or in given shares) and
the warm start; `build_base` builds one (zoo -> warm start -> saved). The same recipe and seed give the same
weights on machines that pick the same CPU kernels (`vlm_corl.demo` pins them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from vlm_corl import cli
from vlm_corl.config import MemberConfig
from vlm_corl.models.warmstart import Schedule, Slice, labelled_slice, warm_start
from vlm_corl.models.zoo import build_member
from vlm_corl.registry import FAMILIES


@dataclass(frozen=True)
class BaseRecipe:
    """How a member's base model is made: zoo family/size, a labelled slice of easy-vqa train
    (balanced over question types, or over metadata[balance] in the shares of `mix`, starting at `slice_start`),
    and the supervised warm start."""

    family: str
    size: str
    slice_start: int
    slice_size: int
    steps: int
    lr: float = 2e-3
    batch_size: int = 32
    init_seed: int = 0  # added to the run seed for the zoo initialisation (two members of one family differ)
    # ((value of metadata[balance], share), ...) of the labelled slice; None = balanced over those values
    mix: tuple[tuple[str, float], ...] | None = None
    balance: str = "question_type"
    loader: str = "easyvqa"  # a loader registry name or module:function (vlm_corl.data.loaders)


def build_base(member_id: str, recipe: BaseRecipe, out: Path, seed: int, bar_position: int | None = None) -> dict:
    """Zoo member -> warm start on its labelled slice -> saved at `out` (the path the cohort config names).
    `bar_position`: show a warm-start progress bar (on a terminal) on that line."""
    import torch
    from tqdm import tqdm

    from vlm_corl.members.member import load_member

    torch.set_num_threads(1)  # one thread per worker: parallel warm starts share the machine's cores
    cli.quiet_library_bars()  # a spawned worker starts with transformers' defaults
    init = seed + recipe.init_seed
    # One directory per initialisation: parallel workers never write a zoo member another one is reading.
    zoo_dir = out.parent.parent / "zoo" / f"{recipe.family}-{recipe.size}-init{init}"
    build_member(FAMILIES.get(recipe.family), zoo_dir, size=recipe.size, seed=init)
    mix = dict(recipe.mix) if recipe.mix else None
    part = Slice(recipe.loader, recipe.slice_size, recipe.slice_start, balance=recipe.balance, mix=mix)
    examples = labelled_slice(part)
    torch.manual_seed(seed)
    member = load_member(MemberConfig(id=member_id, model=str(zoo_dir)))
    start = time.time()
    with tqdm(
        total=recipe.steps,
        desc=f"warm start {member_id}",
        unit="step",
        position=bar_position,
        disable=None if bar_position is not None else True,
    ) as bar:
        schedule = Schedule(recipe.steps, recipe.batch_size, recipe.lr, seed)
        losses = warm_start(member, examples, schedule, on_step=lambda loss: bar.update())
    member.save(out)
    return {
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "steps": recipe.steps,
        "examples": len(examples),
        "seconds": round(time.time() - start, 1),
    }
