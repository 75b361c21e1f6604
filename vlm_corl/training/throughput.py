"""The speed numbers a user sees in metrics.jsonl: tokens per second of the rollout and the update, the update's
MFU, and the GPU's busy share per phase.

- `rollout_tokens_per_s` (per row): the slot's response tokens over its own rollout seconds (`tokens_per_s`, kept
  under its old name too).
- `update_tokens_per_s` (per row): the member's prompt and response tokens through the forward and backward
  passes (`update_tokens`, all its ranks) over the update phase's seconds. Members hosted together update in
  turn, so the rows of a step add up to the phase's throughput.
- `update_mfu` (CUDA only, the same on every row of a step): model FLOPs of every member's update (`model_flops`:
  6 × parameters × tokens, 4 × for a LoRA member) over the update phase's seconds and the bf16 dense peak of
  the launch's devices (`PEAK_BF16_FLOPS` by device name, named in the run log at start; an unknown card gets
  no MFU). Gradient checkpointing's recomputation is not counted, as MFU conventionally does not.
- `gpu_busy_<phase>` (CUDA with nvidia-smi): the share of the phase's time a kernel ran on this process's GPU
  (nvidia-smi's utilization, sampled every 0.2 s and attributed to the phase running when the sample came).
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vlm_corl.config.schema import CohortConfig
    from vlm_corl.distributed.world import World
    from vlm_corl.training.slots import SlotSpec

log = logging.getLogger("vlm_corl")

# bf16 dense tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name (first match wins: the longer
# names first). The vendors' data sheets, without sparsity.
PEAK_BF16_FLOPS = (
    ("GB200", 2.5e15),
    ("B200", 2.25e15),
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100", 989e12),
    ("H800", 989e12),
    ("A100", 312e12),
    ("A800", 312e12),
    ("L40S", 362e12),
    ("A10G", 70e12),
    ("L4", 121e12),
)


def peak_bf16_flops(device_name: str) -> tuple[str, float] | None:
    """(the table's name, bf16 dense FLOP/s) of the card `device_name` names, or None for one not in the table."""
    for name, flops in PEAK_BF16_FLOPS:
        if name in device_name:
            return name, flops
    return None


def model_flops(parameters: float, tokens: float, lora: bool = False) -> float:
    """The model FLOPs of training on `tokens` tokens: 6 × parameters per token (2 forward, 4 backward), 4 × for
    a LoRA member (its frozen base gets no weight gradients). bench/gpu_check.py reads its MFU from this too."""
    return (4 if lora else 6) * parameters * tokens


class BusySampler:
    """This process's GPU's busy share per phase: nvidia-smi's utilization every `interval_ms` (a streaming
    query, one process), each sample attributed to `phase()` when it arrives. `take()` returns the means since
    the last take and starts again."""

    def __init__(self, gpu: str, phase: Callable[[], str], interval_ms: int = 200):
        self.phase, self.samples, self.lock = phase, {}, threading.Lock()
        query = [
            "nvidia-smi",
            f"--id={gpu}",
            "--query-gpu=utilization.gpu",
            "--format=csv,noheader,nounits",
            f"-lms={interval_ms}",
        ]
        self.proc = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True).start()

    def _read(self, lines: Iterable[str]) -> None:
        for line in lines:
            try:
                self.add(self.phase(), float(line.split()[0]) / 100)
            except (ValueError, IndexError):
                continue

    def add(self, phase: str, busy: float) -> None:
        with self.lock:
            self.samples.setdefault(phase, []).append(busy)

    def take(self) -> dict[str, float]:
        """{phase: mean busy share} since the last call."""
        with self.lock:
            samples, self.samples = self.samples, {}
        return {phase: round(sum(v) / len(v), 3) for phase, v in samples.items() if v}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


class Throughput:
    """A run's speed fields (module docstring): `fields(rows)` adds them to a step's metrics rows (which hold
    the step's `time_<phase>` seconds)."""

    def __init__(
        self,
        parameters: dict[str, tuple[float, bool]],
        peak: float | None,
        devices: int = 1,
        busy: BusySampler | None = None,
    ):
        self.parameters, self.peak, self.devices, self.busy = parameters, peak, devices, busy

    def fields(self, rows: list[dict]) -> list[dict]:
        """`rows` (one step's) with the speed fields added."""
        busy = self.busy.take() if self.busy is not None else {}
        seconds = next((r.get("time_update") for r in rows if r.get("time_update")), None)
        mfu = None
        if self.peak and seconds:
            trained = [r for r in rows if r.get("update_tokens") and r["member"] in self.parameters]
            flops = sum(
                model_flops(self.parameters[r["member"]][0], r["update_tokens"], self.parameters[r["member"]][1])
                for r in trained
            )
            mfu = flops / seconds / (self.peak * self.devices)
        out = []
        for row in rows:
            extra = {"rollout_tokens_per_s": row.get("tokens_per_s")}
            if row.get("update_tokens") and seconds:
                extra["update_tokens_per_s"] = row["update_tokens"] / seconds
            if mfu is not None:
                extra["update_mfu"] = round(mfu, 5)
            extra.update({f"gpu_busy_{phase}": share for phase, share in busy.items()})
            out.append({**row, **extra})
        return out

    def close(self) -> None:
        if self.busy is not None:
            self.busy.stop()
            self.busy = None


def start_throughput(
    world: World, cfg: CohortConfig, specs: Sequence[SlotSpec], phase: Callable[[], str]
) -> Throughput:
    """The run's `Throughput`: on CUDA its devices' bf16 peak (named in the run log by rank 0), its trained
    members' parameter counts (the planner's count from config.json, every rank the same) and, on rank 0 with
    nvidia-smi, the busy sampler of its GPU (`phase`: the phase running now); elsewhere tokens per second only."""
    if world.device.type != "cuda":
        return Throughput({}, None)
    import torch

    from vlm_corl.planning.shapes import cohort_shapes

    name = torch.cuda.get_device_name(world.device)
    found = peak_bf16_flops(name)
    if world.is_main:
        if found is None:
            log.warning("update_mfu: %s is not in the table of bf16 peaks (training/throughput.py): no MFU", name)
        else:
            peak = found[1] / 1e12
            log.info("update_mfu: against %s's bf16 dense peak, %.0f TFLOP/s per device (%s)", name, peak, found[0])
    members = {m.id: m for m in cfg.members if m.trainable}
    shapes = cohort_shapes(members.values())  # each trained member's model read once
    counts = {mid: (float(shapes[mid].params), m.lora is not None) for mid, m in members.items()}
    # by the row's slot: a member's update stats are on its trained slot's row
    parameters = {s.id: counts[s.member_id] for s in specs if s.member_id in members and not s.teacher}
    busy = None
    if world.is_main and shutil.which("nvidia-smi"):
        uuid = getattr(torch.cuda.get_device_properties(world.device), "uuid", None)  # the card, whatever is visible
        busy = BusySampler(f"GPU-{uuid}" if uuid is not None else str(world.device.index or 0), phase)
    return Throughput(parameters, None if found is None else found[1], world.size, busy)
