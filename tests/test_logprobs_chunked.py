"""Chunked policy statistics equal the unchunked maths: `grpo.selective_logprobs` and `grpo.token_stats` against
log_softmax over whole fp32 policy logits (gradients included), `update`'s passes against the same reference on a
model, the micro-batched scoring pass against one pass, and `bench/memory.py --size tiny` runs and reports less
memory than before."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from vlm_corl.members.rollout import Policy
from vlm_corl.members.update import _full_logprobs, _per_position, response_logprobs, response_token_stats
from vlm_corl.training.rewards.grpo import selective_logprobs, token_entropy, token_self_certainty, token_stats

V = 300
SUPPRESSED = [0, 7, V - 1]


def reference_policy(logits, temperature, suppressed):
    """The unchunked policy logits (the code before chunking): fp32, tempered, suppressed ids at -inf."""
    logits = logits.float() / temperature
    removed = torch.zeros(logits.shape[-1])
    removed[suppressed] = float("-inf")
    return logits + removed


def reference_logprobs(logits, targets, temperature, suppressed):
    logp = torch.log_softmax(reference_policy(logits, temperature, suppressed), dim=-1)
    return logp.gather(-1, targets[..., None]).squeeze(-1)


def _case(seed=0, shape=(3, 11)):
    gen = torch.Generator().manual_seed(seed)
    logits = 3 * torch.randn(*shape, V, generator=gen)
    targets = torch.randint(8, V - 1, shape, generator=gen)  # samplable ids
    targets[0, :2] = SUPPRESSED[-1]  # padding: the pad token is suppressed, its log-prob -inf, then masked
    mask = torch.ones(shape, dtype=torch.bool)
    mask[0, :2] = False
    return logits, targets, mask, torch.randn(shape, generator=gen)


@pytest.mark.parametrize("chunk_rows", [1, 4, 33, None])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_selective_logprobs_and_gradients_equal_the_unchunked_log_softmax(chunk_rows, temperature):
    logits, targets, mask, weights = _case()
    results = []
    for fn in (reference_logprobs, lambda *a: selective_logprobs(*a, chunk_rows=chunk_rows)):
        leaf = logits.clone().requires_grad_()
        logp = fn(leaf, targets, temperature, SUPPRESSED)
        (torch.where(mask, logp, 0.0) * weights).sum().backward()  # the loss masks padding, as the update does
        results.append((logp.detach(), leaf.grad))
    (ref, ref_grad), (ours, grad) = results
    assert ours.dtype == torch.float32 and ours.shape == targets.shape
    assert torch.equal(torch.isinf(ours), ~mask)  # suppressed targets: -inf, like the reference
    assert torch.allclose(ours[mask], ref[mask], rtol=0, atol=1e-6)
    assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-6)
    assert (grad[..., SUPPRESSED[:2]] == 0).all()


def test_inplace_backward_writes_the_same_gradient_over_the_logits():
    logits, targets, mask, weights = _case(seed=1)
    grads = []
    for inplace in (False, True):
        leaf = logits.clone().requires_grad_()
        logp = selective_logprobs(leaf * 1.0, targets, 0.7, SUPPRESSED, chunk_rows=5, inplace_backward=inplace)
        (torch.where(mask, logp, 0.0) * weights).sum().backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[0], grads[1])
    leaf = logits.clone().requires_grad_()  # a leaf's own values are never overwritten
    selective_logprobs(leaf, targets, 0.7, SUPPRESSED, inplace_backward=True).sum().backward()
    assert torch.equal(leaf.detach(), logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("suppressed", [(), SUPPRESSED])
def test_the_forward_works_in_place_on_its_own_copies_never_on_the_logits(dtype, temperature, suppressed):
    """Each chunk is upcast, tempered, masked and exponentiated in place (one fp32 copy per bf16 chunk), but
    on a copy: the logits themselves (fp32 ones too, where the upcast is no copy) are left as they were."""
    logits, targets, _, _ = _case(seed=3)
    logits = logits.to(dtype)
    before = logits.clone()
    selective_logprobs(logits, targets, temperature, suppressed, chunk_rows=4)
    assert torch.equal(logits, before)


def test_selective_logprobs_upcasts_bf16_chunks_like_the_reference():
    logits, targets, mask, _ = _case(seed=2)
    logits = logits.bfloat16()
    ours = selective_logprobs(logits, targets, 0.7, SUPPRESSED, chunk_rows=4)
    assert torch.allclose(ours[mask], reference_logprobs(logits, targets, 0.7, SUPPRESSED)[mask], rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_rows", [1, 4, None])
def test_token_stats_equal_the_unchunked_entropy_and_self_certainty(chunk_rows):
    logits, *_ = _case(seed=3)
    entropy, certainty = token_stats(logits, 0.7, SUPPRESSED, chunk_rows=chunk_rows)
    policy = reference_policy(logits, 0.7, SUPPRESSED)
    assert torch.allclose(entropy, token_entropy(policy), rtol=0, atol=1e-6)
    assert torch.allclose(certainty, token_self_certainty(policy), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(cfg).train()


def _rollouts(shared: bool):
    """Four prompts of unequal length (or two, each twice: the shared-prompt path) and responses of 1..9 tokens."""
    gen = torch.Generator().manual_seed(4)
    prompts = [{"input_ids": torch.randint(8, V - 1, (1, n), generator=gen)} for n in (3, 6, 4, 5)]
    for p in prompts:
        p["attention_mask"] = torch.ones_like(p["input_ids"])
    rows = [prompts[0], prompts[0], prompts[1], prompts[1]] if shared else prompts
    responses = [torch.randint(8, V - 1, (n,), generator=gen).tolist() for n in (9, 1, 5, 7)]
    return rows, responses


@pytest.mark.parametrize("shared", [False, True])
def test_response_logprobs_and_gradients_equal_the_unchunked_policy(model, shared):
    rows, responses = _rollouts(shared)
    pad = V - 1

    def reference(logits, targets):
        return reference_logprobs(logits, targets, 0.7, SUPPRESSED)

    results = []
    policy = Policy(pad, 0.7, SUPPRESSED)
    for compute in (
        lambda: _per_position(model, rows, responses, policy, reference),
        lambda: response_logprobs(model, rows, responses, policy),
    ):
        model.zero_grad()
        logp, mask = compute()[:2]  # _per_position adds the positions it ran
        logp = torch.where(mask.bool(), logp, 0.0)
        (logp * torch.linspace(-1, 1, logp.shape[1])).sum().backward()
        results.append((logp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    (ref, ref_grad), (ours, grad) = results
    # the logits themselves may differ in the last bit: the model computes them over other positions' shapes
    assert torch.allclose(ours, ref, rtol=0, atol=2e-6)
    assert torch.allclose(grad, ref_grad, rtol=0, atol=1e-6 * ref_grad.abs().max().item())


@pytest.mark.parametrize("shared", [False, True])
def test_scoring_in_micro_batches_equals_one_pass_and_the_reference(model, shared):
    rows, responses = _rollouts(shared)
    policy = Policy(V - 1, 0.7, SUPPRESSED)
    one_pass = response_token_stats(model, rows, responses, policy)
    micro = response_token_stats(model, rows, responses, policy, micro_batch_size=3)
    with torch.no_grad():
        logits, mask = _full_logprobs(model, rows, responses, policy, lambda logits, targets: logits)
    policy = reference_policy(logits, 0.7, SUPPRESSED)
    for name, fn in (("entropy", token_entropy), ("self_certainty", token_self_certainty)):
        expected = (fn(policy) * mask).sum(dim=1) / mask.sum(dim=1)
        assert one_pass[name].shape == (4,)
        assert torch.allclose(one_pass[name], expected, rtol=0, atol=1e-6)
        assert torch.allclose(micro[name], one_pass[name], rtol=0, atol=1e-6)


def test_memory_bench_tiny_reports_less_memory_than_before():
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, str(root / "bench" / "memory.py"), "--size", "tiny"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bf16_logits_bytes"] == 2 * 128 * 32000 * 2
    for kind in ("update", "scoring"):
        old, new = result[kind]["old"], result[kind]["new"]
        assert 0 < new["peak_bytes"] < old["peak_bytes"]
        assert new["peak_x_bf16_logits"] == pytest.approx(new["peak_bytes"] / result["bf16_logits_bytes"], abs=1e-3)
    assert result["update"]["logp_max_abs_diff"] < 1e-4 and result["scoring"]["stats_max_abs_diff"] < 1e-4
