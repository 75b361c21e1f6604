"""A batch may mix prompts with and without images, and prompts with different image counts (a dataset of
text and image questions, a member reading another view): every row then scores and samples exactly as it
does alone. Per-image inputs (Qwen-VL patches) are concatenated over the prompts that have them; batch-aligned
ones (Mllama's pixel tensors, one row per prompt) are zero-filled and zero-padded, as its processor pads."""

from dataclasses import replace

import pytest
import torch
from cohort_helpers import shipped_families

from vlm_corl.config import MemberConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.members.batching import collate
from vlm_corl.members.engines import make_engine
from vlm_corl.members.member import load_member
from vlm_corl.members.render import Renderer
from vlm_corl.members.rollout import SamplingParams
from vlm_corl.members.update import _full_logprobs, _shared_prompt_logprobs

VISION = shipped_families("vision")


@pytest.fixture(scope="module")
def mixed():
    """An image question, a text-only question, a two-image question."""
    one, two, three = load_examples("easyvqa", split="train", limit=3).examples
    return [one, replace(two, images=()), replace(three, images=three.images + one.images)]


def _logp(logits, targets):
    return torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None])[..., 0]


@pytest.mark.parametrize("family", VISION)
def test_each_row_of_a_mixed_batch_scores_and_samples_as_it_does_alone(tiny_zoo, mixed, family):
    member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family]), trainable=False))
    render = Renderer(member, "original", 10**6, 10**6)
    prompts = [render(ex) for ex in mixed]
    assert "pixel_values" not in prompts[1].inputs and "pixel_values" in prompts[0].inputs
    engine = make_engine("hf", member)
    greedy = SamplingParams(n=1, temperature=0.0, max_new_tokens=6)
    together = [g.responses[0].token_ids for g in engine.generate(prompts, greedy)]
    alone = [engine.generate([p], greedy)[0].responses[0].token_ids for p in prompts]
    assert together == alone

    responses = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    policy = member.policy()
    model = member.model.eval()
    with torch.no_grad():
        batch, mask = _full_logprobs(model, [p.inputs for p in prompts], responses, policy, _logp)
        # Two responses per prompt: the shared-prompt path (prefill once, continue from the cache).
        shared, _ = _shared_prompt_logprobs(
            model, [p.inputs for p in prompts for _ in (0, 1)], [r for r in responses for _ in (0, 1)], policy, _logp
        )
        for i, p in enumerate(prompts):
            own, _ = _full_logprobs(model, [p.inputs], [responses[i]], policy, _logp)
            n = len(responses[i])
            assert torch.allclose(batch[i, :n], own[0], atol=1e-4), (family, i)
            assert torch.allclose(shared[2 * i, :n], own[0], atol=1e-4), (family, i)


def test_batch_aligned_inputs_are_padded_per_prompt(tiny_zoo, mixed):
    member = load_member(MemberConfig(id="m", model=str(tiny_zoo["mllama"]), trainable=False))
    render = Renderer(member, "original", 10**6, 10**6)
    inputs = [render(ex).inputs for ex in mixed]
    aligned = member.family.batch_aligned_keys
    batch, _ = collate(inputs, member.tokenizer.pad_token_id, aligned=aligned)
    images = [p["pixel_values"].shape[1] if "pixel_values" in p else 0 for p in inputs]
    assert images == [1, 0, 2]
    assert batch["pixel_values"].shape[:2] == (3, 2)
    assert batch["pixel_values"][1].abs().sum() == 0 and batch["pixel_values"][0, 1].abs().sum() == 0
    assert batch["cross_attention_mask"].shape[:3] == (3, batch["input_ids"].shape[1], 2)
    assert batch["cross_attention_mask"][1].sum() == 0
    with pytest.raises(RuntimeError):  # without the family's declaration the rows cannot be stacked
        collate(inputs, member.tokenizer.pad_token_id)
