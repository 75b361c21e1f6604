"""The update's decisions for speed (issue 47, item 2), each checked on the CPU:

- `train.micro_batch_size: auto` is the largest micro-batch whose plan fits the device (a released GPU recipe on
  a stand-in 80 GB card), 8 off CUDA;
- micro-batches are cut from length-sorted sequences (a group kept together) and give the same loss and
  gradients as unsorted ones;
- the policy's log-probs are computed in row chunks: no fp32 copy of the whole (rows, vocabulary) logits;
- AdamW runs fused on CUDA where torch allows it, never under DeepSpeed.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from vlm_corl.config import load_config, read_raw_config
from vlm_corl.config.schema import TrainConfig
from vlm_corl.members import update
from vlm_corl.members.member import adamw_fused
from vlm_corl.members.memory import GB
from vlm_corl.members.rollout import Policy
from vlm_corl.members.update import Sequence, length_sorted, response_logprobs, sequence_length
from vlm_corl.planning.cohort import CPU_MICRO_BATCH, Hardware, micro_batch_for, plan_cohort, with_changes
from vlm_corl.planning.micro_batch import with_micro_batch
from vlm_corl.training.rewards import grpo

ROOT = Path(__file__).resolve().parents[1]


def _recipe(monkeypatch, *overrides: str):
    """configs/cohorts/gpu_1gpu_2vlm.yaml with the released architectures (meta-device sizes) as its members."""
    monkeypatch.chdir(ROOT)
    path = ROOT / "configs" / "cohorts" / "gpu_1gpu_2vlm.yaml"
    members = read_raw_config(path)["members"]
    stand_ins = [f"members.{i}.model=configs/models/{Path(m['model']).name}" for i, m in enumerate(members)]
    return load_config(path, [*stand_ins, *overrides], processes=1)


def test_auto_is_the_default_and_8_off_cuda(monkeypatch):
    assert TrainConfig().micro_batch_size == "auto"
    cfg = _recipe(monkeypatch, "train.micro_batch_size=auto")
    assert cfg.train.micro_batch_size == "auto"
    assert micro_batch_for(cfg, Hardware(1, 80 * GB, cuda=False)) == (CPU_MICRO_BATCH, None)
    assert with_micro_batch(cfg, Hardware(1, 80 * GB, cuda=False)).train.micro_batch_size == 8


def test_auto_takes_the_largest_micro_batch_whose_plan_fits_the_card(monkeypatch):
    cfg = _recipe(monkeypatch, "train.micro_batch_size=auto")
    card = Hardware(1, 80 * GB)
    size, plan = micro_batch_for(cfg, card)
    rows = cfg.data.batch_size * cfg.rollout.n  # one rank: every response of a member
    assert plan.fits and 1 <= size <= rows
    if size < rows:  # the next size tried does not fit: auto is the largest that does
        bigger = min(2 * size, rows)
        assert not plan_cohort(with_changes(cfg, {"train.micro_batch_size": bigger}), card).fits
    # a smaller card gets a smaller micro-batch (the plan's update activations grow with it); below ~67 GB the
    # rollout phase alone (InternVL's static bucket and prefill beside vLLM's share) no longer fits
    small, small_plan = micro_batch_for(cfg, Hardware(1, 68 * GB))
    assert small_plan.fits and small < size
    # a card too small for any: 1, with the plan that does not fit (the memory check then says what to change)
    least, none_fits = micro_batch_for(cfg, Hardware(1, 40 * GB))
    assert least == 1 and not none_fits.fits
    # the plan of `auto` is the plan at the size chosen, and a launch runs that size
    assert plan_cohort(cfg, card).ranks[0].peak == plan.ranks[0].peak
    assert with_micro_batch(cfg, card).train.micro_batch_size == size
    assert with_micro_batch(_recipe(monkeypatch), card).train.micro_batch_size == 2  # a number is kept


# ---- length-sorted micro-batches ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return Qwen2ForCausalLM(cfg).float().eval()


def _sequences() -> list[Sequence]:
    """4 groups of 3 responses of varied lengths, each group sharing one prompt dict (as a rollout's do)."""
    gen = torch.Generator().manual_seed(1)
    seqs = []
    for g, prompt_len in enumerate((5, 9, 3, 7)):
        prompt = {
            "input_ids": torch.randint(3, 97, (1, prompt_len), generator=gen),
            "attention_mask": torch.ones(1, prompt_len, dtype=torch.long),
        }
        for k, length in enumerate(((11, 2, 6), (1, 8, 4), (13, 3, 9), (5, 12, 7))[g]):
            tokens = torch.randint(3, 97, (length,), generator=gen).tolist()
            seqs.append(Sequence(prompt, tokens, advantage=(-1.0) ** (g + k) * (0.5 + k)))
    return seqs


def test_length_sorting_keeps_groups_together_and_cuts_padding():
    seqs = _sequences()
    ordered = length_sorted(seqs)
    assert sorted(map(id, ordered)) == sorted(map(id, seqs))  # the same sequences
    prompts = [id(s.prompt_inputs) for s in ordered]
    assert all(len(set(prompts[i : i + 3])) == 1 for i in range(0, 12, 3))  # each group in one run

    def padded(order, size=6):  # the tokens micro-batches hold: prompts left-padded, responses right-padded
        cuts = [order[i : i + size] for i in range(0, len(order), size)]
        longest = lambda mb, part: max(map(part, mb))  # noqa: E731
        return sum(
            len(mb)
            * (longest(mb, lambda s: s.prompt_inputs["input_ids"].shape[1]) + longest(mb, lambda s: len(s.token_ids)))
            for mb in cuts
        )

    assert all(
        sequence_length(a) <= sequence_length(b)
        for a, b in zip(ordered, ordered[1:])
        if a.prompt_inputs is b.prompt_inputs
    )

    assert padded(ordered) < padded(seqs)


class _Member:
    """What `_micro_batches` and `_micro_batch_loss` read of a member: its model, dtype and policy."""

    def __init__(self, model):
        self.model, self.device, self.autocast_dtype, self.reference = model, torch.device("cpu"), None, None

    def micro_batch_count(self, real: int) -> int:
        return real


def _loss_and_grads(model, seqs, sort: bool, monkeypatch, size: int = 2):
    """The update's loss over `seqs` in micro-batches of `size` (summed as `_policy_update` does) and the
    gradients it leaves; `sort` False cuts the micro-batches in the given order."""
    model = copy.deepcopy(model)
    member = _Member(model)
    member.device = torch.device("cuda" if sort else "cpu")  # what `_micro_batches` decides by (nothing runs there)
    policy = Policy(temperature=1.0, suppressed=(0,), pad_id=0)
    micro, real = update._micro_batches(member, seqs, seqs[0], size)
    tokens = sum(len(s.token_ids) for s in seqs)
    total = 0.0
    for mb in micro:
        logp, mask = response_logprobs(model, [s.prompt_inputs for s in mb], [s.token_ids for s in mb], policy)
        adv = torch.tensor([s.advantage for s in mb])
        token_loss, _ = grpo.clipped_surrogate(logp, logp.detach(), adv, 0.2, 0.2)
        loss = grpo.aggregate_loss(token_loss, mask, "token_mean", total_tokens=tokens, total_seqs=len(seqs))
        loss.backward()
        total += float(loss.detach())
    return total, [p.grad.clone() for p in model.parameters()], micro


def test_length_sorted_micro_batches_give_the_loss_and_gradients_of_unsorted_ones(model, monkeypatch):
    seqs = _sequences()
    sorted_loss, sorted_grads, sorted_micro = _loss_and_grads(model, seqs, True, monkeypatch)
    loss, grads, micro = _loss_and_grads(model, seqs, False, monkeypatch)
    assert [list(map(id, mb)) for mb in sorted_micro] != [list(map(id, mb)) for mb in micro]  # other batches
    assert loss != 0.0 and sorted_loss == pytest.approx(loss, rel=1e-5, abs=1e-7)
    for a, b in zip(sorted_grads, grads, strict=True):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
    assert any(g.abs().sum() > 0 for g in grads)


# ---- chunked log-probs -------------------------------------------------------------------------------------


def test_log_probs_upcast_row_chunks_never_the_whole_logits(monkeypatch):
    """selective_logprobs over bf16 logits: every fp32 policy chunk, forward and backward, holds at most
    `chunk_rows` rows, never the (rows, vocabulary) whole; and the default chunk is set by CHUNK_ELEMENTS."""
    shapes = []
    real_chunk = grpo._policy_chunk

    def recorded(chunk, *args, **kwargs):
        out = real_chunk(chunk, *args, **kwargs)
        shapes.append((tuple(out.shape), out.dtype))
        return out

    monkeypatch.setattr(grpo, "_policy_chunk", recorded)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 16, 500, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, 500, (4, 16), generator=gen)
    grpo.selective_logprobs(logits * 1, targets, 0.9, (1,), chunk_rows=8).sum().backward()
    assert shapes and all(s[0] <= 8 and s[1] == 500 and dtype == torch.float32 for s, dtype in shapes)
    assert {s[0] for s, _ in shapes} == {8}  # 64 rows in chunks of 8, in both passes
    shapes.clear()
    monkeypatch.setattr(grpo, "CHUNK_ELEMENTS", 500 * 5)
    grpo.selective_logprobs(logits.detach(), targets, 0.9, (1,))
    assert max(s[0] for s, _ in shapes) == 5


# ---- fused AdamW -------------------------------------------------------------------------------------------


def test_adamw_runs_fused_on_cuda_where_torch_allows_it():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    on_card = [torch.empty(3, device="meta"), torch.empty(2, 2, device="meta")]  # stand-ins for CUDA tensors
    assert adamw_fused(cuda, False, on_card) is True
    assert adamw_fused(cuda, True, on_card) is False  # DeepSpeed steps its partitions itself
    assert adamw_fused(cpu, False, [torch.empty(3)]) is False  # torch's foreach AdamW off CUDA
    assert adamw_fused(cuda, False, [torch.empty(3)]) is False  # a parameter on the host (offloaded)
    assert adamw_fused(cuda, False, [torch.empty(3, dtype=torch.long, device="meta")]) is False
