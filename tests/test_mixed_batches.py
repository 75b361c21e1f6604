"""A batch may mix prompts with and without images, and prompts with different image counts (a dataset of
text and image questions, a member reading another view): every row then scores and samples exactly as it
does alone. Per-image inputs (Qwen-VL patches) are concatenated over the prompts that have them; batch-aligned
ones (Mllama's pixel tensors, one row per prompt) are zero-filled and zero-padded, as its processor pads."""

import copy
import gc
from dataclasses import replace

import pytest
import torch
from cohort_helpers import assert_ready_decode_mask_changes_nothing, shipped_families

from vlm_corl.config import MemberConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.members.batching import (
    _ROPE_ROWS,
    DecodeSteps,
    collate,
    continuation,
    model_positions,
    prefill,
    ready_decode_mask,
    unwrapped,
)
from vlm_corl.members.engines import make_engine
from vlm_corl.members.kv_cache import ReservedLayer
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


@pytest.mark.parametrize("family", VISION)
def test_mrope_positions_are_computed_once_per_prompt_and_reassembled_exactly(tiny_zoo, mixed, family, monkeypatch):
    """Rendering a prompt computes its M-RoPE positions (in the renderer's background thread, in training);
    the rollout's and the update's batches of those prompts (any order, any padding) are assembled from them,
    equal to `get_rope_index`'s, without calling it. The renderer's cache counts their bytes, and they go with
    the prompt."""
    member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family]), trainable=False))
    if not member.policy().mrope:
        pytest.skip(f"{family} has 1-D positions")
    inner = unwrapped(member.model).model
    real, calls = inner.get_rope_index, []
    monkeypatch.setattr(inner, "get_rope_index", lambda **kw: calls.append(1) or real(**kw))
    render = Renderer(member, "original", 10**6, 10**6)
    prompts = [render(ex).inputs for ex in mixed]
    assert len(calls) == 3  # one per prompt, as it is rendered
    tensors = sum(t.numel() * t.element_size() for p in prompts for t in p.values())
    positions = sum(3 * 8 * p["input_ids"].shape[1] + 8 for p in prompts)  # (3, n) and (1,) int64
    assert render.cached_bytes == tensors + positions
    pad = member.tokenizer.pad_token_id
    for batch_prompts in (prompts, [prompts[2], prompts[0], prompts[2]]):  # the rollout's; a reordered subset
        batch = collate(batch_prompts, pad)[0]
        pos, delta = model_positions(member.model, batch, True, batch_prompts)
        want_pos, want_delta = real(**{k: v for k, v in batch.items() if not k.startswith("pixel_values")})
        assert torch.equal(pos, want_pos) and torch.equal(delta, want_delta)
    assert len(calls) == 3  # none for the batches
    remembered = len(_ROPE_ROWS)
    del prompts, batch_prompts, batch, render  # the renderer's cache holds the prompts too
    gc.collect()
    assert len(_ROPE_ROWS) == remembered - 3


def _padded_batch(member, mixed: list) -> list:
    """Rendered prompts of different lengths for `member`: the mixed image questions for a vision member, text
    questions of growing length for a text one."""
    exs = (
        mixed
        if member.family.modality == "vision"
        else [replace(e, images=(), question=e.question + " Why?" * i) for i, e in enumerate(mixed)]
    )
    render = Renderer(member, "original", 10**6, 10**6)
    return [render(e) for e in exs]


# One mask serves every layer only with full attention throughout: Gemma-3's sliding-window layers need their own.
NO_READY_DECODE_MASK = {"gemma3"}
NO_PLAIN_CACHE_LAYER = set()  # families whose every cache layer is of another kind (sliding, linear attention)


@pytest.mark.parametrize("family", VISION + shipped_families("text"))
def test_a_ready_made_decoding_mask_decodes_a_padded_batch_as_transformers_mask(tiny_zoo, mixed, family):
    member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family]), trainable=False))
    eager = copy.deepcopy(member.model.config)
    eager._attn_implementation = "eager"  # eager attention adds a float mask: a boolean one would be wrong
    assert not ready_decode_mask(eager)
    if not ready_decode_mask(member.model.config):
        assert family in NO_READY_DECODE_MASK
        return
    assert_ready_decode_mask_changes_nothing(member, _padded_batch(member, mixed))


@pytest.mark.parametrize("family", VISION + shipped_families("text"))
def test_decoding_steps_feed_what_continuation_would(tiny_zoo, mixed, family):
    """The rollout's one-token steps (`DecodeSteps`: one mask made up front, positions counted on) give the
    model exactly `continuation`'s inputs over a padded batch, at every step and after rows leave the batch."""
    member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family]), trainable=False))
    prompts = [p.inputs for p in _padded_batch(member, mixed) for _ in range(2)]
    policy = member.policy()
    with torch.no_grad():
        prefix = prefill(member.model.eval(), prompts, policy.pad_id, policy.mrope)
    steps, rows = DecodeSteps(prefix, limit=5), len(prompts)
    for t in range(5):
        if t == 3:  # rows 1 and 4 end: they leave the batch and its cache
            keep = torch.tensor([0, 2, 3, 5])
            steps.select(keep)
            rows = len(keep)
        tokens = torch.arange(rows)[:, None] + 7
        ours, theirs = steps.inputs(tokens, t), continuation(prefix, tokens, torch.ones(rows, t + 1, dtype=torch.long))
        assert ours.keys() == theirs.keys()
        for key, value in theirs.items():
            if isinstance(value, torch.Tensor):
                assert ours[key].shape == value.shape and torch.equal(ours[key], value), (key, t)
            else:
                assert ours[key] is value, key


def _greedy_logits(member, prompts: list, reserved: bool, steps: int = 6) -> tuple[list, list]:
    """Greedy decoding over a padded batch in which rows 1 and 4 leave after 3 tokens: each step's logits, and
    per step the storage of each reserved layer's keys. `reserved`: the rollout's way (`DecodeSteps`, the KV
    cache with room reserved); else `continuation` over transformers' growing cache."""
    policy = member.policy()
    out, storage = [], []
    with torch.no_grad():
        prefix = prefill(member.model.eval(), prompts, policy.pad_id, policy.mrope)
        decode = DecodeSteps(prefix, steps) if reserved else None
        logits = prefix.last_logits
        for t in range(steps):
            if t == 3:
                keep = torch.tensor([0, 2, 3, 5])
                (decode or prefix).select(keep)
                logits = logits[keep]
            tokens = logits.argmax(-1)[:, None]
            step = decode.inputs(tokens, t) if decode else continuation(prefix, tokens, torch.ones(len(tokens), t + 1))
            logits = member.model(**step).logits[:, -1]
            out.append(logits)
            layers = [layer for layer in prefix.cache.layers if isinstance(layer, ReservedLayer)]
            storage.append([layer.keys.untyped_storage().data_ptr() for layer in layers])
    return out, storage


@pytest.mark.parametrize("family", VISION + shipped_families("text"))
def test_the_rollout_cache_reserves_room_and_decodes_as_transformers_growing_cache(tiny_zoo, mixed, family):
    """The rollout's KV cache (`reserve_cache`): every plain growing layer (transformers' DynamicLayer) gets room
    for the response and writes each token in place (its keys stay in one buffer between row selections), the
    other layer kinds keep their classes, and greedy decoding gives transformers' logits exactly."""
    from transformers.cache_utils import DynamicLayer

    member = load_member(MemberConfig(id=family, model=str(tiny_zoo[family]), trainable=False))
    prompts = [p.inputs for p in _padded_batch(member, mixed) for _ in range(2)]
    policy = member.policy()
    with torch.no_grad():
        prefix = prefill(member.model.eval(), prompts, policy.pad_id, policy.mrope)
    before = [type(layer) for layer in prefix.cache.layers]
    DecodeSteps(prefix, 6)
    after = [type(layer) for layer in prefix.cache.layers]
    assert after == [ReservedLayer if kind is DynamicLayer else kind for kind in before]
    assert ReservedLayer in after or family in NO_PLAIN_CACHE_LAYER, after

    ours, storage = _greedy_logits(member, prompts, reserved=True)
    theirs, _ = _greedy_logits(member, prompts, reserved=False)
    for t, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b), (t, (a - b).abs().max())
    assert storage[0] == storage[1] == storage[2] and storage[3] == storage[4] == storage[5]  # written in place
