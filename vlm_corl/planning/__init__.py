"""The cohort memory planner: will a cohort fit its GPUs, and what layout would (`python -m vlm_corl.plan`).

- `shapes`: a model's sizes from its config.json alone (parameters on the meta device, dimensions); a plan reads
  each member's once at its start (`cohort_shapes`) and passes those `Shapes` down to every part below;
- `estimates`: pure byte estimates of activations, logits, KV caches and DeepSpeed's buffers;
- `layout`: a member's layout read from the config (ZeRO settings, states layout, dtypes, trained parameters);
- `cohort`: the per-rank plan of a cohort on given hardware, by phase (resident, rollout, update, step), with
  `engines` (each vLLM engine's share, and the smallest KV cache of every engine slot over the ranks), `host`
  (host memory per node) and `disk` (the checkpoints' disk);
- `fixes`: the changes that would make a plan fit, each planned again; `suggest`: the cheapest layout that fits;
- `render`: the plan as text; `check`: `train`'s memory and disk checks before any model loads; `tables`: the
  docs' figures.
The states arithmetic itself (bytes per parameter by layout) is `vlm_corl.members.memory`.
"""
