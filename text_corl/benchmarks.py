"""Text benchmarks, found by `vlm_corl.registry.BENCHMARKS` through the `vlm_corl.benchmarks` entry points."""

from text_corl.code import grade_humaneval, grade_mbpp
from vlm_corl.eval import Benchmark

# The paper samples text benchmarks at T=0.6, top-p 0.95, and grades the last \boxed{}. The data is the copy
# shipped in text_corl/datasets/math500 unless a path is given (`python -m vlm_corl.eval … --data math500=DIR`).
MATH500 = Benchmark("math500", "math500", "test", temperature=0.6, top_p=0.95, max_new_tokens=1024)

# No copy ships for these: give the official release with `--data NAME=PATH` (or a YAML benchmark file).
GSM8K = Benchmark("gsm8k", "gsm8k", "test", temperature=0.6, top_p=0.95, max_new_tokens=1024)
AMC23 = Benchmark("amc23", "amc23", "test", temperature=0.6, top_p=0.95, max_new_tokens=2048, metric="avg@8",
                  samples=8)
GPQA_DIAMOND = Benchmark("gpqa_diamond", "gpqa", "diamond", temperature=0.6, top_p=0.95, max_new_tokens=2048,
                         answer_type="choice", category="domain")

# Code: pass@1 at T=0.6 (one sample) by running the program against the tests in vlm_corl.sandbox.
HUMANEVAL = Benchmark("humaneval", "humaneval", "test", temperature=0.6, top_p=0.95, max_new_tokens=1024,
                      prompt_style="code", grade=grade_humaneval, metric="pass@1")
MBPP = Benchmark("mbpp", "mbpp", "test", temperature=0.6, top_p=0.95, max_new_tokens=1024, prompt_style="code",
                 grade=grade_mbpp, metric="pass@1")
