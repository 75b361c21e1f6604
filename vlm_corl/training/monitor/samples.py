"""What the members actually answered: a few questions of a step, each member's K responses, extracted answers
and vote, the label it was rewarded against and which slots' votes gave it, its rewards and advantages, and the
gold answer where known (diagnostic only). Written by world rank 0 to samples.jsonl (and the trackers) every
`logging.samples_every` steps; `python -m vlm_corl.report RUN_DIR` turns them into a page a person can read.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from vlm_corl.data.answers import answers_equivalent
from vlm_corl.data.records import Example
from vlm_corl.members.render import PROMPT_STYLES
from vlm_corl.training.rewards.modes import CohortBatch, RewardOutput, member_votes


def samples_due(step: int, every: int) -> bool:
    """Whether 1-based `step` writes samples: the first step, then every `every` steps (0 = never)."""
    return every > 0 and (step == 1 or step % every == 0)


def label_sources(mode: str, n: int, slots: int) -> list[int] | str:
    """The slots whose votes a reward mode may take slot `n`'s label from ("gold" for `gt`): ring the previous
    slot, the paired modes the partner, self_vote itself, the peer modes every other slot."""
    if mode == "gt":
        return "gold"
    if mode == "ring":
        return [(n - 1) % slots]
    if mode in ("co_rewarding_1", "co_rewarding_2"):
        return [n ^ 1]
    if mode == "peers_ema":  # slots alternate member, its teacher: the other members' teachers vote
        return [m for m in range(1, slots, 2) if m != n + 1] if n % 2 == 0 else []
    if mode == "self_vote":
        return [n]
    return [m for m in range(slots) if m != n]


@dataclass(frozen=True)
class SampleSettings:
    """The run's settings a samples row is written under, the same at every step."""

    mode: str  # the reward mode (reward.mode): where labels come from
    vote_threshold: float  # reward.vote_threshold: a member's vote, as its reward saw it
    count: int  # logging.samples_per_step: how many of the step's questions
    category_key: str | None = None  # the metadata key of an example's category, when the data has one
    views: tuple[str, ...] = ()  # each slot's view (its question's wording), in slot order
    styles: tuple[str | None, ...] = ()  # each slot's answer instruction (render.PROMPT_STYLES), in slot order


def sample_rows(
    step: int,
    examples: list[Example],
    batch: CohortBatch,
    scored: RewardOutput,
    advantages: list[torch.Tensor],
    settings: SampleSettings,
) -> list[dict]:
    """One row per sampled question (the step's first `settings.count`): per slot its responses, answers, vote,
    label, `label_from` (the candidate source slots whose vote is the label; ["gold"] under gt), rewards,
    advantages."""
    votes = member_votes(batch, settings.vote_threshold)
    ids = batch.member_ids
    rows = []
    for j, ex in enumerate(examples[: settings.count]):
        members = {}
        for n, sid in enumerate(ids):
            label = scored.labels[n][j]
            sources = label_sources(settings.mode, n, len(ids))
            if sources == "gold":
                label_from = ["gold"] if label is not None else []
            else:
                label_from = [
                    ids[m] for m in sources if label is not None and answers_equivalent(label, votes[m][j], ex.choices)
                ]
            members[sid] = {
                "prompt": _prompt(ex, settings, n),
                "responses": batch.texts[n][j],
                "answers": batch.answers[n][j],
                "vote": votes[n][j],
                "label": label,
                "label_from": label_from,
                "rewards": [round(float(r), 4) for r in scored.rewards[n][j]],
                "advantages": [round(float(a), 4) for a in advantages[n][j]],
            }
        image = ex.images[0] if ex.images and isinstance(ex.images[0], (str, Path)) else None
        rows.append(
            {
                "step": step,
                "example_id": ex.id,
                "question": ex.question,
                "image": str(image) if image is not None else None,
                "category": ex.metadata.get(settings.category_key) if settings.category_key else None,
                "gold": ex.answer,
                "members": members,
            }
        )
    return rows


def _prompt(ex: Example, settings: SampleSettings, n: int) -> str:
    """The text slot n was asked: the question in its view's wording and its answer instruction (the chat
    template and any system prompt around it are the member's own)."""
    question = ex.wording_for(settings.views[n]) if n < len(settings.views) else ex.question
    style = settings.styles[n] if n < len(settings.styles) else None
    return PROMPT_STYLES[style].format(question=question) if style in PROMPT_STYLES else question


def sample_markdown(row: dict, image: str | None = None) -> str:
    """One sampled question as Markdown: the question (its picture from `image`, a path relative to the page,
    else its file named), gold (diagnostic), and each member's responses, answers, vote, label, where the label
    came from, rewards and advantages. Every text from the run is `markdown_text`: a model's `<script>` shows as
    text; a response longer than `MAX_TEXT_CHARS` is cut with a note."""
    example = markdown_text(row["example_id"])
    lines = [f"**{example}** (step {row['step']}): {markdown_text(row['question'])}"]
    if image:
        lines.append(f"\n![{example}]({image})\n")
    elif row.get("image"):
        lines.append(f"image: {markdown_text(row['image'])}")
    if row.get("gold") is not None:
        lines.append(f"gold (diagnostic only): {markdown_text(row['gold'])}")
    for mid, m in row["members"].items():
        source = ", ".join(m["label_from"]) or "nobody"
        lines.append(
            f"\n*{markdown_text(mid)}*: vote **{markdown_text(m['vote'])}**, label **{markdown_text(m['label'])}** "
            f"from {markdown_text(source)}"
        )
        for text, answer, reward, adv in zip(m["responses"], m["answers"], m["rewards"], m["advantages"]):
            shown, left = cut_text(text)
            note = f" ({left:,} more characters: samples.jsonl holds the whole response)" if left else ""
            # repr: the response on one line, its newlines and quotes visible
            shown = markdown_text(repr(shown))
            lines.append(f"- **{markdown_text(answer)}** reward {reward:.2f} adv {adv:+.2f}: {shown}{note}")
    return "\n".join(lines)


MAX_TEXT_CHARS = 5_000  # a sampled response shown on a page: longer ones are cut (samples.jsonl keeps them whole)


def cut_text(text: str, limit: int = MAX_TEXT_CHARS) -> tuple[str, int]:
    """(the first `limit` characters of `text`, how many more it has): a page shows a long response's start."""
    return text[:limit], max(0, len(text) - limit)


# Markdown's inline markup (emphasis, code, links, tables, strikethrough), and what starts a block at the start
# of a line (heading, list, setext underline; an ordered list's "1." or "1)")
_INLINE = re.compile(r"([\\`*_\[\]|~])")
_BULLET = re.compile(r"^([#+=-])")
_NUMBERED = re.compile(r"^(\d+)([.)])")


def markdown_text(value) -> str:
    """`value` as Markdown that shows it literally: HTML special characters as entities (a model's `<script>` or
    `<img onerror>` stays text), Markdown's markup backslash-escaped, each line break a hard break (empty lines
    dropped: the text stays one paragraph)."""
    lines = []
    for line in str(value).splitlines():
        if line.strip():
            line = _NUMBERED.sub(r"\1\\\2", _BULLET.sub(r"\\\1", _INLINE.sub(r"\\\1", line.strip())))
            lines.append(html.escape(line, quote=False))
    return "\\\n".join(lines)
