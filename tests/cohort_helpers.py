"""Helpers shared by the end-to-end tests: small cohort configs, reading a run's outputs, running a command through
`python -m`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from vlm_corl.distributed.world import World
from vlm_corl.members.families import Family  # importing registers the vision families
from vlm_corl.registry import FAMILIES


def shipped_families(modality: str | None = None) -> tuple[str, ...]:
    """The families the package registers (vision, then text through entry points), read once when the tests are
    collected, before any test registers a stand-in family that cannot be built: a new family is tested without
    any test edit."""
    families: list[Family] = [FAMILIES.get(name) for name in _SHIPPED]
    return tuple(f.name for f in families if modality in (None, f.modality))


_SHIPPED = sorted(FAMILIES.names(), key=lambda name: (FAMILIES.get(name).modality != "vision", name))

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def bench_json(script: str, *args) -> dict:
    """The JSON a `bench/` script prints, run in the repository with `args` (one OpenMP thread); it must exit 0."""
    proc = subprocess.run(
        [sys.executable, script, *map(str, args)], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def tests_env(**extra: str) -> dict[str, str]:
    """A subprocess's environment: one torch thread, tests/ importable before what PYTHONPATH already holds (the GPU
    stack's lane puts its sitecustomize there), and `extra`."""
    path = os.pathsep.join(filter(None, [str(ROOT / "tests"), os.environ.get("PYTHONPATH")]))
    return {**ENV, "PYTHONPATH": path, **extra}


def python_m(module: str, *args, cwd: Path = ROOT, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python -m module args...` in the repository (one OpenMP thread), its output captured."""
    return subprocess.run(
        [sys.executable, "-m", module, *map(str, args)],
        cwd=cwd,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def cohort(tmp: Path, members: list[tuple[str, Path]], **sections) -> dict:
    """A cohort config dict: members + small, fast defaults; `sections` override whole sections."""
    cfg = {
        "output_dir": str(tmp / "run"),
        "members": [{"id": mid, "model": str(path)} for mid, path in members],
        "data": {"train": {"loader": "easyvqa", "limit": 64}, "batch_size": 4},
        "rollout": {"n": 4, "max_new_tokens": 8},
        "train": {"max_steps": 2, "lr": 1e-3, "save_every": 0, "warmup_ratio": 0.0},
        "logging": {"report_to": [], "progress": False},
    }
    cfg.update(sections)
    return cfg


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# Metrics fields that measure the machine and the placement (seconds, throughput, memory), not the training:
# left out where two runs' rows must be equal.
MEASURED = (
    "time_",
    "tokens_per_s",
    "prompt_cache_mb",
    "peak_gb_",
    "plan_gb",
    "peak_over_plan",
    *("rollout_tokens_per_s", "update_tokens_per_s", "update_mfu", "gpu_busy_"),  # vlm_corl.training.monitor.throughput
    "update_tokens",  # the positions the passes ran: padding and shared prompts follow the rows' split over ranks
)


def trained_fields(rows: list[dict]) -> list[dict]:
    """Metrics rows without their MEASURED fields."""
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED)} for r in rows]


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def easyvqa_cohort(tmp: Path, members: list[tuple[str, Path]], name: str, **train) -> Path:
    """The launch tests' cohort file `tmp/<name>.yaml`: easy-vqa (64 questions, batch 4), the ring reward, 2 steps
    unless `train` says otherwise, the run in `tmp/<name>/run`."""
    import yaml

    cfg = cohort(tmp / name, members, reward={"mode": "ring"})
    cfg["train"].update({"max_steps": 2, **train})
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


class Ranks:
    """What the ranks of one simulated launch share: a barrier (collectives meet there) and one slot per rank."""

    def __init__(self, size: int, timeout_s: float = 10.0):
        self.size, self.parts = size, [None] * size
        self.meet = threading.Barrier(size, timeout=timeout_s)  # a rank that never arrives: BrokenBarrierError


@dataclass
class ThreadWorld(World):
    """One rank of a launch simulated by threads of this process (`on_ranks`): `all_gather` and `barrier` are real
    collectives among the threads, so ranks that take different branches miss each other and fail (a broken
    barrier) instead of hanging, and a decision each rank makes from gathered facts can be compared across ranks."""

    ranks: Ranks | None = None

    def all_gather(self, obj: object) -> list:
        self.ranks.meet.wait()
        self.ranks.parts[self.rank] = obj
        self.ranks.meet.wait()
        parts = list(self.ranks.parts)
        self.ranks.meet.wait()  # nobody overwrites a part before every rank has read them all
        return parts

    def barrier(self) -> None:
        self.ranks.meet.wait()


def on_ranks(size: int, fn, timeout_s: float = 10.0) -> list:
    """fn(world) on `size` threads, each with its rank's `ThreadWorld`; the results in rank order. The first
    rank's exception is raised again here (the others' too, as its context, when every rank failed)."""
    ranks = Ranks(size, timeout_s)
    results, errors = [None] * size, [None] * size

    def run(rank: int) -> None:
        try:
            results[rank] = fn(ThreadWorld(rank=rank, size=size, ranks=ranks))
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            errors[rank] = err
            ranks.meet.abort()  # the other ranks stop waiting for this one

    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [e for e in errors if e is not None]
    if failed:
        first = next((e for e in failed if not isinstance(e, threading.BrokenBarrierError)), failed[0])
        raise first
    return results


def greedy_decode_logits(member, prompts: list, ready_mask: bool, steps: int = 4) -> torch.Tensor:
    """(steps, R, V) logits of greedy decoding from the shared prefill of rendered `prompts`, each decoding step
    given its attention mask ready-made (4-D booleans) or as the 2-D padding mask transformers builds from."""
    from vlm_corl.members.batching import continuation, prefill

    policy = member.policy()
    with torch.no_grad():
        prefix = prefill(member.model.eval(), [p.inputs for p in prompts], policy.pad_id, policy.mrope)
        prefix.decode_mask = ready_mask
        logits, out = prefix.last_logits, []
        for t in range(steps):
            out.append(logits)
            step = continuation(prefix, logits.argmax(-1)[:, None], torch.ones(len(logits), t + 1, dtype=torch.long))
            logits = member.model(**step).logits[:, -1]
    return torch.stack(out)


def assert_ready_decode_mask_changes_nothing(member, prompts: list) -> None:
    """Where a model takes its decoding mask ready-made (`ready_decode_mask`), a padded batch decodes as with
    the mask transformers builds: the same greedy tokens, logits equal to float rounding."""
    lengths = {p.inputs["input_ids"].shape[1] for p in prompts}
    assert len(lengths) > 1, "the prompts must differ in length, so the batch is padded"
    ready, built = (greedy_decode_logits(member, prompts, flag) for flag in (True, False))
    assert torch.equal(ready.argmax(-1), built.argmax(-1))
    assert torch.allclose(ready, built, rtol=0, atol=1e-5), (ready - built).abs().max()
