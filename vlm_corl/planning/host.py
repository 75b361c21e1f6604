"""Host memory (RAM) per node: what each rank holds on the host, at start-up and while training, summed over the
ranks of a node.

Per rank, for a member of P parameters (A trained ones: P, or a LoRA member's adapters) on G ranks:
- the process itself (`HOST_PROCESS_BYTES`);
- start-up staging, one member at a time (members load in turn): a ZeRO-3 member is read onto the host whole by
  every one of its ranks and partitioned from there (`load_member(stage_on_cpu=True)`: the fp32 model, 4P, plus
  the checkpoint-dtype tensors it was cast from and the HF engine's rollout copy: `ZERO3_STAGING_BYTES`); a
  ZeRO-2 member's optimizer flattens its fp32 weights on the host when the GPU lacks room for a second copy
  (stage_1_and_2.py: each weight moved to the host, 4A, then one flat copy, 4A), otherwise on the GPU;
- CPU offload: the optimizer's fp32 master partition, Adam's moments and the fp32 gradient partition on the host
  (16A/G, pinned), and with offload_param the fp32 weight partitions (4P/G);
- prompt caches: data.prompt_cache_mb per renderer (one per slot: two for co_rewarding's views and EMA teachers);
- vLLM sleep mode at level 1 (frozen peers, EMA teachers, LoRA engines serving adapters, and fully trained members
  under rollout.vllm.sleep_level 1): the engine's weights backed up in pinned host memory while it sleeps;
- background checkpoints (train.async_checkpoint, on by default on CUDA without DeepSpeed): the rank that writes a
  model (its member's first; an EMA teacher's, its student's) holds a host copy of everything the checkpoint
  writes of it (`Member.snapshot`: weights, Adam's moments, fp32 masters; the disk plan's bytes without the small
  files) from the step until the files are on disk. One checkpoint is in flight at a time. The trainer state
  (Adam's moments, the masters) is copied into pinned memory (`state_files.host_copy`), whose CachingHostAllocator
  rounds each tensor up to a power of two of bytes and keeps the blocks for the process's life: planned per tensor
  from the model's parameter shapes (`ModelShape.pow2_params`; each state tensor has its parameter's shape), and
  at the upper bound of 2x for a LoRA member's adapters, whose shapes the planner does not read
  (`PINNED_ADAPTER_ROUNDING`). The weights themselves are copied to pageable memory (`member._saved`): no rounding.
- the training data (`data_bytes`), held by every rank from start-up on: a "jsonl" source's records as Python
  objects (`RECORD_BYTES_PER_JSONL_BYTE` times the file's size; its pictures stay in their files, read when a
  prompt is rendered, so they cost a rank nothing here), an "hf" source's records without their pictures
  (`HF_RECORD_BYTES` a row of its Arrow or parquet files, `RECORD_BYTES_PER_JSONL_BYTE` a byte of its json/csv
  files): its embedded pictures stay in the memory-mapped Arrow files (`data.mapped`), whose pages the node's
  ranks share, counted once a node (`HostPlan.mapped`: the data files' size); other loaders' data (easy-vqa, the
  Python API's, a hub dataset) is not sized: 0.
A rank's peak is the larger of start-up (staging, with the offloaded state of the members before) and training.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from vlm_corl.config.engine_layout import vllm_engines_by_rank
from vlm_corl.config.schema import CohortConfig, DatasetConfig, has_teachers, resolve_async, slots_per_member
from vlm_corl.members.memory import GB
from vlm_corl.planning.disk import checkpoint_disk
from vlm_corl.planning.engines import TEACHER
from vlm_corl.planning.layout import rollout_bytes, trained_params, zero_settings
from vlm_corl.planning.shapes import ModelShape, Shapes

# A trainer process's own host memory: Python with torch, transformers, DeepSpeed and the trainer imported is
# 0.9 GB of RSS on a CPU-only host (measured here); a CUDA process adds its context's host side and the CUDA
# libraries (cuBLAS, cuDNN, NCCL) and vLLM its own imports: 3 GB, an estimate not measured on a GPU node.
HOST_PROCESS_BYTES = 3e9
ZERO3_STAGING_BYTES = 8  # per parameter: the fp32 host model (4) and the tensors cast to it / from it (4)
ZERO2_HOST_FLATTEN_BYTES = 8  # per trained parameter: the weights moved to the host (4) and their flat copy (4)
OFFLOAD_OPTIMIZER_BYTES = 16  # per trained parameter / G: fp32 master 4, Adam's moments 8, fp32 gradients 4
OFFLOAD_PARAM_BYTES = 4  # per parameter / G: the fp32 weight partitions
PINNED_ADAPTER_ROUNDING = 2.0  # a power-of-two rounding at most doubles a tensor (the bound for unread shapes)
# A JSONL record loaded (its Example, strings, dict, tuple, its entry in the picture check cache) holds about 12
# bytes a byte of its line: bench/data_scale.py's 2,000 records of 104 bytes (208 KB) left 2.5 MB resident.
RECORD_BYTES_PER_JSONL_BYTE = 12
# An "hf" dataset's row in a rank's heap, its pictures left in the mapped files (a `TableImage` each): its Example,
# strings, metadata and check cache entry: bench/data_scale.py --kind hf --side 32, 10,000 pictures against 2,000,
# 8.9 MiB more resident memory of the process's own (RssAnon) a rank for 8,000 more rows: 1,170 bytes a row.
HF_RECORD_BYTES = 1200
_HF_DATA_SUFFIXES = (".arrow", ".parquet", ".json", ".jsonl", ".csv")
_HF_INFO_FILES = ("state.json", "dataset_info.json", "dataset_dict.json")  # save_to_disk's, not data


@dataclass
class HostRank:
    """One rank's host memory by part, at start-up (`init`) and while training (`training`)."""

    rank: int
    init: dict[str, float] = field(default_factory=dict)
    training: dict[str, float] = field(default_factory=dict)

    @property
    def peak(self) -> float:
        return max(sum(self.init.values()), sum(self.training.values()))

    def to_dict(self) -> dict:
        gb = lambda parts: {k: round(v / GB, 3) for k, v in parts.items()}  # noqa: E731
        return {"rank": self.rank, "peak_gb": round(self.peak / GB, 3), "init_gb": gb(self.init),
                "training_gb": gb(self.training)}  # fmt: skip


@dataclass
class HostPlan:
    """Host memory per node: its ranks' peaks summed (every rank of a node starts and trains at once)."""

    ranks: list[HostRank]
    ranks_per_node: int
    mapped: float = 0.0
    """The memory-mapped data files each node holds once, in its page cache, for all its ranks."""

    def nodes(self) -> list[float]:
        """Bytes per node, node 0 first."""
        per = max(self.ranks_per_node, 1)
        out = [self.mapped] * (-(-len(self.ranks) // per))
        for r in self.ranks:
            out[r.rank // per] += r.peak
        return out

    def to_dict(self) -> dict:
        host = {"ranks_per_node": self.ranks_per_node, "mapped_data_gb": round(self.mapped / GB, 3)}
        return {
            "host_memory_gb": [round(n / GB, 3) for n in self.nodes()],
            "host_memory": {**host, "ranks": [r.to_dict() for r in self.ranks]},
        }

    def line(self) -> str:
        """The plan's text line."""
        nodes = self.nodes()
        worst = max(self.ranks, key=lambda r: r.peak)
        shown = ", ".join(f"{n / GB:.1f}" for n in nodes[:8]) + (", ..." if len(nodes) > 8 else "")
        per = max(self.ranks_per_node, 1)
        data = f" ({worst.training['data'] / GB:.2f} GB a rank)" if worst.training.get("data") else ""
        if self.mapped:
            data += f" and {self.mapped / GB:.2f} GB of mapped data files a node"
        return (
            f"host memory: {shown} GB per node ({per} rank{'s' * (per > 1)} each; the largest rank, "
            f"{worst.rank}, peaks at {worst.peak / GB:.1f} GB: staging, CPU offload, prompt caches, sleep backups, "
            f"background checkpoints' copies, the data{data})"
        )


def host_memory(
    cfg: CohortConfig, shapes: Shapes, placement: dict, gpu_free: dict, ranks_per_node: int, cuda: bool
) -> HostPlan:
    """The host plan of `cfg` (its members of `shapes`, the plan's) placed as `placement`, `ranks_per_node`
    consecutive ranks a node (0: one node); `gpu_free[rank][member]`: GPU bytes free for a ZeRO-2 member's flat
    copy of its weights when it starts."""
    zero = zero_settings(cfg)
    ranks = sorted({r for rs in placement.values() for r in rs})
    copies = _checkpoint_copies(cfg, shapes, placement, cuda)
    data = data_bytes(cfg.data.train)
    out = []
    for rank in ranks:
        host = HostRank(rank, {"process": HOST_PROCESS_BYTES}, {"process": HOST_PROCESS_BYTES})
        staged = 0.0
        for m in (m for m in cfg.members if rank in placement[m.id] and m.trainable and zero):
            offloaded = sum(v for k, v in host.training.items() if k.startswith("offload"))
            free = gpu_free.get(rank, {}).get(m.id, 0.0)
            staged = max(staged, offloaded + _staging_bytes(zero, m, shapes[m.id], free))
            offload = _offload_bytes(zero, m, shapes[m.id], len(placement[m.id]))
            if offload:
                host.training[f"offload {m.id}"] = offload
        if staged:
            host.init["staging"] = staged
        host.training["prompt_caches"] = renderers(cfg, placement, rank) * cfg.data.prompt_cache_mb * (1 << 20)
        backups = _sleep_backups(cfg, shapes, placement, rank) if cuda else 0.0  # vLLM sleeps on CUDA only
        if backups:
            host.training["vllm_sleep_backups"] = backups
        if copies.get(rank):
            host.training["checkpoint_copies"] = copies[rank]
        if data:
            host.init["data"] = host.training["data"] = data
        out.append(host)
    return HostPlan(out, ranks_per_node or len(ranks), mapped_bytes(cfg.data.train))


def data_bytes(spec: DatasetConfig) -> float:
    """The bytes a rank holds for the training data `spec` names, from its files (module doc); 0 for a source with
    no files on this machine to size (easy-vqa's package, the Python API's, a hub dataset, a missing path)."""
    path = Path(spec.path) if spec.path else None
    if path is None or not path.exists():
        return 0.0
    if spec.loader == "jsonl":
        file = path if path.is_file() else path / f"{spec.split}.jsonl"
        return RECORD_BYTES_PER_JSONL_BYTE * file.stat().st_size if file.is_file() else 0.0
    if spec.loader == "hf":
        files = _hf_files(spec)
        tables = [f for f in files if f.suffix in (".arrow", ".parquet")]
        texts = sum(f.stat().st_size for f in files if f not in tables)
        return HF_RECORD_BYTES * sum(map(_rows, tables)) + RECORD_BYTES_PER_JSONL_BYTE * texts
    return 0.0


def mapped_bytes(spec: DatasetConfig) -> float:
    """The bytes of the data files an "hf" source's ranks map (its Arrow files, or `datasets`' Arrow copy of its
    parquet/json/csv files, about their size): held once a node; 0 for another loader."""
    return float(sum(f.stat().st_size for f in _hf_files(spec))) if spec.loader == "hf" else 0.0


def _hf_files(spec: DatasetConfig) -> list[Path]:
    """An "hf" source's data files for its split: the path itself, its split's folder's files, or its own."""
    path = Path(spec.path) if spec.path else None
    if path is None or not path.exists():
        return []
    if path.is_file():
        return [path]
    folder = path / spec.split if (path / spec.split).is_dir() else path  # a DatasetDict's split
    return [f for f in folder.rglob("*") if f.suffix in _HF_DATA_SUFFIXES and f.name not in _HF_INFO_FILES]


def _rows(file: Path) -> int:
    """The rows of an Arrow (IPC stream) or parquet file, from its batches' headers or its footer; 0 for a file
    that is neither (the load will say what is wrong with it)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if file.suffix == ".parquet":
            return pq.read_metadata(file).num_rows
        with pa.memory_map(str(file)) as source:
            return sum(batch.num_rows for batch in pa.ipc.open_stream(source))
    except (OSError, pa.ArrowException):
        return 0


def _checkpoint_copies(cfg: CohortConfig, shapes: Shapes, placement: dict, cuda: bool) -> dict[int, float]:
    """{rank: bytes} of the host copies a background checkpoint holds on the ranks that write (see the module
    docstring); empty when checkpoints are written at the step."""
    if not resolve_async(cfg.train.async_checkpoint, "cuda" if cuda else "cpu", cfg.train.deepspeed is not None):
        return {}
    out: dict[int, float] = {}
    members = {m.id: m for m in cfg.members}
    for model, parts in checkpoint_disk(cfg, shapes).members.items():
        m = members[model.removesuffix(TEACHER)]
        writer = placement[m.id][0]
        pinned = parts.get("optimizer", 0.0) * pinned_rounding(m.lora is not None, shapes[m.id])
        unpinned = sum(v for part, v in parts.items() if part not in ("small_files", "optimizer"))
        out[writer] = out.get(writer, 0.0) + unpinned + pinned
    return out


def pinned_rounding(lora: bool, shape: ModelShape) -> float:
    """How much larger a pinned host copy of a trainer state is than its bytes: each tensor rounded up to a power
    of two (see the module docstring), per parameter shape for full fine-tuning, 2x for a LoRA member's adapters."""
    if lora or not shape.pow2_params:
        return PINNED_ADAPTER_ROUNDING
    return shape.pow2_params / shape.params


def _offload_bytes(zero: dict, m, shape: ModelShape, ranks: int) -> float:
    """A trained member's state in host memory under CPU offload, per rank (`zero`: its zero_optimization)."""
    out = OFFLOAD_OPTIMIZER_BYTES * trained_params(m, shape) / ranks if "offload_optimizer" in zero else 0.0
    if zero.get("stage") == 3 and "offload_param" in zero:
        out += OFFLOAD_PARAM_BYTES * shape.params / ranks
    return out


def _staging_bytes(zero: dict, m, shape: ModelShape, gpu_free: float) -> float:
    """A trained DeepSpeed member's host staging at start-up (see the module docstring)."""
    if zero.get("stage", 2) == 3:
        return ZERO3_STAGING_BYTES * float(shape.params)
    trained = trained_params(m, shape)
    return ZERO2_HOST_FLATTEN_BYTES * trained if gpu_free < 4 * trained else 0.0


def renderers(cfg: CohortConfig, placement: dict, rank: int) -> int:
    """Renderers (one per slot) of the members on `rank`: two per member under co_rewarding_1 (two views) and
    the EMA-teacher rewards, else one."""
    return slots_per_member(cfg) * sum(rank in placement[m.id] for m in cfg.members)


def _sleep_backups(cfg: CohortConfig, shapes: Shapes, placement: dict, rank: int) -> float:
    """Pinned host backups of the weights of the engines on `rank` that sleep at level 1."""
    if not cfg.rollout.vllm.enable_sleep_mode:
        return 0.0
    members = {m.id: m for m in cfg.members}
    out = 0.0
    for name in vllm_engines_by_rank(cfg, placement, has_teachers(cfg)).get(rank, []):
        m = members[name.removesuffix(TEACHER)]
        adapter_sync = m.lora is not None and cfg.rollout.vllm.lora_sync == "adapter"
        if name.endswith(TEACHER) or not m.trainable or adapter_sync or cfg.rollout.vllm.sleep_level == 1:
            out += rollout_bytes(cfg, shapes[m.id], True) * shapes[m.id].params
    return out
