"""The cohort memory planner: will a cohort fit its GPUs, and what layout would (`python -m vlm_corl.plan`).

- `shapes`: a model's sizes from its config.json alone (parameters on the meta device, dimensions);
- `estimates`: pure byte estimates of activations, logits, KV caches and DeepSpeed's buffers;
- `cohort`: the per-rank plan of a cohort on given hardware, by phase (resident, rollout, update);
- `fixes`: the changes that would make a plan fit, each planned again; `suggest`: the cheapest layout that fits;
- `render`: the plan as text; `check`: `train`'s check before any model loads; `tables`: the docs' figures.
The states arithmetic itself (bytes per parameter by layout) is `vlm_corl.members.memory`.
"""
