"""The render phase: each hosted slot's prompts for its shard of the batch, the next batch rendered in a
background thread while this step rolls out and updates, and examples too long for any member agreed by every
rank and skipped for all (the cohort stays in lockstep)."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from vlm_corl.data.records import Example
from vlm_corl.members.render import PromptTooLong
from vlm_corl.training.run.setup import CohortRun
from vlm_corl.training.run.slots import owner

log = logging.getLogger("vlm_corl")


class RenderAhead:
    """The render phase with the next batch rendered (images decoded and preprocessed) in a background thread
    while this step rolls out and updates.

    An example whose prompt is longer than rollout.max_prompt_tokens for any member is skipped for every member
    (the cohort stays in lockstep): the ranks agree on such examples in the main thread, the sampler never draws
    them again and replaces them in this batch, and each is logged once and counted in summary.json."""

    def __init__(self, run: CohortRun):
        self.run, self.pending = run, None  # pending: (example indices, future of their render_phase)
        self.indices: list[int] = []  # the indices of the batch `prompts` gave last
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="render")

    def prompts(self, indices: list[int], step: int) -> tuple[list[Example], list[list]]:
        """This step's examples and prompts (`render_phase`), and the next step's started in the background.
        `self.indices`: the examples' indices (over-long ones replaced)."""
        ready = None
        if self.pending is not None:
            upcoming, future = self.pending
            rendered = future.result()  # the renderers are not thread-safe: the background render ends first
            ready = rendered if upcoming == indices else None  # stale when the sampler skipped examples since
        self.indices, batch, prompts = self._render(indices, ready)
        self._ahead(step)
        return batch, prompts

    def replacements(
        self, count: int, avoid: set[int], shards: dict[str, range], step: int
    ) -> tuple[list[int], list[Example], list[list]]:
        """`count` fresh examples for dynamic sampling, none of `avoid` (`LockstepSampler.draw`), their indices,
        examples and prompts for the positions `shards` give each member (over-long ones replaced as in a batch);
        the next step's batch then renders again in the background (the draws moved the stream on)."""
        if self.pending is not None:
            self.pending[1].result()  # the renderers are not thread-safe: the background render ends first
        indices, batch, prompts = self._render(self.run.sampler.draw(count, avoid), None, shards)
        self._ahead(step)
        return indices, batch, prompts

    def _render(
        self, indices: list[int], ready: tuple | None, shards: dict[str, range] | None = None
    ) -> tuple[list[int], list[Example], list[list]]:
        """Render `indices` (or take `ready`, their background render) until no prompt is too long for a member:
        such examples are agreed by every rank, never drawn again and replaced by the next of the stream."""
        run = self.run
        while True:
            batch = [run.examples[i] for i in indices]
            if ready is None:  # (the batch's render is called as in the background: with the run's shards)
                ready = render_phase(run, batch) if shards is None else render_phase(run, batch, shards)
            (prompts, too_long), ready = ready, None
            dropped = _agree_too_long(run, [(indices[p], *rest) for p, *rest in too_long])
            if not dropped:
                break
            indices = run.sampler.exclude(indices, dropped)
        return indices, batch, prompts

    def _ahead(self, step: int) -> None:
        """Start rendering the batch after `step` (0-based) in the background, if there is a next step."""
        run, self.pending = self.run, None
        if step + 1 < run.cfg.train.max_steps:
            upcoming = run.sampler.peek_batch()
            self.pending = (upcoming, self.pool.submit(render_phase, run, [run.examples[i] for i in upcoming]))

    def close(self) -> None:
        """Wait for the background render and end its thread (again: nothing to do)."""
        self.pool.shutdown()


def render_phase(
    run: CohortRun, batch: list[Example], shards: dict[str, range] | None = None
) -> tuple[list[list], list[tuple[int, str, int]]]:
    """Each hosted slot's prompts for its member's shard of the batch (`shards`: other positions, a round of
    dynamic sampling's), and (batch position, member, tokens) of those longer than rollout.max_prompt_tokens
    (their place in the prompts holds None)."""
    shards = run.shards if shards is None else shards
    prompts, too_long = [], []
    for s in run.slots:
        mine = []
        for p in shards[owner(s)]:
            try:
                mine.append(s.renderer(batch[p]))
            except PromptTooLong as err:
                mine.append(None)
                too_long.append((p, err.member, err.tokens))
        prompts.append(mine)
    return prompts, too_long


def _agree_too_long(run: CohortRun, found: list[tuple[int, str, int]]) -> set[int]:
    """The example indices some rank found too long for one of its members ((index, member, tokens) here),
    the same set on every rank; new ones are logged and kept for summary.json."""
    merged = {i: (member, tokens) for part in run.world.all_gather(found) for i, member, tokens in part}
    for i, (member, tokens) in sorted(merged.items()):
        if run.world.is_main and run.examples[i].id not in run.too_long:
            log.warning(
                "example %r renders to %d tokens for member %s, over rollout.max_prompt_tokens=%d: skipped for "
                "every member (%d so far; raise rollout.max_prompt_tokens or lower data.max_image_pixels to keep "
                "such examples)",
                run.examples[i].id,
                tokens,
                member,
                run.cfg.rollout.max_prompt_tokens,
                len(run.too_long) + 1,
            )
        run.too_long[run.examples[i].id] = {"member": member, "tokens": tokens}
    return set(merged)
