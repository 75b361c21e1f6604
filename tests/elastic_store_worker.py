"""Run by tests/test_multinode.py under `torchrun --max-restarts 1`: every rank joins through `launch_world`,
prints whether the launch's store still holds a key of an earlier attempt, marks its own, and in the first attempt
rank 1 fails (exit 3) so that torchrun restarts the group."""

import os
import sys

from vlm_corl.distributed.world import launch_world

world = launch_world(60)
store, attempt = world.kv_store(), os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"attempt {attempt} rank {world.rank} stale {store.check([f'mark/{world.rank}'])}", file=sys.stderr)
store.set(f"mark/{world.rank}", attempt)
world.barrier()
if attempt == "0" and world.rank == 1:
    os._exit(3)
world.barrier()
