#!/usr/bin/env bash
# One short device check (under 8 minutes) for a lent GPU machine; on a machine without CUDA it runs the same
# checks on the CPU ("cpu fallback"). Prints bench/gpu_check.py's JSON: HF engine tokens/s, a small 2-member
# cohort's step time and peak memory with bf16 autocast, and the same with DeepSpeed ZeRO-2 in one process.
#
#     bash bench/gpu_check.sh            # uses .venv if present, else the python3 on PATH
#
# The Python it runs needs this project's dependencies (torch, transformers, deepspeed, easy-vqa); no network.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=python3
[ -x .venv/bin/python ] && PY=.venv/bin/python
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
if ! command -v nvidia-smi >/dev/null 2>&1; then export DS_ACCELERATOR=cpu; fi
if ! "$PY" -c "import vlm_corl" 2>/dev/null; then export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"; fi
exec timeout 480 "$PY" bench/gpu_check.py "$@"
