"""The step's phase timer: wall-clock seconds per named phase and, on CUDA, each phase's peak memory; the phase
is reported to the other ranks, so a failure can say where each rank stopped."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from vlm_corl.distributed.world import World


class PhaseTimer:
    """Wall-clock seconds per named phase of the current step, and on CUDA the peak memory each phase allocated
    (`torch.cuda.max_memory_allocated`, GB); the phase is also reported to the other ranks (`World.report`), so a
    failure can say where each rank stopped."""

    def __init__(self, world: World | None = None, step: int = 0):
        self.world = world
        self.cuda = world is not None and world.device.type == "cuda"
        self.start_step(step)

    def start_step(self, step: int) -> None:
        """Reset the times for step `step` (0-based)."""
        self.seconds: dict[str, float] = {}
        self.peaks: dict[str, float] = {}
        self.step, self.phase = step, "start"

    @contextmanager
    def __call__(self, name: str):
        self.phase = name
        if self.world is not None:
            self.world.report(self.step + 1, name)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.world.device)
        start = time.perf_counter()
        yield
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        if self.cuda:
            peak = torch.cuda.max_memory_allocated(self.world.device) / 1e9
            self.peaks[name] = max(self.peaks.get(name, 0.0), peak)
