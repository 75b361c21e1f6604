"""The training room: `loop.py` runs each step as a row of named phases; its sub-rooms hold the work, each
importing only the rooms below it (tests/test_layering.py):

- `phases/`   what each step does (render, rollout, reward, update, log, checkpoint, eval)
- `run/`      a run's life (start, slots, checkpoints, the guards, summary.json, release, users' hooks)
- `monitor/`  what a run records and watches (metrics, trackers, samples, the collapse detector)
- `rewards/`  where rewards and advantages come from (reward modes, reward functions, GRPO, dynamic sampling)
"""
