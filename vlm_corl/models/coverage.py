"""Which architectures a member can be: `python -m vlm_corl.coverage --out docs/models.md`.

One row per architecture the installed transformers loads with `AutoModelForImageTextToText` or
`AutoModelForCausalLM`: the family that serves it (a registered one, or generic), whether `zoo --arch` builds a tiny
member of it offline that runs a rendered prompt (else why not), whether this repository's tests run it, whether the
installed vLLM serves it (`--vllm-python`: a Python with vLLM; its registry is read there), and the LoRA target
modules (`vlm_corl.members.lora.LM_PROJECTIONS`) found in its language model. tests/test_generic_family.py checks
that the table lists exactly the architectures the installed transformers knows.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vlm_corl import cli

HEADER = ("architecture", "modality", "served by", "zoo --arch", "tested here", "vLLM", "LoRA targets found")


@dataclass
class Row:
    """One architecture's coverage."""

    arch: str
    modality: str
    served_by: str
    zoo: str  # "builds" or "no: <why>"
    tested: str
    vllm: str
    lora: str

    def cells(self) -> tuple[str, ...]:
        return (self.arch, self.modality, self.served_by, self.zoo, self.tested, self.vllm, self.lora)


def architectures() -> dict[str, tuple[str, str]]:
    """{model_type: (modality, model class name)} of every architecture the Auto classes load (vision first)."""
    from transformers.models.auto import modeling_auto

    found = {t: ("vision", c) for t, c in modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()}
    for t, c in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        found.setdefault(t, ("text", c))
    return dict(sorted(found.items()))


def tested_architectures() -> set[str]:
    """The model types this repository's tests run: the registered families' zoo members and the generic ones."""
    import vlm_corl.members.families  # noqa: F401  (registers the vision families)
    from vlm_corl.members.families.generic import TESTED_GENERIC
    from vlm_corl.registry import FAMILIES

    registered = {t for name in FAMILIES.names() for t in FAMILIES.get(name).model_types[:1]}
    return registered | set(TESTED_GENERIC)


def vllm_architectures(python: str | None) -> set[str] | None:
    """The model classes the vLLM installed for `python` serves, or None when none is given or it has no vLLM."""
    if not python:
        return None
    code = (
        "from vllm.model_executor.models.registry import ModelRegistry as R; print('\\n'.join(R.get_supported_archs()))"
    )
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=600)
    return set(done.stdout.split()) if done.returncode == 0 else None


def coverage_row(arch: str, modality: str, model_class: str, tested: set[str], vllm: set[str] | None) -> Row:
    """Build `arch` tiny in a temporary directory and read off its row."""
    from vlm_corl.members.families.base import family_for_model_type

    try:
        family = family_for_model_type(arch)
    except ValueError:
        family = None
    if family is None:
        zoo, lora = _build(arch)
    else:  # the family's own zoo builds it (`zoo --families NAME`)
        zoo, lora = (
            f"zoo --families {family.name}",
            _lora_targets(family.build_config("tiny", family.build_tokenizer())),
        )
    in_vllm = "?" if vllm is None else ("yes" if model_class in vllm else "no")
    return Row(
        arch, modality, family.name if family else "generic", zoo, "yes" if arch in tested else "", in_vllm, lora
    )


def _build(arch: str) -> tuple[str, str]:
    """("builds" or "no: why", the LoRA targets found) of a tiny `arch` member."""
    import transformers

    from vlm_corl.models.arch import build_arch

    with tempfile.TemporaryDirectory() as out:
        try:
            build_arch(arch, out)
        except Exception as err:  # noqa: BLE001 - every failure is a row's reason, not a crash of the table
            return "no: " + " ".join(str(err).split())[:160].replace("|", "/"), ""
        config = transformers.AutoConfig.from_pretrained(out)
    return "builds", _lora_targets(config)


def _lora_targets(config) -> str:
    """The default LoRA target modules (`LM_PROJECTIONS`) found in the language model of a `config` model."""
    import torch
    import transformers

    from vlm_corl.members.families.generic import auto_class_for
    from vlm_corl.members.lora import LM_PROJECTIONS, in_vision_tower

    with torch.device("meta"):
        model = getattr(transformers, auto_class_for(config.model_type)[1]).from_config(config)
    names = {
        n.rsplit(".", 1)[-1]
        for n, m in model.named_modules()
        if isinstance(m, torch.nn.Linear) and not in_vision_tower(n)
    }
    return " ".join(p for p in LM_PROJECTIONS if p in names) or "none of the defaults: name them"


VLLM_COLUMN = (  # what the vLLM column means
    "*vLLM* yes means the installed vLLM has a model class for the architecture. Members of a registered "
    "family roll out on it (the vLLM lane tests each). A generic member does only where vLLM's weight loader "
    "takes the names transformers gives its weights: tested here, Idefics3 is served and LLaVA-OneVision is "
    "refused when its engine is built (transformers 5 renamed its vision tower's weights); generic text "
    "members are refused (vLLM 0.32 rewrites their transformers classes). A refused member rolls out with "
    "`engine: hf` (docs/families.md)."
)


def render(rows: list[Row], transformers_version: str, vllm_known: bool) -> str:
    """docs/models.md: counts, then the table."""
    counts = _counts(rows)
    lines = [
        "# Which models can be members",
        "",
        f"Generated by `python -m vlm_corl.coverage --out docs/models.md` against transformers {transformers_version}"
        + ("" if vllm_known else " (vLLM column not checked: pass --vllm-python)")
        + ". Every architecture below loads with `AutoModelForImageTextToText` or `AutoModelForCausalLM`; a"
        " checkpoint of one with no registered family is served by the **generic** family from its own processor"
        " and chat template (docs/families.md says when a specialised family is worth writing).",
        "",
        f"- served by a registered family: {counts['registered']}",
        f"- served generically and tested here: {counts['generic tested']}",
        f"- served generically, `zoo --arch` builds a tiny member, untested beyond that: {counts['generic builds']}",
        f"- `zoo --arch` cannot build one offline (a real checkpoint may still load generically): {counts['no zoo']}",
        "",
        "`zoo --arch` *builds* means: a tiny random member with an offline processor renders an image prompt through"
        " its chat template and runs it through the model's forward. *no* gives the reason (most often a processor"
        " that needs files only a real checkpoint has, or a model that is not a chat VLM).",
        "",
        VLLM_COLUMN,
        "",
        "| " + " | ".join(HEADER) + " |",
        "|" + "---|" * len(HEADER),
    ]
    lines += ["| " + " | ".join(row.cells()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _counts(rows: list[Row]) -> dict[str, int]:
    generic = [r for r in rows if r.served_by == "generic"]
    return {
        "registered": sum(r.served_by != "generic" for r in rows),
        "generic tested": sum(r.tested == "yes" for r in generic),
        "generic builds": sum(r.zoo == "builds" and r.tested != "yes" for r in generic),
        "no zoo": sum(r.zoo != "builds" for r in generic),
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: writes the table (and prints the counts as JSON)."""
    import transformers
    from transformers.utils import logging as hf_logging

    parser = cli.parser("python -m vlm_corl.coverage", __doc__)
    parser.add_argument("--out", required=True, help="the Markdown file to write (docs/models.md)")
    parser.add_argument("--vllm-python", help="a Python interpreter with vLLM installed (e.g. .venv-vllm/bin/python)")
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    args = cli.parse(parser, argv)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    vllm = vllm_architectures(args.vllm_python)
    tested = tested_architectures()
    only = set(args.only.split(",")) if args.only else None
    chosen = {a: v for a, v in architectures().items() if only is None or a in only}
    # Rows done so far, kept beside the output: a rerun (after a crash or an interrupt) skips them.
    cache = Path(args.out).with_name(f".{Path(args.out).name}.rows.jsonl")
    done = {r["arch"]: Row(**r) for r in map(json.loads, cache.read_text().splitlines())} if cache.exists() else {}
    rows = []
    for n, (arch, (modality, cls)) in enumerate(chosen.items(), 1):
        row = done.get(arch) or coverage_row(arch, modality, cls, tested, vllm)
        if arch not in done:
            with cache.open("a") as f:
                f.write(json.dumps(vars(row)) + "\n")
        print(f"[{n}/{len(chosen)}] {arch}: {row.zoo[:60]}", file=sys.stderr, flush=True)
        rows.append(row)
    Path(args.out).write_text(render(rows, transformers.__version__, vllm is not None))
    cache.unlink()
    print(json.dumps(_counts(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(cli.run(main))
