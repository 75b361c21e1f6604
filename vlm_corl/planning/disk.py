"""The disk a run's checkpoints take (`vlm_corl.training.run.checkpoint`): every model of the cohort is saved at
every checkpoint, and the newest is written before the oldest is pruned, so train.keep_last + 1 exist at once.

One checkpoint, per member (P parameters, A adapter parameters of a LoRA member):
- a trained member: its weights in the dtype it was loaded in (members[i].dtype; auto = its checkpoint's,
  `Member.save_weights`) and its optimizer state: under DeepSpeed each rank's partition of the fp32 master copy and
  Adam's two moments, 12 bytes per parameter over the member's ranks; without it the two moments (8P) and, when
  the weights are saved below fp32, the fp32 masters (4P) (`Member.save`);
- a LoRA member: its adapter in fp32 (4A) and the same optimizer state for A alone (8A; 12A under DeepSpeed);
- a frozen peer: its weights as it holds them (its loaded dtype, or the rollout dtype it was cast to);
- an EMA teacher (co_rewarding_2, peers_ema: one per member): its fp32 weights (4P).
`eval.keep_best` adds each trained member's weights in RUN/best/, twice while a new best replaces the old.
Tokenizer, processor and config files are what the model directory holds beside its weights (measured there,
`small_files_bytes`; `SMALL_FILES_BYTES` for a directory without weights yet: planned before download); the
cohort state (sampler, RNG states) is small.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from vlm_corl.config.schema import CohortConfig, MemberConfig, has_teachers
from vlm_corl.members.memory import GB
from vlm_corl.planning.engines import TEACHER
from vlm_corl.planning.layout import adapters, loaded_bytes
from vlm_corl.planning.shapes import ModelShape, Shapes, cohort_shapes

SMALL_FILES_BYTES = 50e6  # per model directory: tokenizer.json (~10 MB for a 150k vocabulary), processor, config
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
ADAM_BYTES = 8  # two fp32 moments per trained parameter
MASTER_BYTES = 4  # an fp32 master copy


@dataclass
class DiskPlan:
    """The checkpoints' disk: one checkpoint by member and part, the copies on disk at once, RUN/best/."""

    members: dict[str, dict[str, float]]
    copies: int  # train.keep_last + 1 (fewer when the run writes fewer checkpoints)
    keep_last: int
    best: float = 0.0

    @property
    def one(self) -> float:
        return sum(sum(parts.values()) for parts in self.members.values())

    @property
    def total(self) -> float:
        return self.one * self.copies + self.best

    def to_dict(self) -> dict:
        return {
            "checkpoint_disk_gb": round(self.total / GB, 3),
            "checkpoint_disk": {
                "one_checkpoint_gb": round(self.one / GB, 3),
                "copies": self.copies,
                "keep_last": self.keep_last,
                "best_gb": round(self.best / GB, 3),
                "members_gb": {m: {k: round(v / GB, 3) for k, v in p.items()} for m, p in self.members.items()},
            },
        }

    def copies_text(self) -> str:
        """Why `copies` checkpoints are on disk at once."""
        if self.copies == self.keep_last + 1:
            return f"train.keep_last {self.keep_last} + the one being written"
        return f"all the run writes, fewer than train.keep_last {self.keep_last} + 1"

    def line(self) -> str:
        """The plan's text line."""
        best = f" + {self.best / GB:.1f} GB of best weights (eval.keep_best)" if self.best else ""
        return (
            f"checkpoint disk: {self.total / GB:.1f} GB in output_dir ({self.one / GB:.1f} GB per checkpoint x "
            f"{self.copies}: {self.copies_text()}{best})"
        )


def checkpoints_written(cfg: CohortConfig) -> int:
    """How many checkpoints a run writes: every train.save_every steps and at the last step (train.save_last)."""
    t = cfg.train
    every = t.max_steps // t.save_every if t.save_every else 0
    return every + (1 if t.save_last and not (t.save_every and t.max_steps % t.save_every == 0) else 0)


def member_checkpoint(cfg: CohortConfig, m: MemberConfig, shape: ModelShape) -> dict[str, float]:
    """Bytes of member `m`'s (of `shape`) files in one checkpoint, by part (see the module docstring)."""
    p = float(shape.params)
    loaded = loaded_bytes(m, shape)
    masters = MASTER_BYTES if cfg.train.deepspeed else 0  # DeepSpeed saves its fp32 partitions
    if not m.trainable:  # saved in its loaded dtype (a peer cast to bf16 for rollouts is written back wider)
        parts = {"weights": loaded * p}
    elif m.lora is not None:
        a = float(adapters(m))
        parts = {"adapter": MASTER_BYTES * a, "optimizer": (ADAM_BYTES + masters) * a}
    else:
        masters = MASTER_BYTES if loaded < MASTER_BYTES else masters  # plain DP keeps them when the weights round
        parts = {"weights": loaded * p, "optimizer": (ADAM_BYTES + masters) * p}
    parts["small_files"] = small_files_bytes(str(m.model))
    return parts


def small_files_bytes(model: str) -> float:
    """Bytes of what a checkpoint writes beside a model's weights (tokenizer, processor, configs): those files of
    its model directory plus 1 MB of slack, where the directory holds weights (a downloaded or built model);
    `SMALL_FILES_BYTES`, a bound, where it holds none yet (a config planned before download)."""
    folder = Path(model)
    files = [f for f in folder.rglob("*") if f.is_file()] if folder.is_dir() else []
    if not any(f.name.endswith(WEIGHT_SUFFIXES) for f in files):
        return SMALL_FILES_BYTES
    return float(sum(f.stat().st_size for f in files if not f.name.endswith(WEIGHT_SUFFIXES)) + 1_000_000)


def checkpoint_disk(cfg: CohortConfig, shapes: Shapes | None = None) -> DiskPlan:
    """The checkpoints' disk of `cfg`; `shapes`: the plan's (None: read here, for a disk check without a plan)."""
    shapes = cohort_shapes(cfg.members) if shapes is None else shapes
    members = {}
    for m in cfg.members:
        members[m.id] = member_checkpoint(cfg, m, shapes[m.id])
        if has_teachers(cfg):
            members[m.id + TEACHER] = {
                "weights": MASTER_BYTES * float(shapes[m.id].params),
                "small_files": small_files_bytes(str(m.model)),
            }
    best = 0.0
    if cfg.eval.keep_best:
        saved = [members[m.id].get("weights", members[m.id].get("adapter", 0.0)) for m in cfg.members if m.trainable]
        best = 2 * sum(saved)
    copies = min(cfg.train.keep_last + 1, checkpoints_written(cfg))
    return DiskPlan(members, copies, cfg.train.keep_last, best)
