#!/usr/bin/env bash
# The one-shot device check for a lent GPU machine, within one 6-minute call: the install and every check (each in
# its own process) end within GPU_CHECK_CALL_S seconds (350 where nvidia-smi is, 900 on the CPU), the checks'
# --budget being what the install left less 20 s (Python's start, the header, the JSON); a check the budget left
# cannot cover is skipped, and the JSON's `rerun` holds the arguments for the next call. bench/gpu_check.py's
# JSON on stdout. On a machine without CUDA it runs the same checks on the CPU at a tiny size ("cpu fallback").
#
#     make gpu-bundle                    # here, where PyPI is: the wheels the check needs, into .gpu-bundle/
#     bash bench/gpu_check.sh            # there: installs .gpu-bundle/ (no index), then runs the check
#     bash bench/gpu_check.sh --only zero3,resume   # a rerun of some checks (the members kept from the first call)
#
# A --budget given here replaces the computed one, but the outer timeout stays: past it, no JSON.
#
# The GPU machine has Python 3.12, CUDA torch, transformers, accelerate, peft, safetensors and tokenizers, and
# no package index: when .gpu-bundle/ is there and the environment lacks what the check needs (deepspeed,
# math-verify, easy-vqa, a transformers this project admits), its wheels are installed with --no-index into
# .gpu-site/, which goes on PYTHONPATH after this working tree (so the working tree's code runs; the bundled
# project wheel only supplies its entry points). It never needs a network.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
CALL_S="${GPU_CHECK_CALL_S:-350}"
if ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=cpu CALL_S="${GPU_CHECK_CALL_S:-900}"; fi
needs='import deepspeed, math_verify, easy_vqa, qwen_vl_utils, transformers, peft, vlm_corl.registry
from importlib.metadata import entry_points
from vlm_corl.versions import version_checks  # the tested versions: one table, which preflight reads too
outside = [r["line"] for r in version_checks() if r["library"] in ("transformers", "peft") and not r["ok"]]
assert not outside, outside
assert entry_points(group="vlm_corl.families"), "this project is not installed"'
if ! "$PY" -c "$needs" 2>/dev/null; then
  if [ -d .gpu-bundle ]; then
    if [ ! -f .gpu-site/.installed ]; then
      rm -rf .gpu-site
      "$PY" -m pip install --quiet --no-index --no-deps --target .gpu-site .gpu-bundle/*.whl >&2
      touch .gpu-site/.installed
    fi
    export PYTHONPATH="$PWD:$PWD/.gpu-site${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  fi
fi
left=$((CALL_S - SECONDS))  # SECONDS: what the install took
exec timeout "$left" "$PY" bench/gpu_check.py --budget "$((left - 20))" "$@"  # a last resort: the checks keep to --budget
