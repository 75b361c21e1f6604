"""Rollout engines behind `vlm_corl.rollout.RolloutEngine`: `hf` (Hugging Face generate) and `vllm` (lazy)."""
