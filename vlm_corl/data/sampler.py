"""Lockstep data order: every member gets the same example indices, step after step, from one data seed."""

from __future__ import annotations

import torch

from vlm_corl.config.parse import ConfigError


class LockstepSampler:
    """Batches of example indices over epochs; each epoch is a fresh permutation of seed + epoch.

    A batch never crosses an epoch boundary: when fewer than `batch_size` examples are left in the epoch, they
    are dropped and the next epoch starts (a new permutation, so no example is left out for good when
    shuffling). A batch therefore never holds one example twice. The whole state is (epoch, position): it goes
    into checkpoints, and a restored sampler continues with exactly the batches the interrupted run would
    have drawn.
    """

    def __init__(self, num_examples: int, batch_size: int, seed: int, shuffle: bool = True):
        if num_examples < 1:
            raise ValueError("no training examples to sample from")
        if batch_size > num_examples:
            raise ConfigError(
                [
                    f"data.batch_size={batch_size} is larger than the {num_examples} training examples: a batch would "
                    "hold an example twice; lower data.batch_size or give more data (data.train.limit)"
                ],
                ["data.batch_size"],
            )
        self.num_examples, self.batch_size, self.seed, self.shuffle = num_examples, batch_size, seed, shuffle
        self.epoch, self.position = 0, 0

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_examples))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_examples, generator=gen).tolist()

    def next_batch(self) -> list[int]:
        """The next `batch_size` indices, all distinct; advances the state."""
        if self.position + self.batch_size > self.num_examples:
            self.epoch, self.position = self.epoch + 1, 0
        batch = self._order(self.epoch)[self.position : self.position + self.batch_size]
        self.position += self.batch_size
        return batch

    def peek_batch(self) -> list[int]:
        """The batch `next_batch` will return, without advancing (for prefetching its rendering)."""
        saved = self.epoch, self.position
        batch = self.next_batch()
        self.epoch, self.position = saved
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position, "num_examples": self.num_examples}

    def load_state_dict(self, state: dict) -> None:
        if state["num_examples"] != self.num_examples:
            raise ValueError(
                f"the checkpoint was taken on {state['num_examples']} training examples, the data now has "
                f"{self.num_examples}: resume with the same data (data.train.*) or start a new output_dir"
            )
        self.epoch, self.position = state["epoch"], state["position"]
