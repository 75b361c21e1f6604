"""Small plausible bugs the rest of the suite let through (issue 32, item 9), each pinned by hand-worked numbers:

1. decisions that must be the same on every rank of a member, shown on two simulated ranks with different local
   inputs (`cohort_helpers.on_ranks`: threads whose collectives really meet);
2. start and end swapped: schedules at their call sites, the training data's slice;
3. call sites that could swap two arguments of one type (or read an old value for a new one), though the
   function they call is tested.

Each docstring names the bug its test fails on; every one was checked by putting that bug back
(`python tests/put_bugs_back.py` does it again for 24 of them, one JSON line each). The kinds that
live in one area are tested there: escaped braces in `\\boxed{}` and the reference-first order of answer
comparisons (test_answers.py), the caches' eviction order (test_gpu_paths.py, test_collapse.py), the over-long
prompt skips and their replacements (test_long_prompts.py), the references and windows of diagnostics and
headroom (test_collapse.py, test_category_collapse.py, test_headroom.py, test_rewards.py).
"""

from __future__ import annotations

import contextlib
import math
import threading
from types import SimpleNamespace

import pytest
import torch
from cohort_helpers import cohort, on_ranks

from vlm_corl.config import RewardConfig, config_from_dict
from vlm_corl.config.schema import AlgoConfig, DatasetConfig, RolloutConfig, TrainConfig
from vlm_corl.data.loaders import load_examples
from vlm_corl.data.records import Example
from vlm_corl.distributed.world import shard
from vlm_corl.members import deepspeed_update, update
from vlm_corl.members import member as member_module
from vlm_corl.members.member import Member, load_member
from vlm_corl.members.update import Sequence, _micro_batch_loss, _micro_batches, response_token_stats
from vlm_corl.planning import check
from vlm_corl.registry import REWARDS
from vlm_corl.training.loop import guard_phase
from vlm_corl.training.monitor.collapse import CollapseTracker
from vlm_corl.training.monitor.samples import SampleSettings, sample_rows
from vlm_corl.training.phases import update_phase as update_room
from vlm_corl.training.phases.checkpoint_phase import _check_replicas
from vlm_corl.training.phases.rollout_phase import intrinsic_scores, rollout_phase, sampling_params
from vlm_corl.training.phases.step_metrics import StepOutcome, _gather_step_facts, metrics_rows
from vlm_corl.training.phases.update_phase import follow_students, update_phase
from vlm_corl.training.rewards.modes import CohortBatch, RewardOutput
from vlm_corl.training.run.guard import improved
from vlm_corl.training.run.numerics import (
    NonFiniteStopped,
    NonFiniteTracker,
    RolloutMismatchStopped,
    check_rollout_mismatch,
)
from vlm_corl.training.run.setup import load_training_examples
from vlm_corl.training.run.slots import SlotSpec, build_slots, slot_specs

CPU = torch.device("cpu")


# ---- 1. decisions every rank of a member takes alike -------------------------------------------------------


def _threaded_sum(group, tensors: list[torch.Tensor]) -> None:
    """`world.sum_over` among `on_ranks` threads: `group` is the rank's ThreadWorld."""
    if group is None:
        return
    parts = group.all_gather([t.detach().clone() for t in tensors])
    for i, t in enumerate(tensors):
        t.copy_(sum(part[i] for part in parts))


def test_a_nonfinite_loss_on_one_rank_skips_the_step_on_every_rank(monkeypatch):
    """Rank 1's loss is NaN while its gradient and rank 0's loss are finite: both ranks must skip the step (or
    the replicas diverge). Weight 1, SGD at lr 0.1 on the summed gradient 1 + 1: applied, both reach 0.8.
    Pins `Member.step` (the bug: the non-finite-loss flag decided per rank, not reduced with the gradients)."""
    monkeypatch.setattr(member_module, "sum_over", _threaded_sum)

    def step(losses):
        def on_rank(world):
            model = torch.nn.Linear(1, 1, bias=False)
            model.weight.data.fill_(1.0)
            model.weight.grad = torch.ones(1, 1)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            me = SimpleNamespace(
                deepspeed=None,
                optimizer=optimizer,
                scheduler=torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0),
                device=CPU,
                group=world,
            )
            _, applied = Member.step(me, grad_clip=0.0, loss=torch.tensor(losses[world.rank]))
            return applied, model.weight.item()

        return on_ranks(2, on_rank)

    assert step([0.5, 0.5]) == [(True, pytest.approx(0.8))] * 2
    assert step([0.5, math.nan]) == [(False, 1.0)] * 2


def _lockstep(world):
    """`Member.micro_batch_count` of a DeepSpeed member on `world`'s ranks (`DeepSpeedUpdate.lockstep_count`)."""
    engine = SimpleNamespace(device=CPU, group=world)
    return lambda n: deepspeed_update.DeepSpeedUpdate.lockstep_count(engine, n)


@pytest.fixture
def threaded_all_reduce(monkeypatch):
    """torch.distributed.all_reduce among `on_ranks` threads (the group is the rank's ThreadWorld)."""
    ops = deepspeed_update.dist.ReduceOp

    def all_reduce(t, op=ops.SUM, group=None):
        parts = torch.stack(group.all_gather(t.clone()))
        if op == ops.MAX:
            t.copy_(parts.max(0).values)
        elif op == ops.MIN:
            t.copy_(parts.min(0).values)
        else:
            t.copy_(parts.sum(0))

    monkeypatch.setattr(deepspeed_update.dist, "all_reduce", all_reduce)


def test_every_rank_runs_the_busiest_ranks_number_of_micro_batches(threaded_all_reduce):
    """Under DeepSpeed a rank with fewer sequences runs zero-loss fillers up to the busiest rank's count: 5
    sequences in micro-batches of 2 (3) on rank 0, 1 (1) on rank 1: 3 passes each, rank 1's last two fillers of
    advantage 0; no sequences anywhere: one pass each. Pins `update._micro_batches` and
    `DeepSpeedUpdate.lockstep_count` (the bugs: no fillers, a count reduced by sum or min, zero passes)."""

    def batches(counts):
        def on_rank(world):
            seq = Sequence({"input_ids": torch.ones(1, 3)}, [1], 1.0)  # a prompt's length: micro-batches sort by it
            work = [seq] * counts[world.rank]
            micro, real = _micro_batches(
                SimpleNamespace(micro_batch_count=_lockstep(world), device=torch.device("cpu")), work, seq, 2
            )
            return len(micro), real, [s.advantage for mb in micro[real:] for s in mb]

        return on_ranks(2, on_rank)

    assert batches([5, 1]) == [(3, 3, []), (3, 1, [0.0, 0.0])]
    assert batches([0, 0]) == [(1, 0, [0.0])] * 2


def test_a_partitioned_members_ranks_run_as_many_scoring_passes(threaded_all_reduce, monkeypatch):
    """The intrinsic rewards' scoring pass of a partitioned ZeRO-3 member: rank 0 scores 3 responses, rank 1
    scores 5, in micro-batches of 2 (2 and 3 forwards): both must run 3 forwards (ZeRO-3 gathers weights in every
    one), rank 0 repeating a discarded one, and each keeps its own responses' statistics. Pins `intrinsic_scores`
    (the bug: passes=None) and `update.response_token_stats` (the bug: `passes` ignored)."""
    forwards: dict[str, int] = {}

    def per_position(model, prompts, responses, policy, fn):  # a forward: stats 1.0 on every response token
        forwards[model] = forwards.get(model, 0) + 1
        return torch.ones(len(responses), 2, 2), torch.ones(len(responses), 2), 0

    monkeypatch.setattr(update, "_per_position", per_position)
    responses = {0: 3, 1: 5}

    def on_rank(world):
        member = SimpleNamespace(
            partitioned=True,
            micro_batch_count=_lockstep(world),
            autocast=contextlib.nullcontext,
            updating=contextlib.nullcontext,
            scoring_module=f"rank {world.rank}",
            policy=lambda temperature: None,
        )
        run = SimpleNamespace(
            slots=[SimpleNamespace(member=member)],
            cfg=SimpleNamespace(train=SimpleNamespace(micro_batch_size=2), rollout=SimpleNamespace(temperature=1.0)),
        )
        group = SimpleNamespace(
            prompt=SimpleNamespace(inputs={}), responses=[SimpleNamespace(entropy_sum=None, token_ids=[1, 2])]
        )
        (stats,) = intrinsic_scores(run, [[group] * responses[world.rank]])
        return stats["entropy"].shape

    assert on_ranks(2, on_rank) == [(3, 1), (5, 1)]
    assert forwards == {"rank 0": 3, "rank 1": 3}
    forwards.clear()  # the pure function: passes beyond the micro-batches run and are discarded
    stats = response_token_stats("m", [{}] * 3, [[1, 2]] * 3, None, micro_batch_size=2, passes=4)
    assert forwards == {"m": 4} and stats["entropy"].tolist() == [1.0, 1.0, 1.0]


EVAL_DROP = {
    "slot": "a",
    "step": 20,
    "category": "color",
    "rule": "eval_drop",
    "benchmark": "easyvqa",
    "accuracy_step0": 0.9,
    "accuracy": 0.2,
    "max_drop": 0.2,
    "z": 3.0,
}


def test_a_collapse_stop_is_taken_by_every_rank(tmp_path):
    """Only world rank 0 holds the step's warnings; every rank must stop with its message (a rank that goes on
    waits forever in the next collective). Pins `loop.guard_phase` (the bug: each rank reading its own list)."""

    def on_rank(world):
        run = SimpleNamespace(
            cfg=SimpleNamespace(train=SimpleNamespace(on_collapse="stop")),
            world=world,
            run_dir=tmp_path,
            checkpoints=None,
        )
        return guard_phase(run, [EVAL_DROP] if world.is_main else [], 20)

    first, second = on_ranks(2, on_rank)
    assert first == second and first["action"] == "stop" and first["warning"] == EVAL_DROP
    assert "member 'a' in category 'color' at step 20" in first["message"]


def test_replicas_that_differ_on_one_rank_stop_every_rank(tmp_path):
    """Two ranks of member a hold weights 1.0 and 1.5: both must refuse to checkpoint; equal weights pass on both
    with every rank's checksum. Pins `_check_replicas` (the bug: each rank checking only its own checksum)."""

    def check(values):
        def on_rank(world):
            model = SimpleNamespace(id="a", full_weights=lambda: iter([("w", torch.tensor([values[world.rank]]))]))
            return _check_replicas(SimpleNamespace(world=world, run_dir=tmp_path), [model])

        return on_ranks(2, on_rank)

    assert check([1.0, 1.0]) == [{"a": {0: 1.0, 1: 1.0}}] * 2
    with pytest.raises(RuntimeError, match="the ranks of a member hold different weights"):
        check([1.0, 1.5])


def test_every_rank_stops_on_any_members_numerical_fault():
    """Member a lives on rank 0, b on rank 1; only b's update skipped a non-finite step, only a's rollout engine is
    off its policy: after the log phase's gather every rank holds both members' facts, so both guards stop every
    rank. Pins `step_metrics._gather_step_facts` (the bug: a rank's guards reading only its own members' stats)."""
    local = {
        0: {"a": {"is_abs_dlogp": 0.5, "nonfinite_skipped": 0}},
        1: {"b": {"is_abs_dlogp": 0.0, "nonfinite_skipped": 1}},
    }

    def on_rank(world):
        slot = SimpleNamespace(id="ab"[world.rank], renderer=SimpleNamespace(cached_bytes=0))
        run = SimpleNamespace(world=world, slots=[slot], plan=None)
        updates, _, _ = _gather_step_facts(run, local[world.rank], {slot.id: 1.0}, SimpleNamespace(peaks={}))
        stopped = []
        for guard in (
            lambda: check_rollout_mismatch(3, updates, 0.1, None),
            lambda: NonFiniteTracker(limit=1).observe(3, updates, None, report=False),
        ):
            try:
                guard()
            except (RolloutMismatchStopped, NonFiniteStopped) as err:
                stopped.append(type(err).__name__)
        return sorted(updates), stopped

    assert on_ranks(2, on_rank) == [(["a", "b"], ["RolloutMismatchStopped", "NonFiniteStopped"])] * 2


def test_every_rank_stops_when_one_ranks_disk_is_too_small(tmp_path, monkeypatch):
    """The checkpoints need 1 GB; rank 0's output_dir disk has 100 GB free, rank 1's (another node's) 1 MB: every
    rank must stop before any model loads, on the smallest free space. Pins `planning.check.check_disk` (the
    bug: each rank deciding from its own disk, so rank 0 goes on alone and waits forever)."""
    free = {0: 100e9, 1: 1e6}
    mine = threading.local()
    monkeypatch.setattr(check.shutil, "disk_usage", lambda where: SimpleNamespace(free=free[mine.rank]))
    cfg = SimpleNamespace(train=SimpleNamespace(check_memory="auto"), output_dir=str(tmp_path / "run"))
    disk = SimpleNamespace(total=1e9, one=0.5e9, copies=2, copies_text=lambda: "train.keep_last=2", best=0)

    def on_rank(world):
        mine.rank = world.rank
        try:
            check.check_disk(cfg, world, SimpleNamespace(disk=disk))
        except check.DiskTooSmall as err:
            return str(err)
        return None

    stopped = on_ranks(2, on_rank)
    assert stopped[0] == stopped[1] and "has 1.0 MB free" in stopped[0]


# ---- 2. schedules: start and end ---------------------------------------------------------------------------


def _update_run(
    teacher: torch.nn.Module, student: list, trainable=None, max_steps: int = 11, filter_zero_variance=False
):
    """What `update_phase` reads of a run: an EMA teacher slot following `student` ((name, tensor) weights),
    and optionally a trainable member "a" with one slot (index 0) whose update is recorded."""
    cfg = SimpleNamespace(
        train=SimpleNamespace(max_steps=max_steps),
        reward=SimpleNamespace(teacher_decay_start=0.5, teacher_decay_end=0.9),
        algo=SimpleNamespace(filter_zero_variance=filter_zero_variance),
        rollout=None,
    )
    frozen = SimpleNamespace(cfg=SimpleNamespace(trainable=False), model=teacher)
    engine = SimpleNamespace(sleep=lambda: None)  # the update puts every engine to sleep (vLLM sleep mode)
    slots = [SimpleNamespace(member=frozen, follows=SimpleNamespace(full_weights=lambda: iter(student)), engine=engine)]
    specs = [SlotSpec("a.teacher", "a", "original", teacher=True)]
    members = []
    if trainable is not None:
        slots.insert(
            0, SimpleNamespace(member=trainable, follows=None, engine=SimpleNamespace(sleep=lambda: None), index=0)
        )
        specs.insert(0, SlotSpec("a", "a", "original"))
        members = [trainable]
    return SimpleNamespace(cfg=cfg, slots=slots, specs=specs, members=members, shards={"a": range(0, 2)})


@pytest.mark.parametrize("step, decay", [(0, 0.5), (5, 0.7), (10, 0.9)])
def test_the_ema_teacher_moves_by_the_decay_of_its_step(step, decay):
    """reward.teacher_decay_start 0.5 at step 0, _end 0.9 at the last (10 of 11), 0.7 halfway (cosine): a teacher
    at 0 following a student at 1 moves to 1 - decay. Pins the call in `follow_students` (the bug: start and
    end swapped there, which the schedule's own test cannot see)."""
    teacher = torch.nn.Linear(1, 1, bias=False)
    teacher.weight.data.fill_(0.0)
    follow_students(_update_run(teacher, [("weight", torch.ones(1, 1))]), step)
    assert teacher.weight.item() == pytest.approx(1 - decay)


def test_the_learning_rate_warms_up_from_zero_then_falls_to_its_floor():
    """train.lr 1, warmup_ratio 0.25 of 8 updates (2 warmup steps), min_lr_ratio 0.1, by hand: 0, 0.5, then
    0.1 + 0.9 * (1 + cos(pi * (s - 2) / 6)) / 2 for s = 2..8: 1, 0.9397, 0.775, 0.55, 0.325, 0.1603, 0.1.
    Pins `Member.setup_optimizer`'s call of the schedule (the bugs: warmup and total steps swapped, the warmup
    and floor ratios swapped)."""
    me = SimpleNamespace(model=torch.nn.Linear(1, 1), device=CPU, cfg=SimpleNamespace(lr=None))
    Member.setup_optimizer(me, TrainConfig(lr=1.0, warmup_ratio=0.25, min_lr_ratio=0.1), 8)
    rates = []
    for _ in range(9):
        rates.append(me.optimizer.param_groups[0]["lr"])
        me.optimizer.step()
        me.scheduler.step()
    expected = [0.0, 0.5] + [0.1 + 0.9 * (1 + math.cos(math.pi * (s - 2) / 6)) / 2 for s in range(2, 9)]
    assert rates == pytest.approx(expected)
    assert rates[2:] == pytest.approx([1.0, 0.9397, 0.775, 0.55, 0.325, 0.1603, 0.1], abs=1e-4)


def test_the_training_slice_starts_at_skip_and_holds_limit_examples():
    """data.train.skip 5, limit 3: examples 5, 6 and 7 of the loader's order (a labelled warm-start slice before
    them stays disjoint). Pins `setup.load_training_examples` (the bug: limit read as the slice's end index,
    which leaves nothing after the skip)."""
    first = load_examples("easyvqa", split="train", limit=10).examples
    kept, _ = load_training_examples(DatasetConfig(loader="easyvqa", skip=5, limit=3))
    assert [ex.id for ex in kept] == [ex.id for ex in first[5:8]]


# ---- 3. call sites of two arguments of one type ------------------------------------------------------------


def _loss(monkeypatch, logp, old=None, *, ref=None, rollout=None, adv=(1.0,), norm=(1, 1, 1), **algo):
    """`update._micro_batch_loss` on one-token sequences whose current log-probs are `logp` (a reference
    model's `ref`, the engine's `rollout`); returns (loss, clipped mask, mismatch sums)."""
    logp = torch.tensor(logp).log().view(-1, 1).requires_grad_()
    member = SimpleNamespace(reference="reference")

    def logprobs(m, mb, policy, model=None, entropy=False):
        values = logp if model is None else torch.tensor(ref).log().view(-1, 1)
        return values, torch.ones_like(values), update.Ran(values.dtype, 0, values.detach() if entropy else None)

    monkeypatch.setattr(update, "_logprobs", logprobs)
    mb = [
        Sequence({}, [7], a, rollout_logprobs=None if rollout is None else [math.log(rollout[i])])
        for i, a in enumerate(adv)
    ]
    old_logp = None if old is None else torch.tensor(old).log().view(-1, 1)
    loss, clipped, _, sums, _ = _micro_batch_loss(member, mb, old_logp, AlgoConfig(**algo), None, norm)
    return loss.item(), clipped.view(-1).tolist(), sums


def test_the_ratio_is_clipped_at_one_minus_clip_low_and_one_plus_clip_high(monkeypatch):
    """clip_low 0.1, clip_high 0.6: the ratio is clipped to [0.9, 1.6]. A ratio 1.5 with advantage +1 is inside
    (loss -1.5); a ratio 0.5 with advantage -1 is clipped up to 0.9 (loss 0.9); token mean over 2 tokens: -0.3,
    clipped only on the second. Pins `update._micro_batch_loss` (the bug: clip_low and clip_high swapped into
    `clipped_surrogate`, which would clip the first and not the second)."""
    loss, clipped, _ = _loss(
        monkeypatch, [1.5, 0.5], [1.0, 1.0], adv=(1.0, -1.0), norm=(2, 2, 1), clip_low=0.1, clip_high=0.6
    )
    assert loss == pytest.approx(-0.3) and clipped == [False, True]


def test_the_importance_weight_is_the_trainers_probability_over_the_engines(monkeypatch):
    """The trainer gives the sampled token 0.6, the engine gave 0.3: weight min(0.6 / 0.3, cap 3) = 2, loss
    -1 x 1 x 2 = -2; KL sum r - 1 - log r at r = 2: 1 - log 2. Pins `update._micro_batch_loss` (the bug: train and
    rollout log-probs swapped into `rollout_is_weights`, weight 0.5)."""
    loss, _, sums = _loss(monkeypatch, [0.6], rollout=[0.3], rollout_is="token_truncated", rollout_is_cap=3.0)
    assert loss == pytest.approx(-2.0)
    assert sums["kl"] == pytest.approx(1 - math.log(2)) and sums["abs_dlogp"] == pytest.approx(math.log(2))


@pytest.mark.parametrize("estimator, kl", [("k3", 0.5 + math.log(2) - 1), ("k1", math.log(2))])
def test_the_kl_penalty_is_of_the_policy_from_its_reference(monkeypatch, estimator, kl):
    """The policy gives the token 0.5, the reference model 0.25 (advantage 0: the loss is the penalty alone,
    beta 0.5). k1 = log pi - log pi_ref = log 2; k3 with log_ratio = log(pi_ref / pi) = -log 2:
    exp(-log 2) + log 2 - 1 = 0.5 + log 2 - 1. Pins `update._micro_batch_loss` (the bug: the policy's and the
    reference's log-probs swapped into `kl_penalty`: -log 2, and 2 - log 2 - 1)."""
    loss, _, _ = _loss(monkeypatch, [0.5], ref=[0.25], adv=(0.0,), kl_beta=0.5, kl_estimator=estimator)
    assert loss == pytest.approx(0.5 * kl)


@pytest.mark.parametrize("agg, divisor", [("token_mean", 10), ("seq_mean_token_mean", 4), ("drgrpo", 4 * 3)])
def test_the_micro_batch_loss_is_normalised_by_the_whole_batchs_tokens_and_responses(monkeypatch, agg, divisor):
    """One token at ratio 1 and advantage +1 (loss -1) in a batch of 10 tokens over 4 responses (Dr.GRPO
    constant 3): token_mean divides by 10, seq_mean_token_mean by 4, drgrpo by 4 x 3. Pins the `norm` order in
    `update._micro_batch_loss` (the bug: total tokens and total responses swapped into `aggregate_loss`)."""
    loss, _, _ = _loss(monkeypatch, [0.5], norm=(10, 4, 3), loss_agg=agg)
    assert loss == pytest.approx(-1 / divisor)


def test_each_sequence_trains_on_its_advantage_and_its_groups_rewards_decide_the_filter():
    """Two examples, K = 2: rewards [1, 0] (advantages +-0.7) and [1, 1] (advantages 0, filtered out as a
    zero-variance group). The sequences carry the advantages, not the rewards, and the loss normaliser counts
    the trained group's 3 + 4 tokens. Pins the call of `_sequences` in `update_phase` (the bug:
    advantages and rewards swapped, both (B, K) tensors)."""
    recorded = {}

    def policy_update(m, seqs, algo, train, rollout, totals):
        recorded.update(seqs=seqs, totals=totals)
        return {}

    member = SimpleNamespace(id="a", cfg=SimpleNamespace(trainable=True))
    prompt = SimpleNamespace(inputs={})
    groups = [
        [
            SimpleNamespace(
                prompt=prompt, responses=[SimpleNamespace(token_ids=[1] * n, token_logprobs=None) for n in lens]
            )
            for lens in ([3, 4], [5, 6])
        ],
        [],
    ]
    rewards = torch.tensor([[[1.0, 0.0], [1.0, 1.0]], [[0.0, 0.0], [0.0, 0.0]]])
    advantages = [torch.tensor([[0.7, -0.7], [0.0, 0.0]]), torch.zeros(2, 2)]
    lengths = [[[3, 4], [5, 6]], [[1, 1], [1, 1]]]
    teacher = torch.nn.Linear(1, 1, bias=False)
    run = _update_run(teacher, [("weight", teacher.weight.detach())], trainable=member, filter_zero_variance=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(update_room, "policy_update", policy_update)
        update_phase(run, groups, advantages, rewards, lengths)
    seqs = recorded["seqs"]
    assert [(s.advantage, s.trained, len(s.token_ids)) for s in seqs] == [
        (pytest.approx(0.7), True, 3),
        (pytest.approx(-0.7), True, 4),
        (0.0, False, 5),
        (0.0, False, 6),
    ]
    assert recorded["totals"] == (7, 2)


def test_the_ranks_of_a_member_sample_with_one_seed_from_their_shards_positions():
    """A batch of 4 over 2 ranks (positions 0-1 and 2-3) at step 5: both ranks sample with the (run, slot,
    step) seed, each from its first batch position, so splitting the batch draws the same responses. Pins the call
    of `sampling_params` in `rollout_phase.rollout_phase` (the bug: step and first position swapped, both ints)."""
    cfg = SimpleNamespace(seed=3, rollout=RolloutConfig())
    seen = []

    def on_rank(rank: int):
        engine = SimpleNamespace(generate=lambda prompts, params: seen.append(params) or [])
        member = SimpleNamespace(id="a", cfg=SimpleNamespace(seed=0))
        slot = SimpleNamespace(index=1, id="a", member=member, follows=None, engine=engine)
        run = SimpleNamespace(cfg=cfg, slots=[slot], shards={"a": shard(4, (0, 1), rank)})
        rollout_phase(run, [[None, None]], 5)

    on_rank(0)
    on_rank(1)
    seed = sampling_params(cfg, 1, 0, 5).seed
    assert [(p.seed, p.first_position) for p in seen] == [(seed, 0), (seed, 2)]


def test_each_slots_renderer_gets_the_prompt_limit_and_the_image_cap(tiny_zoo, tmp_path):
    """rollout.max_prompt_tokens 777 and data.max_image_pixels 123456 (two ints side by side in `Renderer`'s
    signature) reach each slot's renderer, with data.prompt_cache_mb in bytes. Pins `slots.build_slots` (the
    bug: the limit and the cap swapped: no prompt would ever be too long)."""
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen3"])], reward={"mode": "self_vote"})
    cfg["rollout"]["max_prompt_tokens"] = 777
    cfg["data"].update(max_image_pixels=123456, prompt_cache_mb=3)
    cfg = config_from_dict(cfg)
    member = load_member(cfg.members[0], device=CPU)
    (slot,) = build_slots(cfg, [member], slot_specs(cfg.members, "members"), 0, None)
    renderer = slot.renderer
    assert (renderer.max_prompt_tokens, renderer.max_image_pixels, renderer.cache_bytes) == (777, 123456, 3 << 20)


def test_the_metrics_rows_read_categories_and_gold_in_their_places():
    """One slot, two questions of categories color and shape, gold red and circle; its label is red on both, its
    answers red twice and square twice. The row's pseudo-label accuracy is 1/2 (red = red; red != circle),
    its category stats are keyed by category, not by gold answer. Pins `step_metrics.metrics_rows` (the bug: categories
    and gold, both lists of strings, swapped into `category_metrics.category_step_stats`)."""
    batch = CohortBatch(
        ("a",), [[["red", "red"], ["square", "square"]]], [[["t"] * 2] * 2], [[[True] * 2] * 2], [None] * 2, [None] * 2
    )
    scored = RewardOutput(torch.tensor([[[1.0, 1.0], [0.0, 0.0]]]), {}, [["red", "red"]])
    outcome = StepOutcome(1, batch, scored, ["red", "circle"], ["color", "shape"], [[[2, 2], [2, 2]]], {}, {"a": 1.0})
    run = SimpleNamespace(
        cfg=SimpleNamespace(reward=SimpleNamespace(vote_threshold=0.0)),
        specs=[SlotSpec("a", "a", "original")],
        collapse=CollapseTracker(recent=1),
    )
    (row,), _ = metrics_rows(run, outcome)
    assert row["pseudo_label_acc"] == 0.5 and row["answer_acc"] == 0.5
    stats = row["category_stats"]
    assert sorted(stats) == ["color", "shape"]
    assert stats["color"]["pseudo_label_acc"] == [1.0, 1] and stats["shape"]["answer_acc"] == [0.0, 2]


def test_a_sampled_label_names_every_peer_whose_vote_it_counts():
    """peers of three: m0 votes "1<x<2", m1 "(1,2)" (one class: math-verify takes the interval for the inequality
    read first), m2 "3"; m2's label is the class's first vote "1<x<2", which both m0's and m1's votes gave. Pins
    `samples.sample_rows` (the bug: the label and a peer's vote swapped into `answers_equivalent`, which drops m1)."""
    answers = [[["1<x<2"] * 2], [["(1,2)"] * 2], [["3"] * 2]]
    batch = CohortBatch(("m0", "m1", "m2"), answers, [[["t"] * 2]] * 3, [[[True] * 2]] * 3, [None], [None])
    scored = REWARDS.get("peers").fn(batch, RewardConfig(mode="peers"))
    assert [labels[0] for labels in scored.labels] == [None, None, "1<x<2"]
    (row,) = sample_rows(
        1, [Example("q", "?")], batch, scored, [torch.zeros(1, 2)] * 3, SampleSettings("peers", 0.0, 1)
    )
    assert row["members"]["m2"]["label_from"] == ["m0", "m1"]


def test_a_best_model_is_replaced_only_by_a_strictly_better_new_score():
    """eval.keep_best: member a's new 0.6 beats its kept 0.5; b's new 0.5 ties its kept 0.5 (kept, not rewritten);
    c has none kept (its first evaluation always counts); a's score on another benchmark is not compared.
    Pins `guard.improved` (the bugs: the kept and the new score swapped, a tie counted as better)."""
    rows = [
        {"member": "a", "benchmark": "easyvqa", "score": 0.6},
        {"member": "b", "benchmark": "easyvqa", "score": 0.5},
        {"member": "c", "benchmark": "easyvqa", "score": 0.1},
        {"member": "a", "benchmark": "other", "score": 0.9},
    ]
    best = {
        "a": {"step": 10, "benchmark": "easyvqa", "score": 0.5},
        "b": {"step": 10, "benchmark": "easyvqa", "score": 0.5},
    }
    assert [r["member"] for r in improved(rows, "easyvqa", best)] == ["a", "c"]


def test_an_ema_teachers_rollout_copy_is_refreshed_from_its_weights():
    """An EMA teacher with HF rollouts below fp32 samples from a bf16 copy refreshed at every sync: the fp32
    weights (1.5, moved by the EMA) go into the copy (0.0, stale), never the reverse. Pins
    `Member.refresh_rollout_copy` (the bug: destination and source swapped, which would reset the teacher's weights
    to its stale copy; on a CPU the copy never exists, so no run shows it)."""
    weights, copy = torch.nn.Linear(1, 1, bias=False), torch.nn.Linear(1, 1, bias=False).bfloat16()
    weights.weight.data.fill_(1.5)
    copy.weight.data.fill_(0.0)
    Member.refresh_rollout_copy(SimpleNamespace(rollout_copy=copy, model=weights))
    assert (copy.weight.item(), copy.weight.dtype, weights.weight.item()) == (1.5, torch.bfloat16, 1.5)
