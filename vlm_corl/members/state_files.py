"""A member's state on disk, and its tensors by name: the files a member writes and reads (its optimizer and
schedule in `TRAINER_STATE`, read back onto the host), the error for one that cannot be read, and the
(name, tensor) stream that weights are saved, synced and checksummed from. The member (`member.py`) and its
DeepSpeed update (`deepspeed_update.py`) both stand on this room; the cohort checkpoint
(`vlm_corl.training.run.checkpoint`: the atomic step directory, the cohort state, resume) sits above them."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from pathlib import Path

import torch

from vlm_corl.errors import UserError

TRAINER_STATE = "trainer_state.pt"  # a trained member's optimizer and schedule
STEP_DIR = re.compile(r"step-(\d+)")  # a checkpoint's directory: RUN/checkpoints/step-N


class CheckpointError(UserError):
    """A checkpoint file that cannot be read (names the file and how to go on)."""


def read_state(path: Path, weights_only: bool = True) -> dict:
    """torch.load of a state file we wrote, onto the host (its tensors were saved from the writer's GPU: every
    rank of a member reads the same file, and `load_state_dict` moves each tensor to its parameter's device);
    a truncated or corrupt one is a CheckpointError naming it."""
    try:
        return torch.load(path, weights_only=weights_only, map_location="cpu")
    except Exception as err:  # noqa: BLE001 - pickle/zip/OS errors all mean "this file is unusable"
        if isinstance(err, MemoryError):
            raise
        raise corrupt_file(path, err) from err


def corrupt_file(path: Path, err: BaseException) -> CheckpointError:
    """The error for a file of a checkpoint (a state file, or a member's weights) that cannot be read: it names
    the file and says to move the checkpoint away and resume from the one before it."""
    path = Path(path)
    checkpoint = next((p for p in (path, *path.parents) if STEP_DIR.fullmatch(p.name)), path.parent)
    cause = err.__cause__ or err
    detail = (str(cause).splitlines() or [""])[0].split(". ")[0][:120]
    return CheckpointError(
        f"{path} cannot be read ({type(cause).__name__}: {detail}); it is truncated or corrupt. Move "
        f"{checkpoint} out of checkpoints/ to resume from the one before it"
    )


def named_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's parameters (each once, tied ones under their first name) and persistent buffers: what
    `load_state_dict` needs and vLLM's `load_weights` reads, by state-dict name."""
    for name, p in module.named_parameters():
        yield name, p.data
    yield from persistent_buffers(module)


def persistent_buffers(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A module's buffers that its state dict holds (non-persistent ones, such as rotary tables, are left out)."""
    keys = set(module.state_dict(keep_vars=True))  # non-persistent buffers (rotary tables) are left out
    return ((name, b) for name, b in module.named_buffers() if name in keys)


def host_copy(value: object) -> object:
    """A deep copy of a state (nested dicts, lists and tuples of tensors and plain values) with every tensor copied
    to the host: what a background checkpoint writes while training goes on. A CUDA tensor goes to pinned memory
    (the copy runs at the link's speed) and the device is synchronised once at the end; a host tensor is cloned,
    since the optimizer updates its own in place."""
    pinned = torch.cuda.is_available()
    copied = _host_copy(value, pinned)
    if pinned and torch.cuda.is_initialized():
        torch.cuda.synchronize()  # the non-blocking copies have landed before anyone reads them
    return copied


def _host_copy(value: object, pinned: bool) -> object:
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.device.type == "cpu":
            return t.clone()
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pinned)
        return out.copy_(t, non_blocking=pinned)
    if isinstance(value, dict):
        return {k: _host_copy(v, pinned) for k, v in value.items()}
    if isinstance(value, list):
        return [_host_copy(v, pinned) for v in value]
    if type(value) is tuple:
        return tuple(_host_copy(v, pinned) for v in value)
    return copy.deepcopy(value)
