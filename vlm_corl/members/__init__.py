"""A cohort member and what acts on it: loading, rendering, rollout engines, batching, the update
(plain or DeepSpeed) and the model families."""
