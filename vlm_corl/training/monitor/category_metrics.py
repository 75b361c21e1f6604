"""Per-category training metrics: pure functions of the scored batch, and running windows over a slot's rows.

A collapse can hide inside one category (easy-vqa's question types, MATH's subjects) while batch averages
look healthy, so each metrics row also breaks the step down by the category of its questions
(`logging.category_key`, a metadata key of the examples). One batch holds few questions of each category, so a
row keeps the step's raw sums and reports running-window means:

- `category_stats` (nested, in metrics.jsonl only): {category: {"questions": q, metric: [sum, count], ...,
  "answers": {answer key: count}}} for this step, metric in STATS. Sums and counts add across steps.
- `category/<c>/<metric>` (flat, also in TensorBoard), `<c>` the category's `path_safe` name (`yes/no` ->
  `yes_no`, so a tag is never split into extra levels): sum of sums / sum of counts over the slot's last
  `logging.category_window` rows (None where the count is 0), plus over the same rows' pooled answers
  `category/<c>/answer_entropy_pooled` (entropy, nats, of all the slot's answers to the category's questions,
  classes by `metrics.answer_key`) and `category/<c>/distinct_pooled` (how many classes).

What each metric sums, per question of the category (gold is read for diagnostics only):
  reward            every response's reward (count K)
  agreement         responses equivalent to the slot's pseudo-label, where it has one (count K)
  answer_entropy    the question's group entropy over its parseable answers (count 1 where any parses)
  distinct_answers  distinct answer classes among its K answers (count 1)
  unanimous         every slot votes the same answer (count 1)
  unanimous_wrong   unanimous on an answer that is not gold (count 1 where gold exists)
  pseudo_label_acc  the pseudo-label equals gold (count 1 where both exist)
  answer_acc        responses equal to gold (count K where gold exists)
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Sequence

from vlm_corl.data.answers import answers_equivalent, group_equivalent
from vlm_corl.training.monitor.metrics import answer_key, entropy, group_entropy
from vlm_corl.training.rewards.modes import CohortBatch, RewardOutput

STATS = (
    "reward",
    "agreement",
    "answer_entropy",
    "distinct_answers",
    "unanimous",
    "unanimous_wrong",
    "pseudo_label_acc",
    "answer_acc",
)
MAX_ANSWER_KEYS = 32  # distinct answers kept per category and step (the rest pooled under OTHER)
OTHER = "<other>"
UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


def path_safe(category: str) -> str:
    """`category` as one level of a metric key, tracker tag or path: each character outside [A-Za-z0-9_.-] made
    `_` (easy-vqa's `yes/no` -> `yes_no`; a `/` made TensorBoard show `category/yes/no/agreement` as extra
    levels). The real name stays in `category_stats`, samples and warnings."""
    return UNSAFE.sub("_", str(category))


def category_step_stats(
    n: int,
    batch: CohortBatch,
    out: RewardOutput,
    categories: Sequence[str | None],
    gold: Sequence[str | None],
    unanimous: Sequence[tuple[bool, bool | None]],
) -> dict:
    """Slot n's raw per-category sums of one step (see the module docstring). `categories` (B,) names each
    question's category (None: not counted); `unanimous` (B,) is `metrics.unanimous_questions` of the step."""
    stats: dict[str, dict] = {}
    answers, choices, labels, rewards = batch.answers[n], batch.choices, out.labels[n], out.rewards[n]
    for j, category in enumerate(categories):
        if category is None:
            continue
        c = stats.setdefault(category, {"questions": 0, **{k: [0.0, 0] for k in STATS}, "answers": Counter()})
        group, k = answers[j], len(answers[j])
        c["questions"] += 1
        _add(c, "reward", float(rewards[j].sum()), k)
        if labels[j] is not None:
            _add(c, "agreement", sum(answers_equivalent(labels[j], a, choices[j]) for a in group), k)
        if (h := group_entropy(group, choices[j])) is not None:
            _add(c, "answer_entropy", h, 1)
        _add(c, "distinct_answers", len({x for x in group_equivalent(group, choices[j]) if x is not None}), 1)
        _add(c, "unanimous", float(unanimous[j][0]), 1)
        if gold[j] is not None:
            _add(c, "unanimous_wrong", float(bool(unanimous[j][1])), 1)
            _add(c, "answer_acc", sum(answers_equivalent(gold[j], a, choices[j]) for a in group), k)
            if labels[j] is not None:
                _add(c, "pseudo_label_acc", float(answers_equivalent(gold[j], labels[j], choices[j])), 1)
        c["answers"].update(answer_key(a, choices[j]) for a in group if a is not None)
    for c in stats.values():
        c["answers"] = _capped(c["answers"])
    return stats


def _add(stats: dict, key: str, value: float, count: int) -> None:
    stats[key][0] += float(value)
    stats[key][1] += count


def _capped(answers: Counter) -> dict[str, int]:
    """The MAX_ANSWER_KEYS most frequent answers; the rest counted under OTHER (a free-form category can have a
    new answer on every response, and rows must stay small)."""
    kept = dict(answers.most_common(MAX_ANSWER_KEYS))
    rest = sum(answers.values()) - sum(kept.values())
    return {**kept, OTHER: rest} if rest else kept


def pooled(step_stats: Iterable[dict]) -> dict[str, dict]:
    """Per category, the sums, counts and answer counts of several steps' `category_stats` added up."""
    total: dict[str, dict] = {}
    for stats in step_stats:
        for category, c in (stats or {}).items():
            t = total.setdefault(category, {"questions": 0, **{k: [0.0, 0] for k in STATS}, "answers": Counter()})
            t["questions"] += c["questions"]
            for k in STATS:
                t[k][0] += c[k][0]
                t[k][1] += c[k][1]
            t["answers"].update(c["answers"])
    return total


def ratio(pair: Sequence[float]) -> float | None:
    """sum / count, None when nothing was counted."""
    return pair[0] / pair[1] if pair[1] else None


def pooled_diversity(answers: dict[str, int]) -> tuple[float | None, int]:
    """(entropy in nats, number of classes) of pooled answer counts; entropy None when there are none. Answers
    pooled under OTHER count as one class each (they are at least that many)."""
    counts = [v for k, v in answers.items() if k != OTHER] + [1] * answers.get(OTHER, 0)
    return (entropy(counts) if counts else None), len(counts)


def window_metrics(step_stats: Sequence[dict]) -> dict[str, float | int | None]:
    """The flat `category/<c>/<metric>` keys of a row from the `category_stats` of the slot's last rows."""
    out: dict[str, float | int | None] = {}
    for category, c in sorted(pooled(step_stats).items()):
        prefix = f"category/{path_safe(category)}/"
        out.update({prefix + k: ratio(c[k]) for k in STATS})
        out[prefix + "answer_entropy_pooled"], out[prefix + "distinct_pooled"] = pooled_diversity(c["answers"])
        out[prefix + "questions"] = c["questions"]
    return out
