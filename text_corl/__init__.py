"""Text-only parts of the Co-RL trainer (LLM families, text benchmarks, prompt styles), built on `vlm_corl`."""
