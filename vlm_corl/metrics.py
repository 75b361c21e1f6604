"""Per-member step metrics (pure functions of the scored batch) and their sinks: metrics.jsonl and TensorBoard.

Gold answers are read here for diagnostics only (pseudo-label accuracy, answer accuracy); they never reach
a label-free reward.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from vlm_corl.answers import answers_equivalent, group_equivalent
from vlm_corl.rewards import CohortBatch, RewardOutput


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def member_metrics(n: int, batch: CohortBatch, out: RewardOutput, lengths: list[list[int]],
                   gold: list[str | None]) -> dict:
    """Diagnostics of member n on one step: rewards, labels, answer diversity, lengths, accuracy vs gold."""
    answers, choices, labels = batch.answers[n], batch.choices, out.labels[n]
    rewards = out.rewards[n]  # (B, K)
    labelled = [j for j, lab in enumerate(labels) if lab is not None]
    with_gold = [j for j in labelled if gold[j] is not None]
    flat = [(j, a) for j, group in enumerate(answers) for a in group]
    parts = {f"reward_{name}": part[n].mean().item() for name, part in out.parts.items()}
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
        "unparsed_rate": sum(a is None for _, a in flat) / len(flat),
        "response_len": statistics.fmean(x for row in lengths for x in row),
        "pseudo_label_acc": _mean([float(answers_equivalent(gold[j], labels[j], choices[j])) for j in with_gold]),
        "answer_acc": _mean([float(answers_equivalent(gold[j], a, choices[j])) for j, a in flat if gold[j] is not None]),
    }


class MetricsSink:
    """Appends one JSON object per member per step to metrics.jsonl, and mirrors scalars to TensorBoard."""

    def __init__(self, run_dir: Path, tensorboard: bool):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.eval_path = Path(run_dir) / "eval.jsonl"
        self.writer = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # imported here: it pulls in tensorboard

            self.writer = SummaryWriter(log_dir=str(Path(run_dir) / "tensorboard"))

    def write(self, rows: list[dict]) -> None:
        """Step rows (one per member) to metrics.jsonl; TensorBoard tags <member>/<key>."""
        self._append(self.path, rows, lambda row: row["member"])

    def write_eval(self, rows: list[dict]) -> None:
        """Evaluation rows to eval.jsonl; TensorBoard tags <member>/eval/<benchmark>/<key>."""
        self._append(self.eval_path, rows, lambda row: f"{row['member']}/eval/{row['benchmark']}")

    def _append(self, path: Path, rows: list[dict], tag_prefix) -> None:
        with path.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
                if self.writer is None:
                    continue
                for key, value in row.items():
                    if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "n"):
                        self.writer.add_scalar(f"{tag_prefix(row)}/{key}", value, row["step"])
        if self.writer is not None:
            self.writer.flush()

    def truncate_after(self, step: int) -> None:
        """On resume, drop rows of steps after the checkpoint (they will be recomputed)."""
        for path in (self.path, self.eval_path):
            if path.exists():
                rows = [line for line in path.read_text().splitlines() if line and json.loads(line)["step"] <= step]
                path.write_text("".join(r + "\n" for r in rows))

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
