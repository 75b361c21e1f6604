"""Co-RL: label-free reinforcement learning of model cohorts (the shared cohort core + vision-language parts)."""

__version__ = "0.1.0"
