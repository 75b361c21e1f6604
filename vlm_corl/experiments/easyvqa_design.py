"""What the easy-vqa experiment trains: its base models, its budgets, the candidate cohorts the probe ranks and
the methods it compares (pure: from the probe's sampled records to the list of runs).

Base models (each its own balanced 1,000-question labelled slice of train before #20000, the demo's recipe):
  - one per zoo VLM family, slices 4,000 apart: qwen2_vl, qwen2_5_vl, mllama, gemma3, internvl;
  - the homogeneous side: four more qwen2_vl bases, other initialisations, on the slices of qwen2_5_vl,
    mllama, gemma3 and internvl (a balanced slice spans about 2,700 questions, so nine disjoint ones do not
    fit before #20000; this way the diverse and homogeneous cohorts see the same labelled data).
The paraphrased-views cohort is the qwen2_vl base asked in easy-vqa's other wordings (`paraphrase:K`; a
question with fewer wordings is asked in its own).

The pick: the cohort of three or more families whose `peers` label headroom that its members' own samples can
reach (vlm_corl.training.rewards.headroom, on the validation records of one sampled pass per base) is the highest. The
label-free reward of the main comparisons is `peers_ema` (chosen on validation); against the pick, at equal
size: the homogeneous cohort and the paraphrased-views cohort (`peers_ema` and `ring` each), `peers` on the
pick, `self_vote`, frozen peers and `gt` on the pick's bases. For the probe-vs-gain analysis, more cohorts
spread over the ranking.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from vlm_corl.models.base_models import BaseRecipe

DATA = "vlm_corl.experiments.easyvqa_data"
FAMILIES = ("qwen2_vl", "qwen2_5_vl", "mllama", "gemma3", "internvl")
HOMOGENEOUS = ("qwen2_vl", "qwen2_vl_b", "qwen2_vl_c", "qwen2_vl_d", "qwen2_vl_e")
PARAPHRASED = "qwen2_vl"  # the base of the paraphrased-views cohort
MAX_VIEWS = 5  # original + paraphrase:1..4 (yes/no questions have 4 wordings, shape 2-3, colour 2)


@dataclass(frozen=True)
class Budget:
    """Identical for every method of one experiment."""

    warm_steps: int
    rl_steps: int
    eval_limit: int  # test questions, balanced over the 3 question types
    probe_limit: int  # validation questions of the probe (and of base-model validation scores)
    seeds: int  # the main comparisons (the pick, homogeneous peers, self_vote, gt)
    more_seeds: int  # every other method
    frozen_seeds: int  # frozen peers: one run per trained member, so the most expensive method
    spread_seeds: int  # the cohorts spread over the probe's ranking (probe vs gain)
    batch_size: int = 16
    rl_lr: float = 4e-4
    rollout_n: int = 4
    max_new_tokens: int = 12


# The budget was chosen on validation (the label-free issue's measurements: at 480 steps x 16 questions, K 4,
# lr 4e-4, `gt` gained +5.6 and `peers` on five families +5.0 balanced validation points; at 120, +2.8; on the
# bases rebuilt since, `gt` +3.2 at 480 and +4.8 at 960 on a four-member pick: docs/experiment.md). 960 steps do
# not fit: a run of 480 takes about 7 minutes of one core. Seeds: 5 for the main comparisons, 1 for every other
# method, for frozen peers (one run per trained member) and for the cohorts spread over the probe's ranking
# (each adds one point to the probe-vs-gain analysis): what fits in 2.5 hours on 2 cores with the base models.
FULL = Budget(
    warm_steps=1000,
    rl_steps=480,
    eval_limit=600,
    probe_limit=600,
    seeds=5,
    more_seeds=1,
    frozen_seeds=1,
    spread_seeds=1,
)
QUICK = Budget(
    warm_steps=4,
    rl_steps=2,
    eval_limit=15,
    probe_limit=15,
    seeds=2,
    more_seeds=1,
    frozen_seeds=1,
    spread_seeds=1,
    batch_size=4,
    rollout_n=2,
)


def base_recipes(budget: Budget) -> dict[str, BaseRecipe]:
    """Every base model's recipe: the demo's (1,000 steps, lr 2e-3; mllama 4e-3, whose zero-initialised gated
    cross-attention needs it), on balanced 1,000-question slices before #20000 that share no question."""

    def recipe(family: str, k: int, start: int) -> BaseRecipe:
        lr = 4e-3 if family == "mllama" else 2e-3
        return BaseRecipe(
            family,
            "tiny",
            start,
            1000,
            steps=budget.warm_steps,
            lr=lr,
            init_seed=100 * k,
            balance="question_type",
            loader=f"{DATA}:labelled",
        )

    bases = {f: recipe(f, k, 4000 * k) for k, f in enumerate(FAMILIES)}
    # the homogeneous bases on the families' slices: the two sides differ by architecture only
    bases |= {b: recipe("qwen2_vl", 4 + k, 4000 * k) for k, b in enumerate(HOMOGENEOUS) if k}
    return bases


def views(n: int) -> list[str]:
    """The wordings of an n-member paraphrased-views cohort."""
    return ["original", *(f"paraphrase:{k}" for k in range(1, n))]


def probe_key(base: str, view: str = "original") -> str:
    """The name of a base's sampled validation records in one view."""
    return base if view == "original" else f"{base}@{view}"


# ---- candidate cohorts: name -> [(member id, base, view)] ---------------------------------------------------


Cohort = list[tuple[str, str, str]]


def diverse(bases: tuple[str, ...]) -> Cohort:
    return [(b, b, "original") for b in bases]


def paraphrased(n: int) -> Cohort:
    return [(f"view{k}", PARAPHRASED, v) for k, v in enumerate(views(n))]


def candidates() -> dict[str, Cohort]:
    """Every cohort the probe ranks: each set of 2-5 families, the homogeneous and the paraphrased-views cohorts
    of every size."""
    out = {"+".join(c): diverse(c) for n in range(2, len(FAMILIES) + 1) for c in itertools.combinations(FAMILIES, n)}
    for n in range(2, len(HOMOGENEOUS) + 1):
        out[f"homogeneous {n}"] = diverse(HOMOGENEOUS[:n])
        out[f"paraphrased {n}"] = paraphrased(n)
    return out


def cohort_records(cohort: Cohort, records: Mapping[str, list]) -> dict[str, list]:
    """{member id: its sampled validation records} of a cohort, in member order."""
    return {mid: records[probe_key(base, view)] for mid, base, view in cohort}


# ---- the methods ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Method:
    """One compared method: one or more training runs per seed (frozen peers: one per trained member), each a
    list of (member id, base, view, trainable) and the reward mode; `cohort`: its candidate-cohort name (the
    probe's figures), `seeds`: how many seeds it runs."""

    name: str
    mode: str
    cohort: str
    runs: tuple[tuple[tuple[str, str, str, bool], ...], ...]
    seeds: int
    role: str = ""  # "pick", "homogeneous", "self_vote", "gt", ... (the claims' names)
    tags: tuple[str, ...] = field(default=())

    @property
    def trained(self) -> dict[str, str]:
        """{trained member id: its base}."""
        return {mid: base for run in self.runs for mid, base, _, trainable in run if trainable}


def _run(cohort: Cohort, trainable: bool = True) -> tuple[tuple[str, str, str, bool], ...]:
    return tuple((mid, base, view, trainable) for mid, base, view in cohort)


def plan_methods(ranking: list[dict], budget: Budget) -> list[Method]:
    """The methods from the probe's ranking of the candidates (`vlm_corl.training.rewards.headroom.rank_cohorts` under
    `peers`, best first by reachable headroom): the pick is the best cohort of three or more families."""
    family_sets = [r for r in ranking if "+" in r["cohort"]]
    pick = next(r for r in family_sets if len(r["members"]) >= 3)["cohort"]
    members = tuple(pick.split("+"))
    n = len(members)
    d, h, p = diverse(members), f"homogeneous {n}", f"paraphrased {n}"
    homog, para = diverse(HOMOGENEOUS[:n]), paraphrased(n)
    main, more = budget.seeds, budget.more_seeds
    # The label-free reward of the main comparisons is `peers_ema` (the plurality of the other members' EMA
    # teachers): chosen on validation, where `peers` lost 5.3 points at 960 steps as its labels drifted with the
    # learners and `peers_ema` held (+0.5; docs/experiment.md). `peers`, the paper's, runs beside it on the pick.
    methods = [
        Method(f"peers_ema, picked {pick}", "peers_ema", pick, (_run(d),), main, "pick"),
        Method(f"peers_ema, {h}", "peers_ema", h, (_run(homog),), main, "homogeneous"),
        Method("self_vote (TTRL)", "self_vote", pick, (_run(d),), main, "self_vote"),
        Method("gt (labels)", "gt", pick, (_run(d),), main, "gt"),
        Method(f"peers, picked {pick}", "peers", pick, (_run(d),), more, "pick_peers"),
        Method(f"ring, picked {pick}", "ring", pick, (_run(d),), more, "pick_ring"),
        Method(f"ring, {h}", "ring", h, (_run(homog),), more),
        Method(f"peers_ema, {p}", "peers_ema", p, (_run(para),), more, "paraphrased"),
        Method(f"ring, {p}", "ring", p, (_run(para),), more),
    ]
    # frozen peers: member i learns from the others' votes while they do not move (one run per trained member)
    frozen = tuple(
        tuple((mid if mid == own else f"{mid}_frozen", base, view, mid == own) for mid, base, view in d)
        for own, _, _ in d
    )
    methods.append(Method("frozen peers", "peers", pick, frozen, budget.frozen_seeds, "frozen"))
    # more cohorts for the probe-vs-gain analysis: the five families, and family sets spread over the ranking
    spread = [r["cohort"] for r in family_sets if r["cohort"] != pick and len(r["members"]) >= 3]
    extra = list(dict.fromkeys(["+".join(FAMILIES), spread[-1], spread[len(spread) // 2]]))
    pairs = [r["cohort"] for r in family_sets if len(r["members"]) == 2]
    extra += [pairs[0], pairs[-1]]
    for c in extra:
        mode = "ring" if c.count("+") == 1 else "peers_ema"  # of two members, each one's peers are the other
        if c != pick:
            methods.append(
                Method(
                    f"{mode}, {c}",
                    mode,
                    c,
                    (_run(diverse(tuple(c.split("+")))),),
                    budget.spread_seeds,
                    tags=("spread",),
                )
            )
    return methods


def slug(name: str) -> str:
    """A method's name as a directory name."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
