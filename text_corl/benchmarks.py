"""Text benchmarks, found by `vlm_corl.registry.BENCHMARKS` through the `vlm_corl.benchmarks` entry points."""

from text_corl.code import grade_humaneval, grade_mbpp
from text_corl.livecodebench import accuracy_by_platform, grade_livecodebench
from vlm_corl.evaluation.scoring import Benchmark

# The paper samples text benchmarks at T=0.6, top-p 0.95, and grades the last \boxed{}. The data is the copy
# shipped in text_corl/datasets/math500 unless a path is given (`python -m vlm_corl.eval … --data math500=DIR`).
MATH500 = Benchmark("math500", "math500", "test", temperature=0.6, top_p=0.95, max_new_tokens=1024)

# No copy ships for these: give the official release with `--data NAME=PATH` (or a YAML benchmark file).
GSM8K = Benchmark("gsm8k", "gsm8k", "test", temperature=0.6, top_p=0.95, max_new_tokens=1024)
AMC23 = Benchmark("amc23", "amc23", "test", temperature=0.6, top_p=0.95, max_new_tokens=2048, metric="avg@8", samples=8)
# CHAMP from the champ-dataset package: answers rewritten to their comparable form (text_corl.data.champ_answer),
# graded by math-verify, the free-text ones ("No integer solutions") by normalised string match; per category.
CHAMP = Benchmark("champ", "champ", "test", temperature=0.6, top_p=0.95, max_new_tokens=2048, category="category")
GPQA_DIAMOND = Benchmark(
    "gpqa_diamond",
    "gpqa",
    "diamond",
    temperature=0.6,
    top_p=0.95,
    max_new_tokens=2048,
    answer_type="choice",
    category="domain",
)

# Code: pass@1 at T=0.6 (one sample) by running the program against the tests in vlm_corl.evaluation.sandbox.
HUMANEVAL = Benchmark(
    "humaneval",
    "humaneval",
    "test",
    temperature=0.6,
    top_p=0.95,
    max_new_tokens=1024,
    prompt_style="code",
    grade=grade_humaneval,
    metric="pass@1",
)
MBPP = Benchmark(
    "mbpp",
    "mbpp",
    "test",
    temperature=0.6,
    top_p=0.95,
    max_new_tokens=1024,
    prompt_style="code",
    grade=grade_mbpp,
    metric="pass@1",
)

# LiveCodeBench v6: code_generation_lite release_v6 (`--data livecodebench=DIR` of its test*.jsonl files), problems
# whose contest_date is in 2025-02-01 .. 2025-05-01, the window reported as "LiveCodeBench v6"; accuracy per
# difficulty and (under "aggregate") per platform.
LIVECODEBENCH = Benchmark(
    "livecodebench",
    "livecodebench",
    "release_v6",
    temperature=0.6,
    top_p=0.95,
    max_new_tokens=2048,
    prompt_style="code",
    grade=grade_livecodebench,
    metric="pass@1",
    options={"start_date": "2025-02-01", "end_date": "2025-05-01"},
    category="difficulty",
    aggregate=accuracy_by_platform,
)
