"""Rollout engines behind `vlm_corl.members.rollout.RolloutEngine`: `hf` (Hugging Face generate) and `vllm` (lazy)."""
