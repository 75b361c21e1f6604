"""What each step does: the phases `training/loop.py` runs in order, each in its own module (render ahead,
rollout and extract, reward and resampling, update and sync, the log rows, the step's checkpoint, the in-loop
evaluation) and the phases' clock and progress bar. May import the other training rooms; none imports it but the
loop."""
