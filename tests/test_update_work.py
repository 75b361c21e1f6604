"""What the update counts of its own work, and the decisions that shape it (issue 55, review R4-7 and item 6), on
the CPU:

- `update_tokens` (the work `update_mfu` prices) is the input positions the update's forward passes ran: a
  prompt shared by a micro-batch's responses counts once, as it runs once (R4-7);
- `train.micro_batch_size: auto` when a rank's responses are not a power of two;
- the exact order of the update's micro-batches (length-sorted on CUDA, kept on the CPU);
- fused AdamW when the parameters are on mixed devices.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlm_corl.config import AlgoConfig, MemberConfig, TrainConfig, load_config, read_raw_config
from vlm_corl.config.schema import RolloutConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.members import update
from vlm_corl.members.member import adamw_fused, load_member
from vlm_corl.members.memory import GB
from vlm_corl.members.render import Renderer
from vlm_corl.members.update import Sequence, policy_update
from vlm_corl.planning.cohort import Hardware, micro_batch_for, plan_cohort, responses_per_rank, with_changes

ROOT = Path(__file__).resolve().parents[1]


# ---- update_tokens: the positions the passes ran (R4-7) ------------------------------------------------------


def _groups(member, prompts: int, k: int) -> list[Sequence]:
    """`prompts` rendered easy-vqa prompts x `k` responses of varied lengths (each group shares its prompt dict, as
    a rollout's do), with non-zero advantages so that every response trains."""
    render = Renderer(member, "original", 10**6, 10**6)
    gen = torch.Generator().manual_seed(0)
    seqs = []
    for g, example in enumerate(load_examples("easyvqa", split="train", limit=prompts).examples):
        prompt = render(example).inputs
        for j in range(k):
            tokens = torch.randint(10, 60, (2 + (g + j) % 4,), generator=gen).tolist()
            seqs.append(Sequence(prompt, tokens, advantage=(-1.0) ** j * (0.5 + j)))
    return seqs


@pytest.mark.parametrize("micro_batch", [3, 4])
def test_update_tokens_are_the_positions_the_forward_passes_ran(tiny_zoo, micro_batch):
    """A no-gradient-checkpointing update (the default) of 2 prompts x 3 responses: a forward hook on the embedding
    layer sums the positions every forward pass fed, which must equal the reported `update_tokens`. The prompt of
    a group runs once per micro-batch (`_shared_prompt_logprobs`), so this is less than the old count (each
    prompt once per response, K x P): the test fails on it."""
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"])))
    assert not any(getattr(m, "gradient_checkpointing", False) for m in member.model.modules())
    seqs = _groups(member, prompts=2, k=3)
    fed = []
    hook = member.model.get_input_embeddings().register_forward_hook(lambda m, args, out: fed.append(args[0].numel()))
    try:
        train = TrainConfig(micro_batch_size=micro_batch)
        member.setup_optimizer(train, 1)
        stats = policy_update(member, seqs, AlgoConfig(), train, RolloutConfig())
    finally:
        hook.remove()
    per_response = sum(s.prompt_inputs["input_ids"].shape[-1] + len(s.token_ids) for s in seqs)
    assert stats["trained_seqs"] == len(seqs) and len(fed) >= 2
    assert stats["update_tokens"] == sum(fed)
    assert sum(fed) < per_response  # the shared prompts ran once, not once per response


# ---- train.micro_batch_size: auto, rows not a power of two (item 6a) -----------------------------------------


def _recipe(monkeypatch, batch_size: int):
    """configs/cohorts/gpu_1gpu_2vlm.yaml (released architectures as meta-device stand-ins), micro-batch auto, with
    `batch_size` prompts of K=4 responses per step."""
    monkeypatch.chdir(ROOT)
    path = ROOT / "configs" / "cohorts" / "gpu_1gpu_2vlm.yaml"
    members = read_raw_config(path)["members"]
    stand_ins = [f"members.{i}.model=configs/models/{Path(m['model']).name}" for i, m in enumerate(members)]
    overrides = [*stand_ins, "train.micro_batch_size=auto", f"data.batch_size={batch_size}", "rollout.n=4"]
    return load_config(path, overrides, processes=1)


@pytest.mark.parametrize(("batch_size", "card_gb"), [(3, 80), (3, 40), (6, 80), (6, 48)])
def test_auto_micro_batch_when_a_ranks_responses_are_not_a_power_of_two(monkeypatch, batch_size, card_gb):
    """12 or 24 responses per rank: auto's micro-batch is at most the rows (a larger one holds nothing more), its
    plan fits, and it is the largest that does: the rows themselves when they fit (one micro-batch, not the power
    of two below), else the next size up (twice it, or the rows) does not fit. Micro-batches of that size cover the
    rows in ceil(rows / size) passes."""
    cfg = _recipe(monkeypatch, batch_size)
    rows = responses_per_rank(cfg, 1)
    assert rows == 4 * batch_size and rows & (rows - 1)  # not a power of two
    card = Hardware(1, card_gb * GB)
    size, plan = micro_batch_for(cfg, card)
    assert 1 <= size <= rows and plan.fits
    fits = lambda n: plan_cohort(with_changes(cfg, {"train.micro_batch_size": n}), card).fits  # noqa: E731
    if fits(rows):
        assert size == rows
    else:
        assert not fits(min(2 * size, rows))
    assert (size * -(-rows // size)) >= rows > size * (-(-rows // size) - 1)


def test_auto_micro_batch_prefers_all_rows_to_the_power_of_two_below(monkeypatch):
    """On a card where 12 rows fit in one pass, auto takes 12, not 8: the planted power-of-two-only rule fails."""
    cfg = _recipe(monkeypatch, 3)
    assert micro_batch_for(cfg, Hardware(1, 80 * GB))[0] == 12


# ---- the update's micro-batch order (item 6b) ----------------------------------------------------------------


class _Member:
    """What `_micro_batches` reads of a member: the device it decides by (nothing runs there) and the ranks'
    number of passes."""

    def __init__(self, device: str):
        self.device = torch.device(device)

    def micro_batch_count(self, real: int) -> int:
        return real


def _named_sequences() -> dict[str, Sequence]:
    """Four groups, interleaved as a rollout never is, with ties in length within and across groups (prompt length,
    response lengths): A (2; 4, 1, 4), B (3; 1, 3), C (2; 2), D (1; 5, 2). Sequence lengths: A 6, 3, 6; B 4, 6;
    C 4; D 6, 3. Group maxima: A 6, B 6, C 4, D 6."""
    prompts = {
        g: {"input_ids": torch.zeros(1, n, dtype=torch.long)} for g, n in {"A": 2, "B": 3, "C": 2, "D": 1}.items()
    }
    lengths = {"A0": 4, "B0": 1, "C0": 2, "A1": 1, "D0": 5, "B1": 3, "A2": 4, "D1": 2}  # the input order
    return {name: Sequence(prompts[name[0]], [i] * n, advantage=1.0) for i, (name, n) in enumerate(lengths.items())}


@pytest.mark.parametrize(("device", "expected"), [
    # groups by their longest sequence, ascending, ties in first-seen order (A, B, D); inside a group by length,
    # ties in input order (A0 before A2)
    ("cuda", [["C0", "A1", "A0"], ["A2", "B0", "B1"], ["D1", "D0"]]),
    ("cpu", [["A0", "B0", "C0"], ["A1", "D0", "B1"], ["A2", "D1"]]),  # kept: the CPU's sums repeat
])  # fmt: skip
def test_update_micro_batches_come_in_the_exact_length_sorted_order(device, expected):
    """The exact micro-batches `_micro_batches` cuts (size 3): on CUDA a stable sort of groups by their longest
    sequence, then of each group's responses by length (a group stays together); on the CPU the input order.
    A reversed or unstable sort, or groups split, give another order."""
    seqs = _named_sequences()
    name = {id(s): n for n, s in seqs.items()}
    micro, real = update._micro_batches(_Member(device), list(seqs.values()), seqs["A0"], 3)
    assert real == len(micro) == 3
    assert [[name[id(s)] for s in mb] for mb in micro] == expected


# ---- fused AdamW, parameters on mixed devices (item 6c) --------------------------------------------------------


@pytest.mark.parametrize("host_first", [False, True])
def test_adamw_is_not_fused_when_some_parameters_are_on_the_host(host_first):
    """Some parameters on the card (meta stand-ins for CUDA tensors), one on the host (an offloaded or forgotten
    one): torch's fused AdamW needs every parameter on CUDA, so the member must not ask for it, whichever comes
    first. All on the card: fused."""
    card = [torch.empty(3, device="meta"), torch.empty(2, 2, device="meta")]
    host = [torch.empty(4)]
    mixed = host + card if host_first else card + host
    assert adamw_fused(torch.device("cuda"), False, card) is True
    assert adamw_fused(torch.device("cuda"), False, mixed) is False
