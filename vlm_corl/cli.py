"""How every command ends: its result, or one line for a user mistake (exit 2), or one for Ctrl-C (exit 130).

A `UserError` (bad config, data, model files, paths, launch) is the user's to fix: its message names the
file or field and what to do, and no traceback is printed (tracebacks are for our bugs). `--debug` or
VLM_CORL_DEBUG=1 re-raises it with the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from vlm_corl.errors import Interrupted, UserError, debug_requested

# The command line a `corl NAME` run was given as (set by `vlm_corl.commands.main` while NAME runs): its usage line
# names it instead of the module's own `python -m ...` name.
invoked_as: str | None = None


def parser(prog: str, doc: str | None, **kwargs: Any) -> argparse.ArgumentParser:
    """An argument parser whose description is the first paragraph of `doc`, with the `--debug` flag; its usage
    line names `prog`, or `corl NAME` when the command was run so."""
    description = kwargs.pop("description", (doc or "").split("\n\n")[0])
    p = argparse.ArgumentParser(prog=invoked_as or prog, description=description, **kwargs)
    p.add_argument("--debug", action="store_true", help="show the traceback of a user error (also VLM_CORL_DEBUG=1)")
    return p


def run(main: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Call `main(argv)`; a user mistake prints `error: …` on stderr and returns 2, Ctrl-C returns 130."""
    args = list(sys.argv[1:] if argv is None else argv)
    try:
        code = main(args)
    except UserError as err:
        if debug_requested("--debug" in args):
            raise
        print(f"error: {err}", file=sys.stderr)
        return 2
    except Interrupted as err:  # during training: names the checkpoint to resume from
        print(err, file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C)", file=sys.stderr)
        return 130
    return code if isinstance(code, int) else 0


def parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """`parser.parse_args(argv)`, then quiet the libraries' bars. A command imports torch and transformers only
    after this, so `--help` and argument mistakes answer at once (~0.15 s, against 2-7 s with torch loaded)."""
    args = parser.parse_args(None if argv is None else negative_values_joined(parser, argv))
    quiet_library_bars()
    return args


def negative_values_joined(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """`--opt -80GB` as `--opt=-80GB` for an option that takes one value: argparse reads a value that starts
    with '-' and is not a plain number as the next option and answers "expected one argument", while the
    option's own type check names what is wrong with the value (a size must be positive, ...)."""
    out, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        action = parser._option_string_actions.get(arg)  # argparse has no public table of its options
        if action is not None and action.nargs is None and rest and re.match(r"-\.?[0-9]", rest[0]):
            arg = f"{arg}={rest.pop(0)}"
        out.append(arg)
    return out


def quiet_library_bars() -> None:
    """Turn off transformers' per-file load/save bars (one per model loaded), which drown our own.

    Before transformers is imported this is the hub's switch, which transformers reads when it loads (importing
    it here would cost a command that never needs it ~1 s); after, transformers' own."""
    if "transformers" not in sys.modules:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        return
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def _int_at_least(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"must be at least {minimum} (got {value})")
    return value


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (counts, limits, steps, sizes)."""
    return _int_at_least(text, 1)


def non_negative_int(text: str) -> int:
    """argparse type: an integer of at least 0 (offsets, skips)."""
    return _int_at_least(text, 0)


def positive_float(text: str) -> float:
    """argparse type: a finite number above 0 (temperatures, scales)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (0 < value < float("inf")):  # also refuses nan, which every comparison fails
        raise argparse.ArgumentTypeError(f"must be a finite number above 0 (got {text})")
    return value


def device(text: str):
    """argparse type: a torch device this machine has ("cpu", "cuda", "cuda:1"); asking for CUDA where there is
    none, or a GPU index past the last, is a usage error naming the devices there are."""
    import torch

    try:
        dev = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has no CUDA device (torch sees none); use cpu")
        if dev.index is not None and dev.index >= count:
            raise argparse.ArgumentTypeError(f"{text!r}: this machine has {count} CUDA device(s), cuda:0..{count - 1}")
    return dev


@contextlib.contextmanager
def kept_if_written(path: str | Path, flag: str) -> Iterator[Path]:
    """`output_dir(path, flag)` for a command's body: a directory this made is removed again when the body fails
    before writing anything into it (no empty --out left behind by a failed command)."""
    existed = Path(path).exists()
    out = output_dir(path, flag)
    try:
        yield out
    except BaseException:
        if not existed and out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        raise


def output_dir(path: str | Path, flag: str) -> Path:
    """Create the output directory `path` now (before any expensive work) and return it; a path that is a file
    or cannot be written is a UserError naming `flag`."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} is a file; give a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as err:
        raise UserError(f"{flag} {path} cannot be written ({err.strerror or err}); choose another directory") from err
    return path
