"""`corl preflight` (vlm_corl.commands.preflight.main) in one process of a launch, with a fault planted in the
update phase on rank 1 once rank 0 has entered a collective over both ranks (as a member's gradient all-reduce
would): `raise` makes rank 1 raise, `hang` makes it never return. tests/test_preflight.py launches it:
`python tests/preflight_fault.py raise|hang --config FILE [overrides]`."""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist

from vlm_corl.commands import preflight, preflight_checks

REAL = preflight_checks.update_phase


def planted(kind: str):
    def update_phase(run, *args):
        group = dist.new_group([0, 1])  # every rank makes it; only rank 0 enters its all-reduce
        store = dist.distributed_c10d._get_default_store()
        if dist.get_rank() == 0:
            store.set("test/rank0_in_collective", "1")
            dist.all_reduce(torch.ones(1), group=group)  # rank 1 never joins
        else:
            store.wait(["test/rank0_in_collective"])
            time.sleep(0.5)  # rank 0 is inside the all-reduce by now
            if kind == "raise":
                raise RuntimeError("planted fault on rank 1")
            time.sleep(3600)  # planted hang on rank 1
        return REAL(run, *args)

    return update_phase


if __name__ == "__main__":
    preflight_checks.update_phase = planted(sys.argv[1])
    sys.exit(preflight.main(sys.argv[2:]))
