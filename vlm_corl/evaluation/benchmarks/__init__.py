"""The paper's multimodal math benchmarks, read from their official releases: MathVista, MathVerse, MATH-Vision
and We-Math (one module each; `common` holds what they share: finding and reading the release, the hub
fallback, the choice list in the prompt, the grader and per-metadata breakdowns).

Each module defines a loader (the `vlm_corl.loaders` entry points) and a `vlm_corl.evaluation.scoring.Benchmark` (the
`vlm_corl.benchmarks` entry points), so `python -m vlm_corl.eval --benchmarks mathvista --data
mathvista=PATH` works without importing this package first. Decoding is greedy (temperature 0), as the paper
evaluates multimodal benchmarks.
"""
