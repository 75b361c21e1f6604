"""`train.micro_batch_size: auto` resolved for a launch: the micro-batch an update runs, sized from the memory plan.

On CUDA, auto is the largest micro-batch whose planned peak fits every rank's memory (`cohort.micro_batch_for`,
the same plan `train.check_memory` checks): fewer, fuller forward/backward passes, so the update runs nearer the
card's speed. Elsewhere (a CPU: its memory is the host's RAM, and a larger micro-batch does not run faster
there) auto is `cohort.CPU_MICRO_BATCH`, 8, the default before auto existed.
"""

from __future__ import annotations

import logging

from vlm_corl.config.schema import CohortConfig
from vlm_corl.members.memory import GB
from vlm_corl.planning.cohort import MICRO_BATCH, Hardware, micro_batch_for, with_changes

log = logging.getLogger("vlm_corl")


def with_micro_batch(cfg: CohortConfig, hardware: Hardware, log_it: bool = False) -> CohortConfig:
    """`cfg` with `train.micro_batch_size: auto` replaced by its value on `hardware` (a number is kept); `log_it`:
    log the choice and why."""
    if cfg.train.micro_batch_size != "auto":
        return cfg
    size, plan = micro_batch_for(cfg, hardware)
    if log_it:
        if plan is None:
            how = "the default where no CUDA plan sizes it"
        else:
            how = f"the largest whose planned peak, {max(r.peak for r in plan.ranks) / GB:.1f} GB, fits"
        log.info("train.micro_batch_size auto: %d (%s)", size, how)
    return with_changes(cfg, {MICRO_BATCH: size})
