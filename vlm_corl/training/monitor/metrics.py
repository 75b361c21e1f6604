"""Per-member step metrics (pure functions of the scored batch) and their sinks: metrics.jsonl and TensorBoard.

Gold answers are read here for diagnostics only (pseudo-label accuracy, answer accuracy, unanimous-wrong
rate); they never reach a label-free reward.

Collapse diagnostics (docs/method.md), all in nats where an entropy:

- ``answer_entropy``: per group (one slot, one example, its K answers), the entropy of the distribution of its
  answers over equivalence classes (``group_equivalent``, the classes plurality voting counts); mean over the
  groups that have at least one parseable answer. Unparseable answers are EXCLUDED (as in ``distinct_answers``;
  their share is ``unparsed_rate``): a group with answers ``[a, a, b, None]`` has the entropy of (2/3, 1/3).
  None when no group of the step has a parseable answer.
- ``answer_entropy_batch``: the entropy of the distribution of ALL the slot's parseable answers of the step
  (B*K answers, across questions), classes by canonical form (``answer_key``: the choice letter for an answer
  that names a multiple-choice option, else ``normalize_answer``; no math-verify across questions, so "0.5" and
  "1/2" are two classes here). A slot answering every question with one constant word has 0; a slot whose
  answers follow the gold distribution keeps about that distribution's entropy. None when nothing parses.
- ``unanimous_rate`` (cohort level, the same value in every slot's row): the share of the step's questions on
  which every slot's vote (``member_votes`` with the reward's ``vote_threshold``) is the same answer. An
  abstention (no parseable answer, or a plurality below the threshold) makes a question NOT unanimous.
- ``unanimous_wrong_rate`` (cohort level, diagnostic only): the share of questions with a gold answer on which
  the cohort is unanimous AND its common vote is not equivalent to gold. Denominator: all questions with gold
  (so ``unanimous_wrong_rate <= unanimous_rate``); None when no question has gold.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor

from vlm_corl.data.answers import answers_equivalent, choice_letter, group_equivalent, normalize_answer
from vlm_corl.training.rewards.grpo import nonzero_variance_groups
from vlm_corl.training.rewards.modes import CohortBatch, RewardOutput, member_votes


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _finite_or_none(value: float) -> float | None:
    return None if math.isnan(value) else value


def entropy(counts: Sequence[int]) -> float:
    """Shannon entropy (nats) of the distribution given by `counts` (zeros ignored); 0.0 for no mass."""
    total = sum(counts)
    if total <= 0:
        return 0.0
    return max(0.0, -sum(c / total * math.log(c / total) for c in counts if c > 0))


def group_entropy(answers: Sequence[str | None], choices: Sequence[str] | None = None) -> float | None:
    """Entropy (nats) of one group's parseable answers over equivalence classes; None if none parses."""
    counts = Counter(c for c in group_equivalent(answers, choices) if c is not None)
    return entropy(list(counts.values())) if counts else None


def answer_entropy(groups: Sequence[Sequence[str | None]], choices: Sequence) -> float | None:
    """Mean group entropy over the groups (B, K) with at least one parseable answer; None if there are none."""
    return _mean([h for j, g in enumerate(groups) if (h := group_entropy(g, choices[j])) is not None])


def answer_key(answer: str, choices: Sequence[str] | None = None) -> str:
    """Canonical form of an answer for counting across questions: "(B)" for an answer naming option B of a
    multiple-choice question, else its normalised string."""
    if choices:
        letter = choice_letter(answer, choices)
        if letter is not None:
            return f"({letter})"
    return normalize_answer(answer)


def batch_entropy(groups: Sequence[Sequence[str | None]], choices: Sequence) -> float | None:
    """Entropy (nats) of the distribution of all parseable answers of (B, K) groups, keyed by `answer_key`."""
    counts = Counter(answer_key(a, choices[j]) for j, g in enumerate(groups) for a in g if a is not None)
    return entropy(list(counts.values())) if counts else None


def unanimous_questions(
    votes: Sequence[Sequence[str | None]], choices: Sequence, gold: Sequence[str | None]
) -> list[tuple[bool, bool | None]]:
    """Per question of (N, B) votes: (unanimous, unanimous on a wrong answer; None without gold). A question is
    unanimous when no slot abstains and all N votes fall in one equivalence class."""
    flags = []
    for j in range(len(votes[0]) if votes else 0):
        column = [v[j] for v in votes]
        classes = group_equivalent(column, choices[j])
        is_unanimous = None not in classes and len(set(classes)) == 1
        wrong = None if gold[j] is None else is_unanimous and not answers_equivalent(gold[j], column[0], choices[j])
        flags.append((is_unanimous, wrong))
    return flags


def unanimity(flags: Sequence[tuple[bool, bool | None]]) -> dict:
    """Cohort-level agreement of one step from `unanimous_questions`: `unanimous_rate` and
    `unanimous_wrong_rate` (see the module docstring)."""
    wrong = [w for _, w in flags if w is not None]
    return {
        "unanimous_rate": _mean([float(u) for u, _ in flags]),
        "unanimous_wrong_rate": _mean([float(w) for w in wrong]),
    }


def cohort_unanimity(batch: CohortBatch, gold: list[str | None], vote_threshold: float = 0.0) -> list:
    """Per question of the step, whether the slots' votes are unanimous (and wrong): `unanimous_questions` of
    every slot's plurality vote (with the reward's self-consistency threshold)."""
    return unanimous_questions(member_votes(batch, vote_threshold), batch.choices, gold)


PAIR_PREFIX = "vote_agreement/"


def pairwise_agreement(batch: CohortBatch, vote_threshold: float = 0.0) -> list[dict[str, float | None]]:
    """Per slot, `vote_agreement/<other slot>`: the share of the step's questions on which both voted where
    their votes are equivalent (None when they never both voted): the report's member x member matrix."""
    votes = member_votes(batch, vote_threshold)
    ids, out = batch.member_ids, []
    for i in range(len(ids)):
        row = {}
        for j in range(len(ids)):
            if j == i:
                continue
            both = [b for b in range(len(votes[i])) if votes[i][b] is not None and votes[j][b] is not None]
            same = [answers_equivalent(votes[i][b], votes[j][b], batch.choices[b]) for b in both]
            row[PAIR_PREFIX + ids[j]] = _mean([float(x) for x in same])
        out.append(row)
    return out


def zero_variance_frac(rewards: Tensor) -> float:
    """The share of (B, K) `rewards`' groups whose K rewards are all equal (no GRPO gradient); 0.0 for none."""
    return 1.0 - nonzero_variance_groups(rewards).float().mean().item() if len(rewards) else 0.0


def member_metrics(
    n: int, batch: CohortBatch, out: RewardOutput, lengths: list[list[int]], gold: list[str | None]
) -> dict:
    """Diagnostics of member n on one step: rewards, labels, answer diversity, lengths, accuracy vs gold."""
    answers, choices, labels = batch.answers[n], batch.choices, out.labels[n]
    rewards = out.rewards[n]  # (B, K)
    labelled = [j for j, lab in enumerate(labels) if lab is not None]
    with_gold = [j for j in labelled if gold[j] is not None]
    flat = [(j, a) for j, group in enumerate(answers) for a in group]
    # a reward function's part is NaN where it abstained: its mean is over the completions it scored
    parts = {f"reward_{name}": _finite_or_none(part[n].nanmean().item()) for name, part in out.parts.items()}
    return {
        "reward_mean": rewards.mean().item(),
        **parts,
        "reward_std": rewards.std().item() if rewards.numel() > 1 else 0.0,
        # share of responses that agree with the member's label source (its pseudo-label)
        "agreement": _mean([float(answers_equivalent(labels[j], a, choices[j])) for j in labelled for a in answers[j]]),
        "abstain_rate": 1 - len(labelled) / len(labels),
        "distinct_answers": statistics.fmean(
            len({c for c in group_equivalent(group, choices[j]) if c is not None}) for j, group in enumerate(answers)
        ),
        "answer_entropy": answer_entropy(answers, choices),
        "answer_entropy_batch": batch_entropy(answers, choices),
        "unparsed_rate": sum(a is None for _, a in flat) / len(flat),
        "response_len": statistics.fmean(x for row in lengths for x in row),
        "response_len_min": min(x for row in lengths for x in row),
        "response_len_max": max(x for row in lengths for x in row),
        "zero_variance_frac": zero_variance_frac(rewards),
        "pseudo_label_acc": _mean([float(answers_equivalent(gold[j], labels[j], choices[j])) for j in with_gold]),
        "answer_acc": _mean(
            [float(answers_equivalent(gold[j], a, choices[j])) for j, a in flat if gold[j] is not None]
        ),
    }


def _step_of(line: str, path: Path) -> float:
    """A row's step; a torn row (the process died while writing it) counts as after any checkpoint, so it is
    dropped and recomputed on resume."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        logging.getLogger("vlm_corl").warning("%s: dropping a torn or unreadable row: %.80s", path, line)
        return math.inf


class MetricsSink:
    """Appends one JSON object per member per step to metrics.jsonl (evaluation rows to eval.jsonl, sampled
    responses to samples.jsonl) and reports the numbers to the run's trackers (`vlm_corl.training.monitor.trackers`)."""

    def __init__(self, run_dir: Path, trackers: Sequence = ()):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.eval_path = Path(run_dir) / "eval.jsonl"
        self.samples_path = Path(run_dir) / "samples.jsonl"
        self.trackers = list(trackers)

    def write(self, rows: list[dict]) -> None:
        """Step rows (one per member) to metrics.jsonl; tracker series <member>/<key>."""
        self._append(self.path, rows, lambda row: row["member"])

    def write_eval(self, rows: list[dict]) -> None:
        """Evaluation rows to eval.jsonl; tracker series <member>/eval/<benchmark>/<key>."""
        self._append(self.eval_path, rows, lambda row: f"{row['member']}/eval/{row['benchmark']}")

    def write_samples(self, rows: list[dict], step: int) -> None:
        """One step's sampled questions (`vlm_corl.training.monitor.samples`) to samples.jsonl and the trackers."""
        with self.samples_path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        for tracker in self.trackers:
            tracker.samples(rows, step)

    def _append(self, path: Path, rows: list[dict], tag_prefix) -> None:
        with path.open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
        by_step: dict[int, dict[str, float]] = {}
        for row in rows:
            for key, value in row.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "n"):
                    by_step.setdefault(row["step"], {})[f"{tag_prefix(row)}/{key}"] = value
        for step, values in sorted(by_step.items()):  # one call per step: W&B wants each step's values together
            for tracker in self.trackers:
                tracker.scalars(values, step)

    def truncate_after(self, step: int) -> tuple[list[dict], list[dict]]:
        """On resume, drop rows of steps after the checkpoint (they will be recomputed); returns the metrics and
        the evaluation rows kept, the histories the collapse detectors and the summary continue from."""
        kept: dict[Path, list[str]] = {}
        for path in (self.path, self.eval_path, self.samples_path):
            lines = path.read_text().splitlines() if path.exists() else []
            kept[path] = [line for line in lines if line and _step_of(line, path) <= step]
            if path.exists():
                path.write_text("".join(r + "\n" for r in kept[path]))
        return tuple([json.loads(line) for line in kept[path]] for path in (self.path, self.eval_path))

    def close(self, summary: dict | None = None) -> None:
        """End the trackers' runs, giving them the run's summary (None: the run raised); once: a later call
        (the run's release after its summary) finds none left."""
        trackers, self.trackers = self.trackers, []
        for tracker in trackers:
            tracker.finish(summary)
