"""`python -m vlm_corl.train` with a fault injected: member FAULT_MEMBER's loss is NaN on rank FAULT_RANK (every
rank when unset), from step FAULT_FROM_STEP on. Used by tests/test_numerics.py under torchrun (and in one
process) to check that a member's ranks agree to skip the step and that the run stops naming the member."""

from __future__ import annotations

import os
import sys

import vlm_corl.members.update as update
from vlm_corl.commands import train

_original = update._micro_batch_loss
_calls = {"n": 0}


def _faulty(member, mb, old_logp, algo, policy, norm):
    loss, *rest = _original(member, mb, old_logp, algo, policy, norm)
    rank = os.environ.get("FAULT_RANK")
    if member.id == os.environ["FAULT_MEMBER"] and (rank is None or rank == os.environ.get("RANK", "0")):
        loss = loss * float("nan")
    return loss, *rest


update._micro_batch_loss = _faulty

if __name__ == "__main__":
    train.exit_process(train.main(sys.argv[1:]))
