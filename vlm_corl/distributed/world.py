"""Scale-out: the launch environment, members placed on groups of ranks, and the collectives the loop uses.

One job runs the whole cohort. `accelerate launch` or `torchrun` starts W processes; each reads its rank from
the launch environment (RANK, WORLD_SIZE, LOCAL_RANK), uses `cuda:LOCAL_RANK` when CUDA is there (CPU and gloo
otherwise, or with ACCELERATE_USE_CPU=true), and joins one process group. Every member owns a group of ranks
(`members[i].ranks`, or an even automatic split): a process loads only the members placed on it, and a member
with several ranks is data-parallel over them (each rank rolls out and trains on its shard of the batch,
gradients are summed over the member's group only). Members sharing one rank list are hosted in turn by the
same processes (e.g. a frozen peer beside a member, or the whole cohort when W=1).

Answers cross between members in the exchange phase through `all_gather_object` over the world group, keyed
by batch position (`vlm_corl.distributed.exchange`); every rank then computes the same rewards.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from vlm_corl.errors import UserError

if TYPE_CHECKING:
    from vlm_corl.config.schema import MemberConfig

log = logging.getLogger("vlm_corl")


class PlacementError(UserError, ValueError):
    """Members cannot be placed on the launched ranks as configured (a user error: names the fix)."""


class CollectiveError(RuntimeError):
    """A collective with other ranks failed: a rank died, hung past train.dist_timeout_s, or the network broke."""


@contextmanager
def collective(what: str) -> Iterator[None]:
    """Turn a backend's failure inside a collective (gloo/NCCL errors, timeouts) into a CollectiveError."""
    try:
        yield
    except (dist.DistError, RuntimeError) as err:
        raise CollectiveError(f"{what} failed: {str(err).splitlines()[0][:300]}") from err


@dataclass
class World:
    """This process's place in the launch: rank, world size, device, and the member groups built on it."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    timeout_s: float = 1800.0
    groups: dict = field(default_factory=dict)  # rank tuple -> process group (groups of 2+ ranks; all with DeepSpeed)
    singles: dict = field(default_factory=dict)  # rank -> its own one-rank group (DeepSpeed only)

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def is_main(self) -> bool:
        """World rank 0: the only process that writes the run directory's files."""
        return self.rank == 0

    def group(self, ranks: tuple[int, ...]) -> dist.ProcessGroup | None:
        """The process group of a member's ranks (None for a one-rank group without DeepSpeed: nothing to reduce)."""
        return self.groups.get(tuple(ranks))

    def barrier(self) -> None:
        if self.distributed:
            with collective("barrier"):
                dist.barrier()

    def all_gather(self, obj: object) -> list:
        """Every rank's `obj`, in rank order (just [obj] in one process)."""
        if not self.distributed:
            return [obj]
        parts = [None] * self.size
        with collective("all_gather_object"):
            dist.all_gather_object(parts, obj)
        return parts

    def kv_store(self):
        """The launch's key-value store, which outlives a failed collective (None in one process, or where torch
        does not expose it)."""
        return _store() if self.distributed else None

    def report(self, step: int, phase: str) -> None:
        """Record where this rank is (step, phase) in the launch's key-value store, so that after a failed
        collective the surviving ranks can tell which rank stopped where."""
        store = _store() if self.distributed else None
        if store is None:
            return
        if not store_answers():  # asked first: a call on a store whose server is gone prints pages of C++ frames
            raise CollectiveError("the launch's store no longer answers (its node or its launcher is lost)")
        with collective("the launch's store"):
            store.set(f"vlm_corl/progress/{self.rank}", f"{step} {phase}")

    def progress(self) -> dict[int, str]:
        """Every rank's last reported 'step phase' (those the store still answers for)."""
        store, found = _store() if self.distributed else None, {}
        if store is None:
            return found
        for r in range(self.size):
            try:
                if store.check([f"vlm_corl/progress/{r}"]):
                    found[r] = store.get(f"vlm_corl/progress/{r}").decode()
            except (dist.DistError, RuntimeError):
                break
        return found


def _store():
    """The default group's store (torchrun's agent or rank 0 serves it; it outlives a dead worker). Private
    torch API (`_get_default_store`, torch 2.x): without it, failures are reported without progress."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def default_device() -> torch.device:
    """This process's device: `cuda:LOCAL_RANK` where CUDA is (TF32 turned on for it), the CPU without CUDA or
    with ACCELERATE_USE_CPU=true. Every command loads its models here unless told otherwise."""
    if not torch.cuda.is_available() or _env_flag("ACCELERATE_USE_CPU"):
        return torch.device("cpu")
    enable_tf32()
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))


def enable_tf32() -> None:
    """TF32 tensor cores for the fp32 matmuls and convolutions that remain (the update's fp32 parts, a member
    trained without mixed precision): PyTorch leaves them off by default, ~8x slower on an H100."""
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True


def launch_world(timeout_s: float = 1800.0, need_group: bool = False) -> World:
    """Read the launch environment, pick the device and join the process group (once per process).

    torchrun and `accelerate launch` (multi-process configs) both set RANK, WORLD_SIZE and LOCAL_RANK; a
    plain `python -m` run is rank 0 of 1 (with `need_group`, DeepSpeed's case, it still gets a one-process
    group). NCCL on CUDA, gloo on CPU; collectives fail after `timeout_s`.
    """
    rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = default_device()
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.set_device(device)
    if size == 1 and need_group and "MASTER_PORT" not in os.environ:
        # what a launcher would set (DeepSpeed reads LOCAL_RANK from the environment)
        os.environ.update(
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
        )
    if (size > 1 or need_group) and not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            timeout=timedelta(seconds=timeout_s),
            rank=rank,
            world_size=size,
            store=attempt_store(rank, size, timedelta(seconds=timeout_s)),
            # NCCL otherwise guesses each rank's GPU from its global rank ("This can cause a hang")
            device_id=device if cuda else None,
        )
    return World(rank, size, local_rank, device, timeout_s)


def attempt_store(rank: int, size: int, timeout: timedelta) -> dist.Store | None:
    """The launch's key-value store seen through a prefix of this launch attempt (torchrun's
    TORCHELASTIC_RESTART_COUNT), or None outside an elastic launch (init_process_group's own env:// store).

    Why: torch's c10d rendezvous keeps ONE store server for the whole job (TCPStore sharing, the default) and its
    env:// handler connects the workers to it without a per-attempt prefix, so a group restarted by
    `--max-restarts` found the failed group's keys: gloo connected to the dead ranks' addresses ("connectFullMesh
    ... Connection refused") or waited on stale counters, and the surviving ranks' marks fooled a later lost-rank
    report. Under the prefix every attempt starts from an empty store."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None or "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        return None
    # the agent serves the store (TORCHELASTIC_USE_AGENT_STORE); otherwise rank 0 hosts it, as env:// would
    host = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    server = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=host, timeout=timeout,
        multi_tenant=True,
    )  # fmt: skip
    return dist.PrefixStore(f"vlm_corl/attempt_{attempt}", server)


def place_members(members: Sequence[MemberConfig], world_size: int) -> dict[str, tuple[int, ...]]:
    """{member id: its ranks}: `members[i].ranks` where given, else an even split of the W ranks.

    Automatic split: W = 1 hosts every member on rank 0; W a multiple of N gives each member W/N consecutive
    ranks; N a multiple of W puts N/W consecutive members on each rank. Two members' rank lists are either
    identical (hosted in turn) or disjoint, and every rank hosts a member. Raises PlacementError otherwise.
    """
    n = len(members)
    ids = ", ".join(m.id for m in members)
    given = [m.ranks for m in members if m.ranks is not None]
    if given and len(given) != n:
        raise PlacementError(
            "members[*].ranks is set for some members but not all: give every member its "
            "ranks, or none (an even automatic split)"
        )
    if given:
        placement = {m.id: tuple(sorted(set(m.ranks))) for m in members}
    elif world_size == 1:
        placement = {m.id: (0,) for m in members}
    elif world_size % n == 0:
        per = world_size // n
        placement = {m.id: tuple(range(i * per, (i + 1) * per)) for i, m in enumerate(members)}
    elif n % world_size == 0:
        per = n // world_size
        placement = {m.id: (i // per,) for i, m in enumerate(members)}
    else:
        raise PlacementError(
            f"{n} members ({ids}) cannot be split evenly over {world_size} processes: launch a multiple or a "
            f"divisor of {n} processes, or give each member its ranks (members[i].ranks: [0, 1])"
        )
    _check_placement(placement, world_size)
    return placement


def _check_placement(placement: dict[str, tuple[int, ...]], world_size: int) -> None:
    for mid, ranks in placement.items():
        outside = [r for r in ranks if not 0 <= r < world_size]
        if not ranks or outside:
            raise PlacementError(
                f"member {mid!r} is placed on ranks {list(ranks)} but the launch has {world_size} process(es) "
                f"(ranks 0..{world_size - 1}): fix members[*].ranks or launch more processes"
            )
    lists = sorted(set(placement.values()))
    for i, a in enumerate(lists):
        for b in lists[i + 1 :]:
            if set(a) & set(b):
                owners = [mid for mid, r in placement.items() if r in (a, b)]
                raise PlacementError(
                    f"members {owners} have overlapping but different ranks ({list(a)} vs {list(b)}): a rank "
                    "list is either shared whole (members hosted in turn) or disjoint"
                )
    idle = sorted(set(range(world_size)) - {r for ranks in lists for r in ranks})
    if idle:
        raise PlacementError(
            f"ranks {idle} host no member ({len(placement)} members on {world_size} processes): launch fewer "
            "processes or place members on them (members[i].ranks)"
        )


def build_groups(world: World, placement: dict[str, tuple[int, ...]], every: bool = False) -> None:
    """Create one process group per distinct multi-rank member group, on every rank in the same order
    (torch.distributed requires every rank to take part in creating every group). With `every` (DeepSpeed,
    which wants a group even for one rank), one-rank member groups too, and every rank's own group in
    `world.singles` (DeepSpeed's model-parallel group of size 1)."""
    if not dist.is_initialized():
        return
    timeout = timedelta(seconds=world.timeout_s)
    for ranks in sorted(set(placement.values())):
        if len(ranks) > 1 or every:
            world.groups[ranks] = dist.new_group(list(ranks), timeout=timeout)
    if every:
        world.singles = {r: dist.new_group([r], timeout=timeout) for r in range(world.size)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def shard(batch_size: int, ranks: tuple[int, ...], rank: int) -> range:
    """The batch positions rank `rank` handles for a member on `ranks`: contiguous, sizes differ by at most 1."""
    g, i = len(ranks), ranks.index(rank)
    base, extra = divmod(batch_size, g)
    start = i * base + min(i, extra)
    return range(start, start + base + (i < extra))


def describe(placement: dict[str, tuple[int, ...]]) -> str:
    """'rank 0: qwen; rank 1: llama' (for logs and error messages)."""
    by_rank: dict[int, list[str]] = {}
    for mid, ranks in placement.items():
        for r in ranks:
            by_rank.setdefault(r, []).append(mid)
    return "; ".join(f"rank {r}: {', '.join(ms)}" for r, ms in sorted(by_rank.items()))


def sum_over(group: dist.ProcessGroup | None, tensors: list[torch.Tensor], bucket_bytes: int = 64 << 20) -> None:
    """All-reduce (sum) `tensors` in place over `group`, flattened into buckets of about `bucket_bytes`
    (one collective per bucket, not per parameter). No-op for a one-rank group (None)."""
    if group is None:
        return
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors + [None]:
        if t is not None:
            bucket.append(t)
            size += t.numel() * t.element_size()
        if bucket and (t is None or size >= bucket_bytes):
            flat = torch.cat([b.reshape(-1) for b in bucket])
            with collective("all_reduce over a member's ranks"):
                dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
            offset = 0
            for b in bucket:
                b.copy_(flat[offset : offset + b.numel()].view_as(b))
                offset += b.numel()
            bucket, size = [], 0


@torch.no_grad()
def weights_checksum(tensors: Iterable[torch.Tensor]) -> float:
    """A float64 fingerprint of a model's weights, given in a fixed order (sum of position-weighted values):
    equal on every rank of a member while its replicas agree, different after almost any divergence."""
    total = torch.zeros((), dtype=torch.float64)
    for i, t in enumerate(tensors):
        # summed in float64 without a float64 copy of the tensor (a Gemma-3 embedding would be ~5 GB)
        total += (t.detach().sum(dtype=torch.float64) * (i + 1)).cpu()
    return float(total)


ALIVE_GRACE_S = 3.0  # how long a surviving rank waits for the others to mark themselves alive


def store_answers(timeout_s: float = 2.0) -> bool:
    """Whether the launch's store server (MASTER_ADDR:MASTER_PORT) still accepts connections. Asked before the
    store itself: every call on a store whose server is gone prints a page of C++ frames before it raises."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return True
    try:
        socket.create_connection((addr, int(port)), timeout=timeout_s).close()
    except OSError:
        return False
    return True


def lost_store_node(members: dict[int, str]) -> str:
    """What a surviving rank can say when the launch's store no longer answers: its server ran on the first node
    (torchrun's agent of node 0, or rank 0's process), which holds ranks 0 .. LOCAL_WORLD_SIZE-1."""
    first = range(int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
    ranks = "; ".join(f"rank {r} ({members[r]})" for r in first if r in members)
    where = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
    return (
        f"the launch's store at {where} no longer answers: the node that served it, with {ranks}, is lost "
        "(the machine, its launcher or its network); where each rank stopped is unknown"
    )


def failure_report(
    world: World,
    placement: dict[str, tuple[int, ...]],
    err: CollectiveError,
    step: int,
    phase: str,
    checkpoint: Path | None,
) -> str:
    """The message a surviving rank stops with: which ranks (and members) are dead or hung, where each was,
    and how to resume.

    Every surviving rank marks itself in the launch's store and waits up to ALIVE_GRACE_S for the others'
    marks: a rank that never answers died or hangs; its last reported step and phase say where."""
    store = _store() if world.distributed and store_answers() else None
    answered: set[int] = set()
    if store is not None:
        try:
            store.set(f"vlm_corl/alive/{world.rank}", "1")
            deadline = time.monotonic() + ALIVE_GRACE_S
            while True:
                answered = {r for r in range(world.size) if store.check([f"vlm_corl/alive/{r}"])}
                if len(answered) == world.size or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        except (dist.DistError, RuntimeError):
            pass
    progress = world.progress() if store is not None else {}
    members = {r: ", ".join(mid for mid, ranks in placement.items() if r in ranks) for r in range(world.size)}
    silent = [r for r in range(world.size) if r not in answered] if store is not None else []
    who = (
        "; ".join(
            f"rank {r} ({members[r]}) died or hangs (last at step/phase {progress.get(r, 'unknown')!r})" for r in silent
        )
        or "every rank answered (a network failure?)"
    )
    if world.distributed and store is None:
        who = lost_store_node(members)
    resume = (
        f"the last complete checkpoint is {checkpoint}: after fixing the cause, relaunch with train.resume=true"
        if checkpoint
        else "no checkpoint was written yet; relaunch from the start"
    )
    return (
        f"rank {world.rank} stopped at step {step}, phase {phase}: {err}. {who}. Collectives wait at most "
        f"train.dist_timeout_s={world.timeout_s:g}s; {resume}."
    )
