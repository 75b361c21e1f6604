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
  no MFU). Gradient checkpointing's recomputation is not counted, as MFU conventionally does not. A VLM's
  vision tower is priced like the rest, per text token (its parameters are in N): the update's statistics carry
  no patch counts (`members/update.py`'s `update_tokens` counts text positions), so a tower's real cost, its
  parameters x the images' patches, is not known here; for easy-vqa's small pictures the two are close, for
  large pictures the MFU undercounts the tower.
- `gpu_busy_<phase>` (CUDA with nvidia-smi): the share of the phase's time a kernel ran on world rank 0's GPU
  (nvidia-smi's utilization, sampled every 0.2 s and attributed to the phase running when the sample came), on
  the rows of the slots rank 0 hosts only: a member on other ranks ran on GPUs nobody sampled, so its rows get
  none (one sampler for the launch, not one per rank: rank 0 writes the rows).
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
    from vlm_corl.training.run.slots import SlotSpec

log = logging.getLogger("vlm_corl")

# bf16 dense tensor-core peak, FLOP/s, by a substring of torch.cuda.get_device_name: the longest name the device's
# contains wins, whatever the order here ("NVIDIA H100 PCIe" is the PCIe part, not the SXM one; "NVIDIA GB200" is
# not a B200). NVIDIA's data sheets, which print the sparse figure: half of it, per GPU.
PEAK_BF16_FLOPS = (
    ("H100", 989e12),  # H100 SXM5 ("NVIDIA H100 80GB HBM3"): 1,979 TF sparse (H100 data sheet)
    ("H100 PCIe", 756e12),  # H100 PCIe: 1,513 TF sparse (same data sheet)
    ("H100 NVL", 835e12),  # H100 NVL: 1,671 TF sparse per GPU (data sheet of 2024; the pair's 3,958 before)
    ("H800", 989e12),  # H800 SXM5: as H100 SXM5 (H800 data sheet)
    ("H800 PCIe", 756e12),  # H800 PCIe: as H100 PCIe
    ("GH200", 989e12),  # GH200's Hopper: 1,979 TF sparse (GH200 data sheet)
    ("H200", 989e12),  # H200 SXM: 1,979 TF sparse (H200 data sheet)
    ("H200 NVL", 835e12),  # H200 NVL: 1,671 TF sparse (same data sheet)
    ("B200", 2.25e15),  # HGX B200: 36 PF sparse for 8 GPUs (HGX data sheet), 4.5 PF sparse per GPU
    ("GB200", 2.5e15),  # GB200 NVL72: 360 PF sparse for 72 GPUs (GB200 NVL72 data sheet), 5 PF sparse per GPU
    ("A100", 312e12),  # A100 SXM4 and PCIe: 624 TF sparse (A100 data sheet)
    ("A800", 312e12),  # A800: as A100
    ("L40S", 362e12),  # L40S: 733 TF sparse (L40S data sheet)
    ("A10G", 70e12),  # AWS's A10G: AWS's figure (not an NVIDIA data sheet)
    ("L4", 121e12),  # L4: 242 TF sparse (L4 data sheet)
)


def peak_bf16_flops(device_name: str) -> tuple[str, float] | None:
    """(the table's name, bf16 dense FLOP/s) of the card `device_name` names, or None for one not in the table:
    the most specific entry, the longest name `device_name` contains ("H100 NVL" before "H100")."""
    found = [(name, flops) for name, flops in PEAK_BF16_FLOPS if name in device_name]
    return max(found, key=lambda entry: len(entry[0]), default=None)


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

    def stop(self, timeout_s: float = 2.0) -> None:
        """End the nvidia-smi query: terminated, killed if it has not exited within `timeout_s`, and left behind
        (with a warning) if even that does not end it within `timeout_s` (one stuck in the driver after an Xid
        must not hang the run's exit, which calls this from its `finally`)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
            return
        except subprocess.TimeoutExpired:
            self.proc.kill()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("gpu_busy: nvidia-smi (pid %d) did not exit when killed; left behind", self.proc.pid)


class Throughput:
    """A run's speed fields (module docstring): `fields(rows)` adds them to a step's metrics rows (which hold
    the step's `time_<phase>` seconds)."""

    def __init__(
        self,
        parameters: dict[str, tuple[float, bool]],
        peak: float | None,
        devices: int = 1,
        busy: BusySampler | None = None,
        sampled: frozenset[str] | None = None,
    ):
        """`sampled`: the slots whose rows get `busy`'s shares (those hosted on the sampled GPU); None: all."""
        self.parameters, self.peak, self.devices, self.busy = parameters, peak, devices, busy
        self.sampled = sampled

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
            if self.sampled is None or row["member"] in self.sampled:
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
    nvidia-smi, the busy sampler of its GPU (`phase`: the phase running now), whose shares go on the rows of the
    slots rank 0 hosts (`hosted_slots`); elsewhere tokens per second only."""
    if world.device.type != "cuda":
        return Throughput({}, None)
    import torch

    from vlm_corl.distributed.world import place_members
    from vlm_corl.planning.shapes import cohort_shapes

    name = torch.cuda.get_device_name(world.device)
    found = peak_bf16_flops(name)
    if world.is_main:
        if found is None:
            log.warning(
                "update_mfu: %s is not in the table of bf16 peaks (training/monitor/throughput.py): no MFU", name
            )
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
    sampled = hosted_slots(place_members(cfg.members, world.size), specs, world.rank)
    return Throughput(parameters, None if found is None else found[1], world.size, busy, sampled)


def hosted_slots(placement: dict[str, tuple[int, ...]], specs: Sequence[SlotSpec], rank: int) -> frozenset[str]:
    """The ids of the slots whose member `placement` puts on `rank` (a teacher's slot goes with its student)."""
    return frozenset(s.id for s in specs if rank in placement[s.member_id])
