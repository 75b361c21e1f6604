"""Text benchmarks, found by `vlm_corl.registry.BENCHMARKS` through the `vlm_corl.benchmarks` entry points."""

from vlm_corl.eval import Benchmark

# The paper samples text benchmarks at T=0.6, top-p 0.95, and grades the last \boxed{}. The data path is
# given at evaluation time (`python -m vlm_corl.eval … --data math500=../shared/data/math500`).
MATH500 = Benchmark("math500", "math500", "test", temperature=0.6, top_p=0.95, max_new_tokens=1024)
