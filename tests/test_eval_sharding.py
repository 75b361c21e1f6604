"""In-loop evaluation is split over a member's ranks: each rank answers its contiguous share of the questions,
and the scores come from all the shares' records, the same as one rank answering everything (before, the
member's first rank evaluated alone while the others waited in a collective, up to the NCCL watchdog)."""

from __future__ import annotations

import types

from cohort_helpers import cohort

from vlm_corl.config import MemberConfig, config_from_dict
from vlm_corl.config.schema import EvalConfig
from vlm_corl.members.member import load_member
from vlm_corl.training.phases.eval_phase import evaluate_cohort


class RecordingWorld:
    """One rank's view of the world: all_gather returns its own object and those given for the other ranks."""

    def __init__(self, rank: int, others: dict | None = None):
        self.rank, self.others, self.sent = rank, others or {}, []

    def all_gather(self, obj):
        self.sent.append(obj)
        parts = {**self.others, self.rank: obj}
        return [parts[r] for r in sorted(parts)]


def test_a_members_ranks_share_its_evaluation_and_score_it_as_one(tiny_zoo, tmp_path):
    cfg = config_from_dict(cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("l", tiny_zoo["mllama"])]))
    member = load_member(MemberConfig(id="q", model=str(tiny_zoo["qwen2_vl"]), trainable=False))
    eval_cfg = EvalConfig(benchmarks=["easyvqa"], limit=9, every=1)

    def run(rank, placement, others=None):
        world = RecordingWorld(rank, others)
        ns = types.SimpleNamespace(cfg=cfg, members=[member], placement=placement, world=world, slots=[])
        return evaluate_cohort(ns, eval_cfg, step=3), world.sent[0]

    rows_1, shares_1 = run(1, {"q": (0, 1)})
    rows_0, shares_0 = run(0, {"q": (0, 1)}, others={1: shares_1})
    whole, _ = run(0, {"q": (0,)})
    ids_0 = [r["id"] for r in shares_0["q"][0]]
    ids_1 = [r["id"] for r in shares_1["q"][0]]
    assert len(ids_0) == 5 and len(ids_1) == 4 and not set(ids_0) & set(ids_1)  # contiguous halves, 9 questions
    assert ids_0 + ids_1 == [r["id"] for r in _records(member, eval_cfg)]
    assert rows_1[0]["n"] == 4  # a rank alone sees only its share
    assert rows_0 == whole and rows_0[0]["n"] == 9 and rows_0[0]["skipped_too_long"] == 0


def _records(member, eval_cfg):
    from vlm_corl.evaluation.scoring import benchmark_examples, evaluate_member
    from vlm_corl.registry import BENCHMARKS

    bench = BENCHMARKS.get("easyvqa")
    return evaluate_member(member, benchmark_examples(bench, eval_cfg.limit), bench)["records"]
