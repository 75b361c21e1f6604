"""Cohort-atomic checkpoints: all members, optimizers, schedulers, RNG states and the data position, or nothing.

Layout: `RUN/checkpoints/step-N/<member>/` (HF format, loadable by `from_pretrained`, plus the member's
`trainer_state.pt`), `RUN/checkpoints/step-N/cohort_state.pt` (step, data position, every rank's RNG states)
and `manifest.json` (the member directories and the files each must hold). A checkpoint is written under a
temporary name: every member's first rank writes its member's directory, all ranks meet at a barrier, then
world rank 0 writes the cohort state and the manifest and renames the directory. A process killed at any
moment leaves either the previous checkpoints or the new one, never half of one taken as complete: a
checkpoint counts only when its manifest is there and every member's files in it are. (A rename is atomic on
POSIX filesystems; a SIGKILL does not drop written-but-unflushed pages, so no fsync is needed for that
failure mode.)

The data a run trains on is identified by its content, not its path (`data_fingerprint`): recorded at start in
`RUN/data_fingerprint.json` and in every checkpoint's cohort state, and checked when the run resumes
(`check_resumed_data`), so a file rewritten in place or a relative path read from another directory is refused.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import random
import shutil
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vlm_corl.config import ConfigError
from vlm_corl.data.image_checks import cached_digest
from vlm_corl.data.mapped import TableImage
from vlm_corl.errors import UserError
from vlm_corl.members.state_files import STEP_DIR, TRAINER_STATE, read_state

if TYPE_CHECKING:
    from vlm_corl.config.schema import DatasetConfig
    from vlm_corl.data.records import Example
    from vlm_corl.distributed.world import World
    from vlm_corl.members.member import Member

STATE_FILE = "cohort_state.pt"
MANIFEST = "manifest.json"
DATA_RECORD = "data_fingerprint.json"  # in the run directory: the data the run trains on, by content
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")

log = logging.getLogger("vlm_corl")


def rng_states() -> dict:
    """Every RNG a training step of this process may draw from (the CUDA one of its device included)."""
    states = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state()
    return states


def set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda"])


def save_checkpoint(
    world: World, run_dir: Path, step: int, models: Iterable[tuple[Member, bool]], cohort_state: dict, keep_last: int
) -> Path:
    """Write step `step` atomically, then prune to the newest `keep_last` checkpoints.

    `models` are (model, whether this rank writes it) for this process's models to save (members and
    teachers; a model's writer is its member's first rank); `cohort_state["members"]` lists what the manifest
    requires. Every rank calls this at the same step.
    """
    tmp = Path(run_dir) / "checkpoints" / f".tmp-step-{step}"
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing
        tmp.mkdir(parents=True)
    world.barrier()
    with _disk_full_is_named(tmp, step, run_dir):
        for member, writes in models:
            member.save(tmp / member.id, write=writes)
    rngs = world.all_gather(rng_states())  # every rank's RNG states, in rank order
    world.barrier()  # every member's directory is written
    return finish_checkpoint(world, run_dir, step, {"rng": rngs, **cohort_state}, keep_last)


def finish_checkpoint(world: World, run_dir: Path, step: int, cohort_state: dict, keep_last: int) -> Path:
    """Make step `step`'s written directory a complete checkpoint: world rank 0 checks every member's files,
    writes the cohort state and the manifest (the marker a resume reads), renames it and prunes to the newest
    `keep_last`. Every rank calls it once every member's files are on disk."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    if world.is_main:
        required = cohort_state["members"]
        missing = [f"{mid}/{name}" for mid, files in required.items() for name in files if not _has(tmp / mid, name)]
        if missing:
            raise RuntimeError(f"checkpoint step {step} is incomplete after every rank wrote it: missing {missing}")
        with _disk_full_is_named(tmp, step, run_dir):
            torch.save({"step": step, **cohort_state}, tmp / STATE_FILE)
            manifest = {"step": step, "members": required, "replicas": cohort_state.get("replicas", {})}
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in list_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old)
    world.barrier()  # nobody reads or resumes from the checkpoint before it is renamed
    return final


class DiskFull(UserError, OSError):
    """The disk filled while a checkpoint was written: names the directory, the checkpoint kept, how to resume."""


_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def _is_disk_full(err: BaseException) -> bool:
    """An OSError for a full disk or quota, or a writer's wrapped one (safetensors reports "os error 28")."""
    if isinstance(err, OSError) and err.errno in _DISK_FULL:
        return True
    text = str(err)
    return "No space left on device" in text or "Disk quota exceeded" in text or "StorageFull" in text


@contextmanager
def _disk_full_is_named(tmp: Path, step: int, run_dir: Path) -> Iterator[None]:
    """Turn a full disk while writing checkpoint `step` into DiskFull: the partial checkpoint is removed (its
    space freed), and the message says where the disk filled, which checkpoint is intact and how to resume."""
    try:
        yield
    except Exception as err:
        if not _is_disk_full(err):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        last = latest_checkpoint(Path(run_dir))
        kept = f"the previous checkpoint {last} is intact" if last else "no earlier checkpoint was written"
        raise DiskFull(
            f"the disk holding {tmp.parent} filled while checkpoint step {step} was written ({type(err).__name__}: "
            f"{str(err).splitlines()[0][:160]}); the partial checkpoint was removed and {kept}. Free space there "
            "(or lower train.keep_last, or move output_dir to a larger disk), then resume with train.resume=true"
        ) from None


def required_files(trainable: bool, lora: bool = False) -> list[str]:
    """What a model's checkpoint directory must hold to be resumed from (a trained member: its optimizer too; a
    LoRA member: its adapter, in PEFT's format, instead of the model)."""
    weights = ["adapter_config.json", "adapter_model.safetensors"] if lora else ["config.json", "model.safetensors"]
    return weights + ([TRAINER_STATE] if trainable else [])


def _has(directory: Path, name: str) -> bool:
    if name == "model.safetensors":  # a large model is saved in shards with an index
        return any((directory / w).is_file() for w in _WEIGHTS)
    return (directory / name).exists()


def is_complete(checkpoint: Path) -> bool:
    """The manifest is there and every member's files it lists are in the checkpoint."""
    try:
        manifest = json.loads((checkpoint / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return (checkpoint / STATE_FILE).is_file() and all(
        _has(checkpoint / mid, name) for mid, files in manifest["members"].items() for name in files
    )


def list_checkpoints(run_dir: Path, warn: bool = False) -> list[Path]:
    """Complete checkpoints, oldest first; incomplete ones are skipped (with a warning when `warn`: on resume)."""
    root = Path(run_dir) / "checkpoints"
    found = []
    for d in root.glob("step-*") if root.is_dir() else []:
        m = STEP_DIR.fullmatch(d.name)
        if not m:
            continue
        if is_complete(d):
            found.append((int(m.group(1)), d))
        elif warn:
            log.warning("checkpoint %s is incomplete (a member's files or the manifest are missing): skipped", d)
    return [d for _, d in sorted(found)]


def latest_checkpoint(run_dir: Path, warn: bool = False) -> Path | None:
    """The newest complete checkpoint, or None (`warn`: log the incomplete ones passed over)."""
    found = list_checkpoints(run_dir, warn)
    return found[-1] if found else None


def load_cohort_state(checkpoint: Path) -> dict:
    """The cohort-level state (step, RNG states, data position, …) of a checkpoint."""
    # weights_only=False: the file holds RNG tuples and numpy state we wrote ourselves.
    return read_state(Path(checkpoint) / STATE_FILE, weights_only=False)


def restore_rng(states: list[dict], world: World) -> None:
    """Set this rank's RNG states from a checkpoint's (one entry per rank of the run that saved it)."""
    if len(states) != world.size:
        log.warning(
            "the checkpoint was taken with %d processes, this run has %d: RNG states are not restored "
            "(sampling seeds are derived from the step, so only other random draws differ)",
            len(states),
            world.size,
        )
        return
    set_rng_states(states[world.rank])


# ---- the data a run trains on, by content ----------------------------------------------------------------------

_CHUNK = 1 << 20


def data_fingerprint(examples: Iterable[Example], spec: DatasetConfig | None = None) -> dict[str, Any]:
    """The training examples by content: {sha256, ids (sha256 of the ids in order), examples, loader, path}.

    Hashed: each example's id, question, answer, choices and metadata, and its images' bytes (a path's file read
    in chunks: the same bytes anywhere, at any mtime, hash the same; a file rewritten in place does not). Not
    hashed: the source (a loader may name it after the file's folder, so moved data would differ) and the
    paraphrases (the wordings may change at resume: `data.paraphrases` is free). `path` is
    `spec.path` resolved from this working directory (the API's datasets: the argument), for messages only."""
    content, ids, count = hashlib.sha256(), hashlib.sha256(), 0
    for ex in examples:
        fields = [ex.id, ex.question, ex.answer, ex.choices, ex.metadata]
        content.update(json.dumps(fields, sort_keys=True, default=_digest_value).encode() + b"\0")
        for image in ex.images:
            content.update(_image_digest(image) + b"\0")
        ids.update(ex.id.encode() + b"\0")
        count += 1
    record: dict[str, Any] = {"sha256": content.hexdigest(), "ids": ids.hexdigest(), "examples": count}
    if spec is not None:
        path = spec.path or spec.options.get("source")  # the API's datasets: "train_dataset"
        if spec.path is not None and Path(path).exists():
            path = str(Path(path).resolve())
        record.update(loader=spec.loader, path=path)
    return record


def _image_digest(image: object) -> bytes:
    if isinstance(image, bytes):
        return hashlib.sha256(image).digest()
    if isinstance(image, TableImage):  # the digest of the bytes it refers to, as when the record held them
        return cached_digest(image) or hashlib.sha256(image.read()).digest()
    if isinstance(image, (str, Path)) and Path(image).is_file():
        cached = cached_digest(image)  # the load's check read the file: its digest is cached
        if cached is not None:
            return cached
        digest = hashlib.sha256()
        with open(image, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                digest.update(chunk)
        return digest.digest()
    return hashlib.sha256(repr(image).encode()).digest()  # neither bytes nor a file: what the record holds


def _digest_value(value: object) -> str:
    """A metadata value json cannot write (bytes, a PIL image, an array) by its content."""
    if isinstance(value, bytes):
        return hashlib.sha256(value).hexdigest()
    if hasattr(value, "tobytes"):
        return hashlib.sha256(value.tobytes()).hexdigest() + str(getattr(value, "size", ""))
    return repr(value)


def record_data(run_dir: Path, record: dict) -> None:
    """Write the run's data record (`data_fingerprint`) into the run directory (world rank 0, at start)."""
    (Path(run_dir) / DATA_RECORD).write_text(json.dumps(record, indent=1) + "\n")


def check_resumed_data(state: dict, run_dir: Path, checkpoint: Path, record: dict) -> None:
    """Refuse to resume `checkpoint` on other data than it trained on (ConfigError on data.train, one line): the
    sampler's saved position indexes that data. The checkpoint's own record is compared, else the run
    directory's; a run from before data was recorded is resumed with a warning."""
    saved = state.get("data")
    if saved is None and (Path(run_dir) / DATA_RECORD).is_file():
        saved = json.loads((Path(run_dir) / DATA_RECORD).read_text())
    if saved is None:
        log.warning("%s holds no record of its data (an earlier version wrote it): the data is not checked", checkpoint)
        return
    if saved["sha256"] == record["sha256"]:
        return
    if saved["examples"] != record["examples"]:
        how = f"{saved['examples']} examples there, {record['examples']} now"
    elif saved["ids"] != record["ids"]:
        how = f"other example ids ({record['examples']} examples)"
    else:
        how = f"the same {record['examples']} example ids with other content (questions, answers, images or metadata)"
    raise ConfigError(
        [
            f"data.train changed since {checkpoint} was written: {how}; it trained on {_where(saved)}, this run "
            f"reads {_where(record)}. The sampler's saved position indexes the data the checkpoint trained on: put "
            "that data back to resume, or start a new run (another output_dir, or train.overwrite=true)"
        ],
        ["data.train"],
    )


def _where(record: dict) -> str:
    path = record.get("path")
    loader = f"loader {record.get('loader')!r}"
    return f"{path} ({loader})" if path else loader
