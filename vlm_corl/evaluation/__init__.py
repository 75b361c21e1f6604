"""Evaluation: benchmarks, their scoring and the sandbox for model-written code. The command is
`python -m vlm_corl.eval`."""
