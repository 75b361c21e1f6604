"""A prompt longer than rollout.max_prompt_tokens (a large image, a long question) is skipped for every member
and counted, not fatal hours into a run; the defaults agree (the prompt limit holds an image at the image cap)."""

from __future__ import annotations

import io
import json
from types import SimpleNamespace

import pytest
import torch
from cohort_helpers import cohort, metrics, on_ranks
from PIL import Image
from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

from vlm_corl.config import MemberConfig, config_from_dict
from vlm_corl.config.schema import MAX_IMAGE_PIXELS, MAX_PROMPT_TOKENS
from vlm_corl.data.loaders import load_examples
from vlm_corl.data.records import Example
from vlm_corl.data.sampler import LockstepSampler
from vlm_corl.distributed.world import World, shard
from vlm_corl.members.member import load_member
from vlm_corl.members.render import PromptTooLong, Renderer
from vlm_corl.training.loop import run_cohort
from vlm_corl.training.phases.render_ahead import RenderAhead, _agree_too_long


def test_excluded_examples_are_replaced_from_the_stream_and_survive_a_resume():
    sampler = LockstepSampler(10, 4, seed=0)
    first = sampler.next_batch()
    batch = sampler.exclude(first, {first[1], first[3]})
    assert len(batch) == 4 and len(set(batch)) == 4 and first[1] not in batch and first[3] not in batch
    assert batch[:2] == [first[0], first[2]]
    restored = LockstepSampler(10, 4, seed=0)
    restored.load_state_dict(sampler.state_dict())
    for _ in range(6):  # across epochs: never an excluded example, the same batches as the original
        got, want = restored.next_batch(), sampler.next_batch()
        assert got == want and not {first[1], first[3]} & set(got)


def test_the_prompt_limit_holds_a_qwen_vl_image_at_the_image_cap(tiny_zoo):
    """Qwen-VL reads one token per 28x28 pixels: at data.max_image_pixels that is 1280 image tokens, which
    rollout.max_prompt_tokens must hold with the question (the old 1024 did not: a run died at its first large
    image). Rendered here with the released Qwen2-VL processor settings through qwen-vl-utils' resize."""
    assert MAX_IMAGE_PIXELS // (28 * 28) + 512 <= MAX_PROMPT_TOKENS
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), trainable=False))
    released = dict(patch_size=14, merge_size=2, temporal_patch_size=2)
    pixels = {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 16384}  # Qwen2-VL's preprocessor_config.json
    member.processor = Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(size=pixels, **released),
        video_processor=Qwen2VLVideoProcessor(size=pixels, **released),
        tokenizer=member.tokenizer,
        chat_template=member.tokenizer.chat_template,
    )
    photo = io.BytesIO()
    Image.new("RGB", (4032, 3024), (200, 30, 30)).save(photo, format="JPEG")  # a phone photo's size
    question = "What colour is the whole picture? " * 20
    example = Example("big", question, images=(photo.getvalue(),))
    prompt = Renderer(member, "original", MAX_IMAGE_PIXELS, MAX_PROMPT_TOKENS)(example)
    width, height = prompt.images[0].size
    assert width % 28 == height % 28 == 0 and width * height <= MAX_IMAGE_PIXELS  # on the patch grid, capped
    image_tokens = int((prompt.inputs["input_ids"] == member.tokenizer.image_token_id).sum())
    assert image_tokens == width * height // (28 * 28) and 1200 < image_tokens <= 1280
    assert prompt.inputs["input_ids"].shape[1] <= MAX_PROMPT_TOKENS


def test_examples_too_long_for_a_member_are_skipped_for_all_and_counted(tiny_zoo, tmp_path):
    members = [("qwen", tiny_zoo["qwen3"]), ("llama", tiny_zoo["llama"])]
    data = {"train": {"loader": "math500", "split": "test", "limit": 40}, "batch_size": 4}
    examples = load_examples("math500", split="test", limit=40).examples
    render = Renderer(load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]))), "original", 1, 1 << 30)
    lengths = {ex.id: render(ex).inputs["input_ids"].shape[1] for ex in examples}
    limit = int(torch.tensor(sorted(lengths.values()), dtype=torch.float).quantile(0.75))
    cfg = cohort(tmp_path, members, data=data)
    cfg["rollout"]["max_prompt_tokens"] = limit
    cfg["train"]["max_steps"] = 4
    run_cohort(config_from_dict(cfg))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    skipped = summary["data"]["skipped"].get("prompt_too_long", 0)
    assert skipped >= 1
    for line in summary["data"]["skipped_examples"]["prompt_too_long"]:
        example_id, rest = line.split(": ", 1)
        assert lengths[example_id] > limit or int(rest.split()[0]) > limit  # too long for qwen, or for llama
    rows = metrics(tmp_path / "run")
    assert sorted({r["step"] for r in rows}) == [1, 2, 3, 4]  # every step ran, on full batches


# ---- the exact limit, the replacements in order, and the ranks' agreement (issue 32, item 9) --------------------

QUESTION = "What is two plus two?"  # one token more for each " the" (the zoo's tokenizer): lengths L, L+1, L+2


def test_a_prompt_of_exactly_max_prompt_tokens_is_kept_and_one_token_more_is_refused(tiny_zoo):
    """Pins `length > max_prompt_tokens` in `Renderer.render` (the bug: `>=`, which refuses a prompt that fits)."""
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]), trainable=False))
    length = Renderer(member, "original", 1, 1 << 30)(Example("a", QUESTION)).inputs["input_ids"].shape[1]
    assert Renderer(member, "original", 1, length)(Example("a", QUESTION)).inputs["input_ids"].shape[1] == length
    with pytest.raises(PromptTooLong) as err:
        Renderer(member, "original", 1, length - 1)(Example("a", QUESTION))
    assert (err.value.member, err.value.tokens) == ("q", length)


def test_excluded_examples_are_replaced_by_the_next_ones_of_the_stream_in_order():
    """In index order (shuffle off): the kept examples stay in their places, the replacements are the stream's
    next examples in order, never an example of the batch again nor an excluded one, across the epoch boundary
    too. Pins `LockstepSampler.exclude`/`_take` (the bugs: replacements first, a replacement repeating a kept
    example, excluded examples drawn again in a later epoch)."""
    sampler = LockstepSampler(10, 4, seed=0, shuffle=False)
    assert sampler.exclude(sampler.next_batch(), {1, 3}) == [0, 2, 4, 5]
    assert sampler.next_batch() == [6, 7, 8, 9]
    assert sampler.exclude([6, 7, 8, 9], {7}) == [6, 8, 9, 0]  # epoch 0 is spent: the replacement opens epoch 1
    assert sampler.next_batch() == [2, 4, 5, 6]  # epoch 1 goes on after 0, without 1, 3 and 7
    assert sampler.next_batch() == [0, 2, 4, 5]  # epoch 2 (8, 9 and 6 were left over)
    assert sampler.excluded == {1, 3, 7}
    shuffled = LockstepSampler(6, 2, seed=0)  # epoch 0: 2 5 3 0 1 4; epoch 1: 1 5 2 0 3 4
    assert [shuffled.next_batch() for _ in range(3)] == [[2, 5], [3, 0], [1, 4]]
    assert shuffled.exclude([1, 4], {4}) == [1, 5]  # epoch 1 opens with 1, which the batch holds: 5 replaces 4
    assert shuffled.next_batch() == [2, 0]


def _render_run(member, limit: int, lengths: list[int], batch_size: int, world: World, max_steps: int = 1):
    """What `RenderAhead` reads of a run: one slot of `member` rendering examples whose prompts are L + lengths[i]
    tokens (L: QUESTION's) under rollout.max_prompt_tokens = `limit`, this rank's shard of the batch."""
    examples = [Example(f"e{i}", QUESTION + " the" * extra) for i, extra in enumerate(lengths)]
    slot = SimpleNamespace(follows=None, member=member, renderer=Renderer(member, "original", 1, limit))
    return SimpleNamespace(
        cfg=SimpleNamespace(
            train=SimpleNamespace(max_steps=max_steps), rollout=SimpleNamespace(max_prompt_tokens=limit)
        ),
        world=world,
        examples=examples,
        sampler=LockstepSampler(len(examples), batch_size, seed=0, shuffle=False),
        slots=[slot],
        shards={member.id: shard(batch_size, tuple(range(world.size)), world.rank)},
        too_long={},
    )


def test_over_long_prompts_are_skipped_at_the_exact_limit_and_replaced_in_order(tiny_zoo):
    """The limit is L + 1 tokens: e1 (exactly the limit) is kept, e2 (one more) is skipped, and so is its first
    replacement e3; e4 takes their place, after the kept e0 and e1. The next step, rendered ahead in the background,
    skips e6 the same way (e8 follows e7); the prompts line up with the batch. Pins `RenderAhead.prompts` (the bug: a
    replacement taken without being checked in turn) with `Renderer` and `LockstepSampler.exclude`."""
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]), trainable=False))
    length = Renderer(member, "original", 1, 1 << 30)(Example("a", QUESTION)).inputs["input_ids"].shape[1]
    run = _render_run(member, length + 1, [0, 1, 2, 2, 0, 0, 2, 0, 1], batch_size=3, world=World(), max_steps=2)
    renders = RenderAhead(run)
    try:
        batch, prompts = renders.prompts(run.sampler.next_batch(), 0)
        assert [ex.id for ex in batch] == ["e0", "e1", "e4"]
        assert [p.example_id for p in prompts[0]] == ["e0", "e1", "e4"]
        assert run.too_long == {
            "e2": {"member": "q", "tokens": length + 2},
            "e3": {"member": "q", "tokens": length + 2},
        }
        batch, prompts = renders.prompts(run.sampler.next_batch(), 1)
        assert [ex.id for ex in batch] == [p.example_id for p in prompts[0]] == ["e5", "e7", "e8"]
        assert sorted(run.too_long) == ["e2", "e3", "e6"] and run.sampler.excluded == {2, 3, 6}
    finally:
        renders.close()


def test_the_ranks_of_a_member_agree_on_the_skipped_examples():
    """Each rank finds only the over-long prompts of its own shard; the skip must be the same on every rank (the
    union), or the ranks' batches drift apart. Pins the all_gather in `_agree_too_long` (the bug: a rank
    deciding from its own findings)."""
    found = {0: [(2, "a", 50)], 1: [(5, "b", 60)]}

    def agree(world):
        run = SimpleNamespace(
            world=world,
            examples=[Example(f"e{i}", "q") for i in range(8)],
            too_long={},
            cfg=SimpleNamespace(rollout=SimpleNamespace(max_prompt_tokens=40)),
        )
        return _agree_too_long(run, found[world.rank]), run.too_long

    first, second = on_ranks(2, agree)
    assert first == second == ({2, 5}, {"e2": {"member": "a", "tokens": 50}, "e5": {"member": "b", "tokens": 60}})


def test_two_ranks_of_a_member_draw_the_same_batch_when_only_one_shard_is_too_long(tiny_zoo):
    """Batch of 4 over 2 ranks (positions 0-1 and 2-3): e3, on rank 1's shard only, is over the limit; both ranks
    must then replace it by e4 and render the same batch. Pins the lockstep of `RenderAhead.prompts` over ranks."""
    members = [load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen3"]), trainable=False)) for _ in range(2)]
    length = Renderer(members[0], "original", 1, 1 << 30)(Example("a", QUESTION)).inputs["input_ids"].shape[1]

    def step(world):  # each rank its own member (a renderer is not thread-safe)
        run = _render_run(members[world.rank], length, [0, 0, 0, 1, 0, 0, 0, 0], batch_size=4, world=world)
        renders = RenderAhead(run)
        try:
            batch, prompts = renders.prompts(run.sampler.next_batch(), 0)
        finally:
            renders.close()
        return [ex.id for ex in batch], [p.example_id for p in prompts[0]], sorted(run.too_long)

    assert on_ranks(2, step) == [
        (["e0", "e1", "e2", "e4"], ["e0", "e1"], ["e3"]),
        (["e0", "e1", "e2", "e4"], ["e2", "e4"], ["e3"]),
    ]
