"""The "base model" step: a short supervised warm start on a small labelled slice.

A randomly initialised tiny model cannot answer at all, so peer agreement has nothing to amplify. This step
plays the role of starting from a pretrained checkpoint: it teaches a member the answer format of its prompt
style and a little of the task from a few labelled examples, then saves it (HF format) as the base model that
label-free training starts from. It is the only training step that reads labels. The command: `corl warmstart`
(vlm_corl.commands.warmstart).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

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


@dataclass(frozen=True)
class Schedule:
    """A warm start's optimisation: `steps` AdamW steps at `lr`, each on `batch_size` examples drawn with `seed`,
    pictures rendered at up to `max_image_pixels`."""

    steps: int
    batch_size: int
    lr: float
    seed: int = 0
    max_image_pixels: int = 1280 * 28 * 28


@dataclass(frozen=True)
class Slice:
    """Labelled examples of a dataset: `size` of them after the first `skip` of loader[split] (`path`: where,
    for a loader that needs one); balanced over metadata[balance] when given, or, with `mix` too, in those
    shares per value of metadata[balance]."""

    loader: str
    size: int
    skip: int = 0
    split: str = "train"
    path: str | None = None
    balance: str | None = None
    mix: Mapping[str, float] | None = None


def warm_start(
    member: Member, examples: list[Example], schedule: Schedule, on_step: Callable[[float], None] | None = None
) -> list[float]:
    """Supervised fine-tuning (cross-entropy on the response tokens); returns the loss per step (also passed
    to `on_step`, e.g. for a progress bar)."""
    import torch

    from vlm_corl.members.render import Renderer
    from vlm_corl.members.update import response_logprobs

    render = Renderer(member, "original", schedule.max_image_pixels, max_prompt_tokens=1 << 30)
    optimizer = torch.optim.AdamW(member.model.parameters(), lr=schedule.lr)
    gen = torch.Generator().manual_seed(schedule.seed)
    member.model.train()
    losses = []
    for _ in range(schedule.steps):
        draws = torch.randint(len(examples), (schedule.batch_size,), generator=gen).tolist()
        batch = [examples[i] for i in draws]
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


def labelled_slice(part: Slice) -> list[Example]:
    """The examples of `part` (with `mix`, drawn from the examples that follow `skip`, as many as needed to fill
    every group)."""
    examples = load_examples(part.loader, part.path, split=part.split).examples
    if part.skip >= len(examples):
        raise DataError(f"skip={part.skip} leaves no example: {part.loader}[{part.split}] has {len(examples)}")
    examples = examples[part.skip :]
    if part.mix is not None:
        return mixed_by(examples, part.balance or "", part.mix, part.size)
    return balance_by(examples, part.balance, part.size) if part.balance else examples[: part.size]


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
