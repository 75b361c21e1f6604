"""Label headroom: how much a label-free reward can teach each member, measured before training.

Members are scored greedily, so what training a member against a pseudo-label can move is bounded by how often
the label is right where the member's own vote is wrong, minus how often it is wrong where the vote is right.
That difference, per member and reward topology, is its **label headroom** (docs/method.md):

    headroom_i = P(label_i right, vote_i wrong) − P(label_i wrong, vote_i right)        (0 where label_i abstains)

- `self_vote`: the label is the vote itself, so the headroom is 0 by construction (it can only sharpen);
- `ring` of N: summed over the ring the headroom is exactly 0 when no vote abstains (member i's label is member
  i−1's vote);
- `peers`: the plurality of the others is right more often than any one of them when their errors are
  independent, so the sum can be positive; `soft` is scored by its logged label (the others' consensus);
- `gt`: the labels are gold, the ceiling (the share of questions each vote gets wrong).

The labels are computed by the reward modes' own functions (`vlm_corl.training.rewards.modes`) on each member's K
sampled answers per question at the training temperature: one sampled pass per base model, every cohort's
figures from those records. Gold answers are used only to score the labels and votes.

`reachable`: the part of the headroom a member's own samples can reach. GRPO moves a member only towards a
label one of its K samples matches (otherwise every response of the group earns 0: no variance, no gradient),
so a member at chance with one constant answer cannot learn from its peers however right they are.

Beside it, `settled`: what the confidence argument predicts. A member whose K samples all agree gets no
reward variance and does not move, so per question the cohort drifts towards its most self-consistent
member's vote (the consensus of the most self-consistent members' votes when several tie; a split abstains).
`settled_headroom` is the headroom of that answer used as every member's label.
"""

from __future__ import annotations

import itertools
import statistics
from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence

from vlm_corl.data.answers import answers_equivalent, group_equivalent
from vlm_corl.evaluation.pairs import pair_metrics
from vlm_corl.evaluation.stats import mean_ci

TOPOLOGIES = ("ring", "peers", "soft", "self_vote", "gt")


# ---- pure maths on one question ----------------------------------------------------------------------------


def headroom_term(label: str | None, vote: str | None, gold: str) -> int:
    """+1 when `label` is right and `vote` wrong, −1 when `label` is wrong and `vote` right, else 0 (an
    abstaining label, None, counts 0: it neither teaches nor misleads)."""
    if label is None:
        return 0
    return int(answers_equivalent(gold, label)) - int(vote is not None and answers_equivalent(gold, vote))


def reachable_term(label: str | None, vote: str | None, gold: str, answers: Sequence[str | None]) -> int:
    """`headroom_term`, counted only where one of the member's K sampled `answers` matches the label: GRPO moves a
    member only towards a label some of its samples earn reward for (a group that never matches its label has no
    reward variance, so no gradient). A member that answers one constant cannot be taught anything else."""
    if label is None or not any(answers_equivalent(label, a) for a in answers):
        return 0
    return headroom_term(label, vote, gold)


def self_consistency(answers: Sequence[str | None], vote: str | None) -> float:
    """Share of the K answers equivalent to `vote` (0.0 when the member abstains)."""
    if vote is None or not answers:
        return 0.0
    return sum(answers_equivalent(vote, a) for a in answers) / len(answers)


def settled_answer(votes: Sequence[str | None], consistency: Sequence[float]) -> str | None:
    """The vote of the most self-consistent member; several tied at the top: the plurality of their votes,
    and None when that plurality ties (or nobody votes)."""
    best = max(consistency, default=0.0)
    if best == 0.0:
        return None
    top = [v for v, c in zip(votes, consistency) if c == best and v is not None]
    classes = group_equivalent(top)
    counts = Counter(classes).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return None
    return top[classes.index(counts[0][0])]


# ---- a cohort on sampled records ---------------------------------------------------------------------------


def aligned(records: Mapping[str, Sequence[Mapping]]) -> tuple[list[str], dict[str, list[Mapping]]]:
    """The question ids every member's records share (in the first member's order) and each member's records
    in that order; every record needs "preds" (its K sampled answers)."""
    names = list(records)
    ids = [r["id"] for r in records[names[0]]]
    by_id = {name: {r["id"]: r for r in rs} for name, rs in records.items()}
    missing = {name: len(set(ids) ^ set(rows)) for name, rows in by_id.items() if set(rows) != set(ids)}
    if missing:
        raise ValueError(f"the members' sampled records cover different questions: {missing}")
    for name, rows in by_id.items():
        if any("preds" not in r for r in rows.values()):
            raise ValueError(f"{name}'s records hold no sampled answers ('preds'): sample K > 1 answers per question")
    return ids, {name: [by_id[name][i] for i in ids] for name in names}


def cohort_labels(records: Mapping[str, Sequence[Mapping]], mode: str, reward_cfg=None) -> dict:
    """Every member's label, own vote and self-consistency per question under reward `mode`, computed by the
    mode's registered function on a `CohortBatch` of the members' sampled answers (member order = the order of
    `records`, which is the ring order). Returns {"ids", "types", "gold", "members", "answers" (N, B, K),
    "labels" (N, B), "votes" (N, B), "consistency" (N, B)}."""
    from vlm_corl.config.schema import RewardConfig
    from vlm_corl.registry import REWARDS
    from vlm_corl.training.rewards.modes import CohortBatch, member_votes

    cfg = reward_cfg or RewardConfig(mode=mode)
    ids, rows = aligned(records)
    names = list(rows)
    answers = [[list(r["preds"]) for r in rows[name]] for name in names]
    gold = [r["gold"] for r in rows[names[0]]]
    spec = REWARDS.get(mode)
    if spec.layout != "members" or spec.needs_scores:
        raise ValueError(f"reward mode {mode!r} does not label members by their answers: no label headroom")
    batch = CohortBatch(
        member_ids=tuple(names),
        answers=answers,
        texts=[[[a or "" for a in group] for group in member] for member in answers],
        format_ok=[[[True] * len(group) for group in member] for member in answers],
        choices=[None] * len(ids),
        gold=gold if spec.uses_gold else [None] * len(ids),
    )
    labels = spec.fn(batch, cfg).labels
    votes = member_votes(batch, cfg.vote_threshold)
    consistency = [[self_consistency(a, v) for a, v in zip(member, vs)] for member, vs in zip(answers, votes)]
    return {
        "ids": ids,
        "types": [r.get("type") for r in rows[names[0]]],
        "gold": gold,
        "members": names,
        "answers": answers,
        "labels": labels,
        "votes": votes,
        "consistency": consistency,
    }


def _summary(terms: Sequence[float], types: Sequence[str | None]) -> dict:
    """mean ± 95% interval of per-question `terms`, overall and per question type."""
    by_type: dict[str, list[float]] = defaultdict(list)
    for t, v in zip(types, terms):
        if t is not None:
            by_type[str(t)].append(v)
    return {"all": mean_ci(list(terms)), "by_type": {t: mean_ci(v) for t, v in sorted(by_type.items())}}


def member_headroom(labelled: Mapping) -> dict[str, dict]:
    """Per member: its headroom (mean ± interval of `headroom_term`, overall and per type), the part of it its
    own samples can reach (`reachable_term`), the share of questions its label abstains on, and its vote's
    accuracy."""
    out = {}
    for i, name in enumerate(labelled["members"]):
        labels, votes, gold = labelled["labels"][i], labelled["votes"][i], labelled["gold"]
        terms = [headroom_term(lab, v, g) for lab, v, g in zip(labels, votes, gold)]
        reach = [reachable_term(lab, v, g, a) for lab, v, g, a in zip(labels, votes, gold, labelled["answers"][i])]
        out[name] = {
            "headroom": _summary(terms, labelled["types"]),
            "reachable": _summary(reach, labelled["types"]),
            "abstain": sum(lab is None for lab in labels) / len(labels),
            "vote_accuracy": _summary(
                [float(v is not None and answers_equivalent(g, v)) for v, g in zip(votes, gold)], labelled["types"]
            ),
        }
    return out


def cohort_headroom(labelled: Mapping) -> dict:
    """The cohort's headroom: per question the mean over its members of `headroom_term`, summarised (mean ±
    interval, overall and per type); the same of `reachable_term`; every member's own figures."""
    n = len(labelled["members"])
    per_q = [
        statistics.fmean(headroom_term(labelled["labels"][i][j], labelled["votes"][i][j], g) for i in range(n))
        for j, g in enumerate(labelled["gold"])
    ]
    reach = [
        statistics.fmean(
            reachable_term(labelled["labels"][i][j], labelled["votes"][i][j], g, labelled["answers"][i][j])
            for i in range(n)
        )
        for j, g in enumerate(labelled["gold"])
    ]
    members = member_headroom(labelled)
    return {
        "headroom": _summary(per_q, labelled["types"]),
        "reachable": _summary(reach, labelled["types"]),
        "abstain": statistics.fmean(m["abstain"] for m in members.values()),
        "members": members,
    }


def settled(labelled: Mapping) -> dict:
    """The confidence prediction: per question the answer the cohort settles on (`settled_answer`), its
    accuracy, and the cohort's headroom with that answer as every member's label."""
    n = len(labelled["members"])
    answers = [
        settled_answer([labelled["votes"][i][j] for i in range(n)], [labelled["consistency"][i][j] for i in range(n)])
        for j in range(len(labelled["gold"]))
    ]
    gold, types = labelled["gold"], labelled["types"]
    right = [float(a is not None and answers_equivalent(g, a)) for a, g in zip(answers, gold)]
    per_q = [
        statistics.fmean(headroom_term(a, labelled["votes"][i][j], gold[j]) for i in range(n))
        for j, a in enumerate(answers)
    ]
    return {
        "accuracy": _summary(right, types),
        "headroom": _summary(per_q, types),
        "abstain": sum(a is None for a in answers) / len(answers),
    }


def vote_pairs(labelled: Mapping) -> dict:
    """Cohen's κ and p_A + p_B of the members' vote correctness (`vlm_corl.evaluation.pairs.pair_metrics`), the
    mean over every pair of members (None for a one-member cohort)."""

    right = [
        [v is not None and answers_equivalent(g, v) for v, g in zip(votes, labelled["gold"])]
        for votes in labelled["votes"]
    ]
    pairs = [
        pair_metrics(right[a], right[b], labelled["votes"][a], labelled["votes"][b])
        for a, b in itertools.combinations(range(len(right)), 2)
    ]
    kappas = [p["kappa"] for p in pairs if p["kappa"] is not None]
    return {
        "kappa": statistics.fmean(kappas) if kappas else None,
        "acc_sum": statistics.fmean(p["acc_sum"] for p in pairs) if pairs else None,
    }


def cohort_report(records: Mapping[str, Sequence[Mapping]], modes: Sequence[str] = TOPOLOGIES) -> dict:
    """Everything the probe says about one cohort (its members' sampled records, in member order): per mode its
    headroom (`cohort_headroom`), the confidence prediction (`settled`), and κ and p_A + p_B of the votes."""
    labelled = {mode: cohort_labels(records, mode) for mode in modes}
    first = labelled[modes[0]]
    return {
        "members": list(records),
        "n": len(first["ids"]),
        "modes": {mode: cohort_headroom(lab) for mode, lab in labelled.items()},
        "settled": settled(first),
        **vote_pairs(first),
    }


def rank_cohorts(
    cohorts: Mapping[str, Mapping[str, Sequence[Mapping]]], mode: str = "peers", by: str = "reachable"
) -> list[dict]:
    """Every candidate cohort ({name: {member id: its sampled records}}, members in ring order) with its
    `cohort_report`, best first by the cohort's mean `by` ("reachable" or "headroom") under `mode`, numbered by
    "rank". Reachable by default: headroom a member's samples never reach (a member with one constant answer on
    a type) cannot be learnt, and in the easy-vqa experiment it was most of the best cohort's headroom."""
    reports = [{"cohort": name, **cohort_report(records)} for name, records in cohorts.items()]
    reports.sort(key=lambda r: (-r["modes"][mode][by]["all"]["mean"], -r["modes"][mode]["headroom"]["all"]["mean"]))
    for rank, r in enumerate(reports, 1):
        r["rank"] = rank
    return reports


# ---- report ------------------------------------------------------------------------------------------------


def _pts(ci: Mapping) -> str:
    return f"{100 * ci['mean']:+.1f} ± {100 * ci['ci']:.1f}"


def ranking_markdown(
    ranking: Sequence[Mapping], shown: Sequence[Mapping] | None = None, mark: set = frozenset()
) -> list[str]:
    """The ranked cohorts (`rank_cohorts` / the experiment's ranking; `shown`: a subset of them) as a Markdown
    table, in points: peers headroom ± 95% interval, per type, abstain share, ring headroom, the confidence
    prediction, κ and p_A + p_B of the votes; cohorts in `mark` are flagged "(trained)"."""
    types = sorted({t for r in ranking for t in r["modes"]["peers"]["headroom"]["by_type"]})
    lines = [
        "| rank | cohort | peers headroom | " + " | ".join(types) + " | reachable | abstain | ring headroom "
        "| settled accuracy | settled headroom | kappa | p_A+p_B (mean pair) |",
        "|---|---|---|" + "---|" * len(types) + "---|---|---|---|---|---|---|",
    ]
    for r in shown if shown is not None else ranking:
        peers, ring, s = r["modes"]["peers"], r["modes"]["ring"], r["settled"]
        by_type = [f"{100 * peers['headroom']['by_type'][t]['mean']:+.1f}" for t in types]
        kappa = "n/a" if r["kappa"] is None else f"{r['kappa']:.3f}"
        acc_sum = "n/a" if r["acc_sum"] is None else f"{r['acc_sum']:.3f}"
        lines.append(
            f"| {r['rank']} | {r['cohort']}{' (trained)' if r['cohort'] in mark else ''} | "
            f"{_pts(peers['headroom']['all'])} | " + " | ".join(by_type) + f" | {_pts(peers['reachable']['all'])} | "
            f"{peers['abstain']:.2f} | "
            f"{_pts(ring['headroom']['all'])} | {s['accuracy']['all']['mean']:.3f} | {_pts(s['headroom']['all'])} | "
            f"{kappa} | {acc_sum} |"
        )
    return lines


HEADROOM_NOTE = (
    "Label headroom, in points: per member, the share of questions its label (the reward mode's own labels, from "
    "the members' K sampled answers) is right where its own vote is wrong, minus the reverse (0 where the label "
    "abstains); a cohort's is the mean over its members, with a 95% interval over questions. Reachable: the part "
    "where one of the member's own K samples matches its label (GRPO has no gradient otherwise). Settled: per question "
    "the vote of the most self-consistent member (the confidence prediction), its accuracy and its headroom. Gold "
    "answers are used only to score."
)
