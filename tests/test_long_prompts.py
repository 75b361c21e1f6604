"""A prompt longer than rollout.max_prompt_tokens (a large image, a long question) is skipped for every member
and counted, not fatal hours into a run; the defaults agree (the prompt limit holds an image at the image cap)."""

from __future__ import annotations

import io
import json

import torch
from cohort_helpers import cohort, metrics
from PIL import Image
from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

from vlm_corl.config import MemberConfig, config_from_dict
from vlm_corl.config.schema import MAX_IMAGE_PIXELS, MAX_PROMPT_TOKENS
from vlm_corl.data.loaders import load_examples
from vlm_corl.data.records import Example
from vlm_corl.data.sampler import LockstepSampler
from vlm_corl.members.member import load_member
from vlm_corl.members.render import Renderer
from vlm_corl.training.loop import run_cohort


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
