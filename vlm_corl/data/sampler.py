"""Lockstep data order: every member gets the same example indices, step after step, from one data seed."""

from __future__ import annotations

import torch

from vlm_corl.config.parse import ConfigError


class LockstepSampler:
    """Batches of example indices over epochs; each epoch is a fresh permutation of seed + epoch.

    A batch never crosses an epoch boundary: when fewer than `batch_size` examples are left in the epoch, they
    are dropped and the next epoch starts (a new permutation, so no example is left out for good when
    shuffling). A batch therefore never holds one example twice. Excluded examples (`exclude`: prompts too long
    for a member) are passed over. Dynamic sampling's extra questions (`draw`) come from the same stream. The
    whole state is (epoch, position, excluded): it goes into checkpoints, and a restored sampler continues with
    exactly the batches (and extra questions) the interrupted run would have drawn.
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
        self.excluded: set[int] = set()

    def _order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(self.num_examples))
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.num_examples, generator=gen).tolist()

    def next_batch(self) -> list[int]:
        """The next `batch_size` indices, all distinct and none excluded; advances the state."""
        return self._take(self.batch_size, set())

    def draw(self, n: int, avoid: set[int]) -> list[int]:
        """The next `n` indices of the stream that are neither excluded nor in `avoid` (a step's questions so far):
        extra questions for dynamic sampling (algo.resample_zero_variance). They advance the state like a batch
        (a resume continues after them); at most `available(avoid)`."""
        return self._take(n, avoid)

    def available(self, avoid: set[int]) -> int:
        """How many distinct indices `draw` can give while avoiding `avoid`."""
        return self.num_examples - len(self.excluded | avoid)

    def _take(self, n: int, avoid: set[int]) -> list[int]:
        """The next `n` indices of this epoch (or, when fewer are left, of the next) that are neither excluded
        nor in `avoid`; advances the state past them."""
        for _ in range(2):
            order, found, position = self._order(self.epoch), [], self.position
            while len(found) < n and position < self.num_examples:
                if order[position] not in self.excluded and order[position] not in avoid:
                    found.append(order[position])
                position += 1
            if len(found) == n:
                self.position = position
                return found
            self.epoch, self.position = self.epoch + 1, 0
        raise ConfigError(
            [
                f"only {self.num_examples - len(self.excluded)} of the {self.num_examples} training examples fit "
                f"rollout.max_prompt_tokens, fewer than data.batch_size={self.batch_size}: raise "
                "rollout.max_prompt_tokens or lower data.max_image_pixels"
            ],
            ["rollout.max_prompt_tokens"],
        )

    def exclude(self, batch: list[int], dropped: set[int]) -> list[int]:
        """Never draw `dropped` again, and `batch` with them replaced by the next indices of the stream."""
        self.excluded |= dropped
        kept = [i for i in batch if i not in dropped]
        return kept + self._take(len(batch) - len(kept), set(kept))

    def peek_batch(self) -> list[int]:
        """The batch `next_batch` will return, without advancing (for prefetching its rendering)."""
        saved = self.epoch, self.position
        batch = self.next_batch()
        self.epoch, self.position = saved
        return batch

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "num_examples": self.num_examples,
            "excluded": sorted(self.excluded),
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_examples"] != self.num_examples:
            raise ValueError(
                f"the checkpoint was taken on {state['num_examples']} training examples, the data now has "
                f"{self.num_examples}: resume with the same data (data.train.*) or start a new output_dir"
            )
        self.epoch, self.position = state["epoch"], state["position"]
        self.excluded = set(state.get("excluded", ()))
