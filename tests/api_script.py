"""A script on the Python API (issue 35's acceptance): two zoo members, a `datasets.Dataset` of 16 easy-vqa train
rows with a renamed question column, one reward function and a callback; 2 steps.

    python tests/api_script.py ZOO OUT                           # one process
    torchrun --nproc_per_node 2 tests/api_script.py ZOO OUT      # the same rows, one member per process

ZOO holds qwen2_vl/ and mllama/ (`python -m vlm_corl.zoo`). Writes OUT/run (the run), OUT/calls-<rank>.json (the
reward function's calls on that rank: step, member, completions, peers, the extra column) and, on rank 0,
OUT/steps.json (the steps the callback saw).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import datasets
import easy_vqa

from vlm_corl import CohortTrainer


def dataset(rows: int = 16) -> datasets.Dataset:
    questions, answers, image_ids = easy_vqa.get_train_questions()
    paths = easy_vqa.get_train_image_paths()
    return datasets.Dataset.from_dict(
        {
            "query": questions[:rows],
            "answer": answers[:rows],
            "image": [paths[i] for i in image_ids[:rows]],
            "topic": ["shapes"] * rows,
        }
    ).cast_column("image", datasets.Image())


def main(zoo: Path, out: Path) -> dict:
    rank = int(os.environ.get("RANK", "0"))
    calls, steps = [], []

    def brevity(*, member, prompts, completions, answers, peer_answers, topic, **_):
        """-len/10, abstaining on every fifth completion."""
        calls.append(
            {"member": member, "n": len(completions), "peers": sorted(peer_answers), "topic": sorted(set(topic))}
        )
        return [None if i % 5 == 0 else -len(text) / 10 for i, text in enumerate(completions)]

    class Steps:
        def on_step_end(self, step, metrics):
            steps.append(step)

    config = {
        "output_dir": str(out / "run"),
        "members": [{"id": "q", "model": str(zoo / "qwen2_vl")}, {"id": "l", "model": str(zoo / "mllama")}],
        "data": {"batch_size": 4},
        "rollout": {"n": 2, "max_new_tokens": 8},
        "reward": {"mode": "none"},
        "train": {"max_steps": 2, "lr": 1e-3, "save_every": 0, "warmup_ratio": 0.0},
        "logging": {"report_to": [], "progress": False},
    }
    summary = CohortTrainer(
        config, train_dataset=dataset(), columns={"question": "query"}, reward_funcs=[brevity], callbacks=[Steps()]
    ).train()
    (out / f"calls-{rank}.json").write_text(json.dumps(calls))
    if rank == 0:
        (out / "steps.json").write_text(json.dumps(steps))
    return summary


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
