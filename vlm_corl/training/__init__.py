"""The training loop and its maths: the loop of named phases, slots (who rolls out and who labels),
rewards and topologies, GRPO, metrics, the collapse detector and the guard."""
