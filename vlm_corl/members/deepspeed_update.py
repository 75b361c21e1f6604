"""DeepSpeed ZeRO as a member's update engine, on the member's own group of ranks (`train.deepspeed`).

accelerate cannot give one DeepSpeed engine to a subgroup of the launch, so accelerate (or torchrun) only
launches, and each trainable member gets its own `deepspeed.initialize` whose data-parallel group is the
member's ranks (through a minimal `mpu`). The member keeps its client AdamW and cosine schedule (built by
`Member.setup_optimizer`); DeepSpeed partitions gradients and optimizer state (ZeRO-2) and weights too (ZeRO-3),
optionally offloaded to the CPU.

How the update is driven (measured with deepspeed 0.19.8, torch 2.14.1, CPU/gloo):
- a step has a variable number of micro-batches: `managed_gradient_accumulation: false`, every micro-batch
  `backward(loss, scale_wrt_gas=False)`, then one `step()` (which also steps the schedule and clips);
- DeepSpeed averages gradients over the group; our losses are normalised by the whole batch, so the loss is
  multiplied by the group size to get the sum;
- every rank of a group must run the same number of forward/backward passes (ZeRO-2 reduces inside
  backward, ZeRO-3 gathers inside forward): `lockstep_count` pads with zero-loss micro-batches;
- ZeRO-3 weights are partitioned before DeepSpeed sees the module (`partition_zero3`): the member is loaded on
  the host and each parameter moves to its GPU only to be cut into its rank's share, so no GPU ever holds the
  whole model (an 11B member in fp32 is 43 GB, with gradients 86 GB). Whatever reads the full weights (the vLLM
  weight sync, an EMA teacher, a checkpoint, the replica checksum) streams them (`full_weights`): parameters
  are gathered over the group a bucket at a time (`train.gather_bucket_mb`) and released before the next
  bucket, so no rank ever holds a second full copy. The HF rollout engine is the exception: it decodes with the
  module's own forward, and ranks decoding different lengths would mismatch ZeRO-3's per-layer gathers, so
  with the HF engine a ZeRO-3 member keeps a full, hook-free copy in its rollout dtype (bf16 on CUDA), made
  from the host copy before partitioning and refreshed a bucket at a time after every step; scoring passes
  then run on it too, while without it they run through the engine in lockstep;
- `engine.save_checkpoint` synchronises the whole world, not the member's group, so each rank saves its own
  partition of the optimizer state (`deepspeed_state.<group rank>.pt`) with no collective at all.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from vlm_corl.errors import UserError
from vlm_corl.members.precision import rollout_copy, update_autocast_dtype
from vlm_corl.members.state_files import persistent_buffers, read_state

STATE_FILE = "deepspeed_state.{}.pt"
_REFUSED = {
    "optimizer": "the member's AdamW comes from train.lr / adam_beta* / weight_decay",
    "scheduler": "the cosine schedule comes from train.warmup_ratio / min_lr_ratio",
    "fp16": "fp16 training is not supported (it needs loss scaling); use train.mixed_precision=bf16",
    "bf16": "weights stay fp32 masters; bf16 compute is train.mixed_precision=bf16 (autocast)",
    "bfloat16": "weights stay fp32 masters; bf16 compute is train.mixed_precision=bf16 (autocast)",
    "torch_autocast": "the trainer writes it from train.mixed_precision (bf16 autocast, as for every member)",
}
_HALF_WEIGHTS = ("fp16", "bf16", "bfloat16")  # refused only when enabled: `"enabled": false` changes nothing


class DeepSpeedConfigError(UserError, ValueError):
    """The DeepSpeed JSON holds something this trainer sets itself (names the key and the field to use)."""


class GroupMPU:
    """What DeepSpeed asks of a model-parallel unit: here data parallel = the member's ranks, model parallel = 1.

    Also how a member's pair of groups travels to `attach_deepspeed`, `partition_zero3` and `DeepSpeedUpdate`
    (DeepSpeed only reads it)."""

    def __init__(self, dp_group: dist.ProcessGroup, mp_group: dist.ProcessGroup):
        self.dp_group, self.mp_group = dp_group, mp_group

    def get_data_parallel_group(self) -> dist.ProcessGroup:
        return self.dp_group

    def get_data_parallel_world_size(self) -> int:
        return dist.get_world_size(self.dp_group)

    def get_data_parallel_rank(self) -> int:
        return dist.get_rank(self.dp_group)

    def get_model_parallel_group(self) -> dist.ProcessGroup:
        return self.mp_group

    def get_model_parallel_world_size(self) -> int:
        return 1

    def get_model_parallel_rank(self) -> int:
        return 0


def load_deepspeed_config(path: str | Path, grad_clip: float, group_size: int, autocast: torch.dtype | None) -> dict:
    """The user's ZeRO settings plus what this trainer drives itself (batch sizes, accumulation, clipping) and the
    precision: `autocast`, the update's autocast dtype (`precision.update_autocast_dtype`, None for fp32).

    DeepSpeed members compute as plain ones do: fp32 master weights and Adam state, forward passes under bf16
    autocast. DeepSpeed 0.19 opens that autocast itself in the engine's forward (`torch_autocast`; on CUDA it
    switches off an autocast opened outside when the section is off). Its `lower_precision_safe_modules` is
    empty so that gradients are reduced, and ZeRO-3 weights gathered, in fp32 as in plain data parallel: by
    default DeepSpeed sends those of Linear and Conv layers in bf16, which adds a bf16 gradient bucket beside the
    fp32 one and, over several ranks, rounds the fp32 weights a gather hands to checkpoints, EMA teachers and
    the vLLM sync."""
    cfg = json.loads(Path(path).read_text())
    for key, why in _REFUSED.items():
        if key in cfg and (key not in _HALF_WEIGHTS or cfg[key].get("enabled", False)):
            raise DeepSpeedConfigError(f"{path}: remove the {key!r} section: {why}")
    zero = cfg.setdefault("zero_optimization", {"stage": 2})
    if zero.get("stage", 0) not in (2, 3):
        raise DeepSpeedConfigError(
            f"{path}: zero_optimization.stage must be 2 or 3 (without DeepSpeed the update "
            "is plain data parallel: set train.deepspeed=null)"
        )
    cfg.update(
        {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": 1,
            "train_batch_size": group_size,
            "managed_gradient_accumulation": False,  # step() is the boundary, whatever the micro-batch count
            "gradient_clipping": grad_clip,
            "zero_allow_untested_optimizer": True,  # a client torch AdamW
            "steps_per_print": 10**9,
            "torch_autocast": (
                {"enabled": True, "dtype": str(autocast).removeprefix("torch."), "lower_precision_safe_modules": []}
                if autocast is not None
                else {"enabled": False}
            ),
        }
    )
    if "offload_optimizer" in zero:
        cfg["zero_force_ds_cpu_optimizer"] = False  # keep the client AdamW (no JIT-built CPU Adam)
    return cfg


_ACTIVE_GROUP: list = [None]  # the member group whose ZeRO-3 engine is running forward passes in this process
# The engines not closed yet: a run closes those it opened (vlm_corl.training.run.release), a failed start's too. Held
# strongly: an engine nobody closes outlives every reference to it anyway (its hooks), and only `close` frees it.
_OPEN: set[DeepSpeedUpdate] = set()


def _check_trace_within_group(ints: list[int]) -> None:
    """DeepSpeed 0.19.8's ZeRO-3 prefetch tracer checks that every rank recorded the same module order by a
    broadcast from world rank 0 over the WORLD group (`partitioned_param_coordinator.
    assert_ints_same_as_other_ranks`): that only works when one model spans the whole launch, and with
    members on disjoint groups it compares different models (and desynchronises their collectives). Here
    the check runs over the member's own group."""
    group = _ACTIVE_GROUP[0]
    if group is None:
        raise RuntimeError("a ZeRO-3 forward pass ran outside DeepSpeedUpdate.updating()")
    seen = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, list(ints), group=group)
    if any(other != seen[0] for other in seen):
        raise RuntimeError(
            "the ranks of a ZeRO-3 member ran different module orders (their micro-batches differ "
            "in structure, e.g. with and without images); keep each member's data homogeneous"
        )


def _patch_zero3_trace_check() -> None:
    """The one place that touches DeepSpeed internals (written against deepspeed 0.19.8)."""
    from deepspeed.runtime.zero import partitioned_param_coordinator as coordinator

    coordinator.assert_ints_same_as_other_ranks = _check_trace_within_group


def open_engines() -> list[DeepSpeedUpdate]:
    """The DeepSpeed engines of this process not closed yet."""
    return list(_OPEN)


def _forget_zero3_module(module: torch.nn.Module) -> None:
    """What DeepSpeed 0.19.8's ZeRO-3 keeps of a module process-wide and `engine.destroy` leaves: the module on its
    module stack (`parameter_offload.FWD_MODULE_STACK`; a forward pass that raised leaves submodules there too),
    and every submodule in the coordinator's release cache (an lru_cache on a method, keyed by coordinator and
    submodule, that serves every engine; it is only a cache). Either keeps the member's whole model alive."""
    from deepspeed.runtime.zero import parameter_offload
    from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator

    mine = {id(m) for m in module.modules()}
    parameter_offload.FWD_MODULE_STACK[:] = [m for m in parameter_offload.FWD_MODULE_STACK if id(m) not in mine]
    instrumented = PartitionedParameterCoordinator._PartitionedParameterCoordinator__params_to_release
    # the lru_cache inside DeepSpeed's NVTX wrapper (instrument_w_nvtx keeps it in a closure)
    cached = next(cell.cell_contents for cell in instrumented.__closure__ if hasattr(cell.cell_contents, "cache_clear"))
    cached.cache_clear()


def _restore_functional_linear() -> None:
    """ZeRO-3's partitioning (`partition_zero3`) replaces torch.nn.functional.linear for the whole process with its
    own (DeepSpeed 0.19.8: "This will persist unless manually reset"): torch's, which DeepSpeed kept, goes back."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher

    original = getattr(patcher, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def zero_stage(path: str | Path) -> int:
    """The ZeRO stage a DeepSpeed JSON config asks for (2 unless it says otherwise)."""
    return json.loads(Path(path).read_text()).get("zero_optimization", {"stage": 2}).get("stage", 0)


def attach_deepspeed(
    member,
    train,
    total_updates: int,
    mpu: GroupMPU,
    keep_full_copy: bool,
    bucket_bytes: int | None = None,
) -> None:
    """Give a loaded trainable member its AdamW, schedule and DeepSpeed engine over its ranks (`train`: a
    TrainConfig whose `deepspeed` names the JSON config; `mpu`: the member's data-parallel group, its ranks, and
    this rank's own single-rank group as the model-parallel one).

    ZeRO-3 members are loaded on the host (`load_member(stage_on_cpu=True)`): with `keep_full_copy` (the HF
    rollout engine) their copy is made there, then the weights are partitioned onto the device before the
    optimizer and DeepSpeed see them. Nothing allocates gradients or Adam state before DeepSpeed does; DeepSpeed's
    gradient partitions and the Adam moments exist when this returns (`allocate_zero_adam_state`)."""
    autocast = update_autocast_dtype(train.mixed_precision, member.device)
    ds_config = load_deepspeed_config(train.deepspeed, train.grad_clip, dist.get_world_size(mpu.dp_group), autocast)
    full_copy = None
    if ds_config["zero_optimization"]["stage"] == 3:
        if keep_full_copy:
            full_copy = rollout_copy(member.model, member.device, member.rollout_dtype)
        partition_zero3(member.model, ds_config, mpu, member.device)
    else:
        member.model.to(member.device)
    member.setup_optimizer(train, total_updates, deepspeed=True)
    bucket = bucket_bytes if bucket_bytes is not None else int(train.gather_bucket_mb * (1 << 20))
    member.deepspeed = DeepSpeedUpdate(member, ds_config, mpu, full_copy, bucket)


def partition_zero3(model: torch.nn.Module, ds_config: dict, mpu: GroupMPU, device: torch.device) -> None:
    """Cut a host model's parameters into ZeRO-3 partitions over `mpu.dp_group`, one parameter at a time (each is
    moved to the device, split, and only its rank's share kept), then move its buffers to the device.

    `deepspeed.initialize` on an unpartitioned module would first move all of it to the GPU."""
    import deepspeed

    deepspeed.init_distributed()  # adopts the launch's process group (zero.Init reads its config before doing so)
    offload = ds_config["zero_optimization"].get("offload_param") or {}
    deepspeed.zero.Init(
        module=model,
        data_parallel_group=mpu.dp_group,
        config_dict_or_path=ds_config,
        remote_device=offload.get("device"),
        pin_memory=offload.get("pin_memory", False),
        mpu=mpu,
    )
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[name] = buffer.to(device)


class DeepSpeedUpdate:
    """A trainable member's DeepSpeed engine over its group: backward, step, lockstep, state save/load.

    Built by `attach_deepspeed` (weights partitioned first under ZeRO-3, `full_copy` the HF engine's copy)."""

    def __init__(self, member, ds_config: dict, mpu: GroupMPU, full_copy=None, bucket_bytes: int = 512 << 20):
        import deepspeed  # optional dependency: the `deepspeed` extra

        self.stage = ds_config["zero_optimization"]["stage"]
        self.device = member.device
        self.group = mpu.dp_group
        self.size = dist.get_world_size(mpu.dp_group)
        self.rank = dist.get_rank(mpu.dp_group)
        self.bucket_bytes = bucket_bytes
        self.full_copy = full_copy
        for p in member.model.parameters():
            p.grad = None  # DeepSpeed keeps gradients in its own buffers
        self.engine, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=member.model,
            optimizer=member.optimizer,
            lr_scheduler=member.scheduler,
            config=ds_config,
            mpu=mpu,
        )
        self.module = self.engine.module
        _OPEN.add(self)
        if self.stage == 3:
            _patch_zero3_trace_check()
        allocate_zero_adam_state(self.optimizer, self.stage)

    @contextmanager
    def updating(self) -> Iterator[None]:
        """Around a member's update (every forward/backward of its engine): ZeRO-3's trace checks run over
        this member's group."""
        _ACTIVE_GROUP[0] = self.group
        try:
            yield
        finally:
            _ACTIVE_GROUP[0] = None

    @property
    def partitioned(self) -> bool:
        """ZeRO-3 without a full copy: no module on this rank holds the member's whole weights."""
        return self.stage == 3 and self.full_copy is None

    @property
    def full_model(self) -> torch.nn.Module:
        """A module with the member's full weights (ZeRO-2 keeps them whole on every rank; ZeRO-3 only in the
        copy kept for HF rollouts)."""
        if self.partitioned:
            raise RuntimeError("a partitioned ZeRO-3 member has no full module: stream its weights (full_weights)")
        return self.full_copy if self.full_copy is not None else self.module

    def full_weights(self, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(state-dict name, full fp32 tensor) of every parameter and persistent buffer; under ZeRO-3 a
        collective over the group (every rank of the member iterates to the end, in the same order), also when
        the HF engine's copy exists (it holds the rollout dtype, not the masters).

        ZeRO-3: parameters are gathered a bucket of `bucket_bytes` at a time; a yielded tensor is valid until
        the next one of another bucket is asked for (consumers copy it: vLLM's loader, the EMA lerp, the
        checkpoint writer's host copy). `trainable_only`: the parameters that train, without buffers (a LoRA
        member's adapters: each sync gathers a few MB, not the frozen base)."""
        named = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad or not trainable_only]
        if self.stage != 3:
            yield from ((n, p.data) for n, p in named)
            if not trainable_only:
                yield from persistent_buffers(self.module)
            return
        import deepspeed

        for bucket in _buckets(named, self.bucket_bytes):
            with deepspeed.zero.GatheredParameters([p for _, p in bucket], modifier_rank=None):
                for name, p in bucket:
                    yield name, p.data
        if not trainable_only:
            yield from persistent_buffers(self.module)

    def backward(self, loss: torch.Tensor) -> None:
        # x group size: DeepSpeed averages over the group, our per-rank losses add up to the batch's loss.
        self.engine.backward(loss * self.size, scale_wrt_gas=False)

    def step(self) -> tuple[float, bool]:
        """Optimizer + schedule step (clipping by the config's gradient_clipping); returns the pre-clip norm and
        whether the step was applied. DeepSpeed 0.19's ZeRO optimizers skip a step whose gradient norm is not
        finite (fp32 and fp16 members: an "overflow"), leave the schedule where it was and count it in
        `skipped_steps`; every rank of the member sees the same reduced norm."""
        skipped = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        applied = self.engine.skipped_steps == skipped
        if applied:
            self.refresh_full_copy()
        return (float(norm) if norm is not None else 0.0), applied

    @torch.no_grad()
    def refresh_full_copy(self) -> None:
        """ZeRO-3: copy the updated weights into the HF engine's copy (every rank of the group), gathered a bucket
        at a time like `full_weights`, so the refresh never holds a second full model beside the copy."""
        if self.full_copy is None:
            return
        copies = dict(self.full_copy.named_parameters())
        for name, weight in self.full_weights():
            if name in copies:
                copies[name].copy_(weight)

    def close(self) -> None:
        """At the end of a run: the engine's hooks removed (`engine.destroy`; its gradient hooks live in autograd's
        C++ nodes, where the cyclic collector never sees the cycle they close, so without it the engine, the
        module and the optimizer state outlive the run), DeepSpeed's process-wide hold on its groups dropped, and
        under ZeRO-3 what DeepSpeed keeps of its module process-wide forgotten and torch's `F.linear` put back."""
        from deepspeed.utils import groups

        _OPEN.discard(self)
        self.engine.destroy()
        if groups.mpu is self.engine.mpu:  # deepspeed.initialize made it process-wide (with its process groups)
            groups.mpu = None
        if self.stage == 3:
            _forget_zero3_module(self.module)
            _restore_functional_linear()

    def lockstep_count(self, n: int) -> int:
        """The number of micro-batches every rank of the group runs this step: the largest `n` among them,
        and at least one (DeepSpeed's step needs a backward; a zero-loss one gives the zero gradient that plain
        data parallel steps with when every advantage is zero)."""
        t = torch.tensor([max(n, 1)], dtype=torch.long, device=self.device)  # the backend's device (NCCL: CUDA)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def save_state(self, directory: Path) -> None:
        """This rank's partition of the optimizer state, the schedule and the step count (no collective)."""
        torch.save(
            {
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "global_steps": self.engine.global_steps,
                "group_size": self.size,
            },
            Path(directory) / STATE_FILE.format(self.rank),
        )

    def load_state(self, directory: Path) -> None:
        path = Path(directory) / STATE_FILE.format(self.rank)
        state = read_state(path, weights_only=False)
        if state["group_size"] != self.size:
            raise ValueError(
                f"{path} was saved by a member on {state['group_size']} ranks, this run gives it "
                f"{self.size}: resume with the same members[*].ranks and number of processes"
            )
        parts = [None] * self.size
        parts[self.rank] = state["optimizer"]  # ZeRO's loader indexes the states by group rank
        self.optimizer.load_state_dict(parts, load_optimizer_states=True, load_from_fp32_weights=True)
        self.scheduler.load_state_dict(state["scheduler"])
        self.engine.global_steps = state["global_steps"]


def allocate_zero_adam_state(zero_optimizer, stage: int) -> None:
    """Create the client AdamW's moments over ZeRO's flat fp32 partitions now, as its first step would (torch's
    optimizers create them lazily and neither ZeRO optimizer steps at init, DeepSpeed 0.19): a step at learning
    rate 0 on zero gradients, its step count reset, so the first real step is bit-identical to a lazy one. Run
    before any vLLM engine is built, so vLLM's start-up check sees the 8 bytes per parameter / G already taken
    (else they appear at step 1, over what vLLM was promised). Each partition's gradient slot is restored (CPU
    offload keeps its buffers there)."""
    if stage == 3:
        flats = [
            (zero_optimizer.sub_group_to_group_id[i], f)
            for i, f in enumerate(zero_optimizer.fp32_partitioned_groups_flat)
        ]
    else:
        flats = list(enumerate(zero_optimizer.single_partition_of_fp32_groups))
    inner = zero_optimizer.optimizer
    groups, held = inner.param_groups, [f.grad for _, f in flats]
    try:
        # the partitions as the ZeRO step hands them over (stage 3 empties the groups between steps)
        inner.param_groups = [{**groups[g], "params": [f], "lr": 0.0} for g, f in flats]
        for _, f in flats:
            f.grad = torch.zeros_like(f)
        inner.step()
    finally:
        inner.param_groups = groups
        for (_, f), grad in zip(flats, held):
            f.grad = grad
    for _, f in flats:
        inner.state[f]["step"].zero_()


def _buckets(named: list[tuple[str, torch.nn.Parameter]], limit: int) -> Iterator[list]:
    """Consecutive parameters in groups of at most `limit` bytes (full size; one larger tensor is its own)."""
    bucket, size = [], 0
    for name, p in named:
        nbytes = p.ds_numel * p.element_size() if hasattr(p, "ds_numel") else p.numel() * p.element_size()
        if bucket and size + nbytes > limit:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, p))
        size += nbytes
    if bucket:
        yield bucket


def state_files(group_size: int) -> list[str]:
    """A DeepSpeed member's optimizer-state files in a checkpoint (one per rank of its group)."""
    return [STATE_FILE.format(r) for r in range(group_size)]
