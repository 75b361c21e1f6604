"""The easy-vqa experiment's numbers, from its results (pure functions of results.json's "seeds", "bases" and
"probe", so `--plots-only` recomputes them): the method table (mean ± 95% t-interval over seeds), the probe of
every cohort, the probe-vs-gain table with Spearman's rank correlation, the verdict on each claim, results.md
and the probe-vs-gain plot.

Gains are balanced accuracy on easy-vqa test (the mean over yes/no, shape and colour) after training minus
that of the member's own base model; a cohort's gain is the mean over its trained members.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from vlm_corl.experiments.easyvqa_data import TYPES
from vlm_corl.experiments.stats import mean_ci, spearman, t975

KEYS = ("accuracy", *TYPES)  # "accuracy" is the balanced accuracy (test questions are balanced by type)


# ---- per seed --------------------------------------------------------------------------------------------


def member_deltas(run: Mapping, base_tests: Mapping[str, Mapping]) -> dict[str, dict[str, float]]:
    """{member: {key: after, "d_" + key: after − base}} for every evaluated member of one run; `base_tests`
    maps member id -> its base model's test result."""
    out = {}
    for mid, after in run["eval"].items():
        before = base_tests[mid]
        row = {"accuracy": after["accuracy"], **after["by_type"]}
        base = {"accuracy": before["accuracy"], **before["by_type"]}
        out[mid] = {**row, **{f"d_{k}": row[k] - base[k] for k in KEYS}}
    return out


def cohort_mean(deltas: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The mean over a run's trained members of every number `member_deltas` gives."""
    keys = next(iter(deltas.values())).keys()
    return {k: statistics.fmean(d[k] for d in deltas.values()) for k in keys}


def per_seed(results: Mapping, base_of: Callable[[str, str], str]) -> dict[str, dict[str, dict]]:
    """{method: {seed: {"members": member_deltas, "cohort": cohort_mean}}}; `base_of(method, member)` names the
    member's base model (a key of results["bases"])."""
    out: dict[str, dict[str, dict]] = {}
    for seed, methods in results["seeds"].items():
        for method, run in methods.items():
            deltas = member_deltas(run, {mid: results["bases"][base_of(method, mid)]["test"] for mid in run["eval"]})
            out.setdefault(method, {})[seed] = {"members": deltas, "cohort": cohort_mean(deltas)}
    return out


# ---- over seeds ------------------------------------------------------------------------------------------


def method_table(seeded: Mapping[str, Mapping[str, Mapping]]) -> dict[str, dict[str, dict[str, dict]]]:
    """{method: {member or "cohort": {key: mean_ci over seeds}}}."""
    table: dict = {}
    for method, seeds in seeded.items():
        rows: dict[str, dict[str, list[float]]] = {}
        for s in seeds.values():
            for who, numbers in [*s["members"].items(), ("cohort", s["cohort"])]:
                for k, v in numbers.items():
                    rows.setdefault(who, {}).setdefault(k, []).append(v)
        table[method] = {who: {k: mean_ci(v) for k, v in nums.items()} for who, nums in rows.items()}
    return table


def base_table(bases: Mapping[str, Mapping]) -> dict[str, dict[str, float]]:
    """{base id: {key: accuracy}} of the base models on the scored split (built once: no interval)."""
    return {bid: {"accuracy": b["test"]["accuracy"], **b["test"]["by_type"]} for bid, b in bases.items()}


def paired(seeded: Mapping, a: str, b: str, key: str = "d_accuracy") -> dict:
    """mean_ci over the seeds both methods ran of (cohort[key] of a − that of b)."""
    seeds = sorted(set(seeded[a]) & set(seeded[b]))
    return mean_ci([seeded[a][s]["cohort"][key] - seeded[b][s]["cohort"][key] for s in seeds])


PROBE_KEYS = ("kappa", "acc_sum", "complementarity", "same_wrong")


def cohort_probe(pairs: Mapping[str, Mapping], bases: Sequence[str]) -> dict[str, dict[str, float | None]]:
    """{"all" or type: {probe key: the mean over the cohort's pairs}} from `pairs` ({"X+Y": pair_report}); an
    undefined kappa is left out of its mean (None when every pair's is undefined)."""
    reports = [
        pairs[f"{a}+{b}"] if f"{a}+{b}" in pairs else pairs[f"{b}+{a}"]
        for i, a in enumerate(bases)
        for b in bases[i + 1 :]
    ]
    out: dict[str, dict[str, float | None]] = {}
    for t in ("all", *sorted(reports[0]["by_type"])):
        metrics = [r["overall"] if t == "all" else r["by_type"][t] for r in reports]
        values = {k: [m[k] for m in metrics if m[k] is not None] for k in PROBE_KEYS}
        out[t] = {k: statistics.fmean(v) if v else None for k, v in values.items()}
    return out


# ---- does the probe predict the gain? ----------------------------------------------------------------------


def rank_test(x: Sequence[float], y: Sequence[float]) -> dict:
    """Spearman's ρ with its t statistic t = ρ √((n − 2) / (1 − ρ²)) and whether |t| clears the two-sided 5%
    critical value t_{0.975, n−2} (the usual large-sample test; n ≥ 3)."""
    rho = spearman(x, y)
    n = len(x)
    if rho is None or n < 3:
        return {"rho": rho, "n": n, "t": None, "significant": False}
    t = math.inf if abs(rho) == 1 else rho * math.sqrt((n - 2) / (1 - rho * rho))
    return {"rho": rho, "n": n, "t": t, "significant": abs(t) > t975(n - 2)}


def probe_vs_gain(seeded: Mapping, probes: Mapping[str, Mapping], methods: Sequence[str]) -> dict:
    """One row per cohort (method): its probe before training (`probes[method]`, `cohort_probe` on
    validation) and its label-free gain after training (mean_ci over seeds of the cohort's Δ balanced accuracy
    and Δ colour), and the rank correlation over the cohorts of each probe number with the mean gain."""
    rows = []
    for method in methods:
        p = probes[method]
        seeds = seeded[method].values()
        rows.append(
            {
                "method": method,
                **{k: p["all"][k] for k in PROBE_KEYS},
                "kappa_color": p["color"]["kappa"],
                "acc_sum_color": p["color"]["acc_sum"],
                "gain": mean_ci([s["cohort"]["d_accuracy"] for s in seeds]),
                "gain_color": mean_ci([s["cohort"]["d_color"] for s in seeds]),
            }
        )
    tests = {}
    for x in ("kappa", "acc_sum", "complementarity"):
        usable = [r for r in rows if r[x] is not None]
        tests[x] = rank_test([r[x] for r in usable], [r["gain"]["mean"] for r in usable])
    return {"rows": rows, "spearman": tests}


# ---- claims ------------------------------------------------------------------------------------------------


def verdict(ci: Mapping, threshold: float, above: bool) -> str:
    """ "supported" when the whole 95% interval lies on the claimed side of `threshold` (above it, or at or
    below it), "not supported" when it lies wholly on the other side, else "inconclusive"."""
    lo, hi = ci["mean"] - ci["ci"], ci["mean"] + ci["ci"]
    if above:
        return "supported" if lo > threshold else "not supported" if hi <= threshold else "inconclusive"
    return "supported" if hi <= threshold else "not supported" if lo > threshold else "inconclusive"


def pts(ci: Mapping) -> str:
    """A mean ± interval of a fraction in points (percentage points)."""
    return f"{100 * ci['mean']:+.1f} ± {100 * ci['ci']:.1f} points"


def entropy_change(results: Mapping, method: str, key: str = "answer_entropy_batch") -> dict[str, float]:
    """{seed: the change of `key` over training (mean of the last logged steps − mean of the first), averaged
    over the run's trained members that logged it}: the batch answer entropy falls when a member gives one
    answer to every question, the collapse signature. Seeds where no member logged it are left out."""
    out = {}
    for seed, methods in results["seeds"].items():
        pairs = [d[key] for d in methods.get(method, {}).get("diversity", {}).values()]
        changes = [last - first for first, last in pairs if first is not None and last is not None]
        if changes:
            out[seed] = statistics.fmean(changes)
    return out


def mean_ci_or_none(values: Sequence[float]) -> dict | None:
    return mean_ci(values) if values else None


def diversity_claim(results: Mapping, comp: str, self_vote: str) -> tuple:
    """Claim (e): the change of the batch answer entropy over training of self_vote, of Co-RL (`comp`) and
    their paired difference (mean_ci over seeds, or None), and the verdict: supported when self_vote's falls
    and Co-RL's stays above it."""
    e_self, e_comp = entropy_change(results, self_vote), entropy_change(results, comp)
    d_self, d_comp = mean_ci_or_none(list(e_self.values())), mean_ci_or_none(list(e_comp.values()))
    d_pair = mean_ci_or_none([e_comp[s] - e_self[s] for s in sorted(set(e_self) & set(e_comp))])
    if d_self is None or d_pair is None:
        return d_self, d_comp, d_pair, "inconclusive"
    falls, apart = verdict(d_self, 0.0, above=False), verdict(d_pair, 0.0, above=True)
    if falls == apart == "supported":
        return d_self, d_comp, d_pair, "supported"
    return d_self, d_comp, d_pair, "not supported" if "not supported" in (falls, apart) else "inconclusive"


def prediction_verdict(kappa: Mapping, acc_sum: Mapping) -> str:
    """Claim (f) from the rank tests of the gain against kappa (lower kappa, more complementary: a negative
    rho predicts) and against p_A + p_B (a positive rho predicts): supported when both predict at 5%, partly
    when one does, else not supported."""
    by_kappa = bool(kappa["significant"]) and kappa["rho"] < 0
    by_sum = bool(acc_sum["significant"]) and acc_sum["rho"] > 0
    if by_kappa and by_sum:
        return "supported"
    if by_kappa or by_sum:
        yes, no = ("kappa", "p_A + p_B") if by_kappa else ("p_A + p_B", "kappa")
        return f"partly supported ({yes} predicts, {no} does not)"
    return "not supported"


def claims(results: Mapping, seeded: Mapping, pg: Mapping, names: Mapping[str, str]) -> list[dict]:
    """The issue's claims (a)-(f) against the data. `names`: {"complementary", "homogeneous", "self_vote",
    "gt"} -> method names."""
    comp = names["complementary"]
    gain = mean_ci([s["cohort"]["d_accuracy"] for s in seeded[comp].values()])
    vs_self = paired(seeded, comp, names["self_vote"])
    gap = paired(seeded, names["gt"], comp)
    vs_homog = paired(seeded, comp, names["homogeneous"])
    d_self, d_comp, d_pair, collapse = diversity_claim(results, comp, names["self_vote"])
    k, s = pg["spearman"]["kappa"], pg["spearman"]["acc_sum"]
    predicts = prediction_verdict(k, s)

    def rho(t):
        significant = ", p < 0.05" if t["significant"] else ""
        return "n/a" if t["rho"] is None else f"{t['rho']:+.2f} (n = {t['n']}{significant})"

    return [
        {
            "claim": "(a) Co-RL on the complementary pair gains >= +5 points over its base",
            "evidence": f"gain {pts(gain)}",
            "verdict": verdict(gain, 0.05, above=True),
        },
        {
            "claim": "(b) it beats self_vote",
            "evidence": f"paired difference {pts(vs_self)}",
            "verdict": verdict(vs_self, 0.0, above=True),
        },
        {
            "claim": "(c) it comes within 2 points of gt",
            "evidence": f"gt − it: {pts(gap)}",
            "verdict": verdict(gap, 0.02, above=False),
        },
        {
            "claim": "(d) the complementary pair gains more than the homogeneous one",
            "evidence": f"paired difference {pts(vs_homog)}",
            "verdict": verdict(vs_homog, 0.0, above=True),
        },
        {
            "claim": "(e) self_vote's answer diversity collapses while Co-RL's does not",
            "evidence": f"change of the batch answer entropy over training (nats): self_vote {ci_text(d_self, True)}, "
            f"Co-RL complementary {ci_text(d_comp, True)}, difference {ci_text(d_pair, True)}",
            "verdict": collapse,
        },
        {
            "claim": "(f) the probe's complementarity predicts the gain",
            "evidence": f"Spearman rho of the gain with kappa {rho(k)}, with p_A + p_B {rho(s)}",
            "verdict": predicts,
        },
    ]


# ---- markdown ------------------------------------------------------------------------------------------------


def ci_text(ci: Mapping | None, signed: bool = False) -> str:
    """`mean ± half-width` (3 decimals), or "n/a"."""
    if ci is None:
        return "n/a"
    return f"{ci['mean']:{'+' if signed else ''}.3f} ± {ci['ci']:.3f}"


def _num(v: float | None, signed: bool = False) -> str:
    return "n/a" if v is None else f"{v:{'+' if signed else ''}.3f}"


ORDER = ("yes/no", "shape", "color")  # question types, in table order


def markdown(results: Mapping) -> str:
    """results.md: setup, the base models, every cohort's probe, the method table, probe vs gain, the claims."""
    sections = (_setup_md, _bases_md, _probe_md, _methods_md, _probe_gain_md, _claims_md)
    return "\n".join(line for section in sections for line in section(results))


def _setup_md(results: Mapping) -> list[str]:
    b = results["budget"]
    split = results["split"]
    where = "easy-vqa test" if split == "test" else "validation (a tuning run: train from #35000, not test)"
    return [
        "# Label-free learning on easy-vqa (tiny models, CPU)",
        "",
        f"Seeds (RL: sampling and data order): {len(results['seeds'])}. Every method: {b['rl_steps']} steps × "
        f"{b['batch_size']} unlabelled questions × K={b['rollout_n']}, lr {b['rl_lr']}, pool: "
        f"{', '.join(results['pool'])} questions (chosen by wording) of easy-vqa train [20000, 35000). Base models "
        f"(Qwen2-VL-style, tiny, built once): {b['warm_steps']} supervised steps on 1000 labelled questions before "
        f"#20000, each type a third; A and A2: a share {b['own_share']} of them on images of palette A "
        f"({', '.join(results['palettes']['A'])}), B and B2: the same for palette B "
        f"({', '.join(results['palettes']['B'])}), M: half and half. Scored on {b['eval_limit']} {where} questions "
        "balanced over yes/no, shape, colour; greedy. Probe: the base models on validation (train from #35000), "
        "before training. Mean ± 95% t-interval over seeds; Δ = change vs the member's own base model; "
        "**cohort** = the mean over the trained members.",
        "",
    ]


def _bases_md(results: Mapping) -> list[str]:
    split, order = results["split"], ORDER
    lines = [
        f"## Base models ({split})",
        "",
        "| base | balanced | yes/no | shape | colour |",
        "|---|---|---|---|---|",
    ]
    q = results["question_only"]
    lines.append(
        f"| question-only baseline (no image) | {q['accuracy']:.3f} | "
        + " | ".join(f"{q['by_type'][t]:.3f}" for t in order)
        + " |"
    )
    lines += [
        f"| {bid} | {r['accuracy']:.3f} | " + " | ".join(f"{r[t]:.3f}" for t in order) + " |"
        for bid, r in results["base_table"].items()
    ]
    return lines


def _probe_md(results: Mapping) -> list[str]:
    order = ORDER
    lines = [
        "",
        "## Every cohort's probe before training (validation; a cohort of three: the mean of its pairs)",
        "",
        "| method | kappa | kappa yes/no | kappa shape | kappa colour | p_A+p_B | yes/no | shape | colour |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, p in results["cohort_probe"].items():
        cells = [_num(p[t]["kappa"]) for t in ("all", *order)] + [_num(p[t]["acc_sum"]) for t in ("all", *order)]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def _methods_md(results: Mapping) -> list[str]:
    split, order = results["split"], ORDER
    lines = [
        "",
        f"## Methods ({split})",
        "",
        "| method | member | balanced | Δ balanced | yes/no | shape | colour | Δ yes/no | Δ shape | Δ colour |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for method, members in results["table"].items():
        for who, r in sorted(members.items(), key=lambda kv: kv[0] == "cohort"):
            cells = [
                ci_text(r["accuracy"]),
                ci_text(r["d_accuracy"], True),
                *(ci_text(r[t]) for t in order),
                *(ci_text(r[f"d_{t}"], True) for t in order),
            ]
            lines.append(f"| {method} | {'**cohort**' if who == 'cohort' else who} | " + " | ".join(cells) + " |")
    return lines


def _probe_gain_md(results: Mapping) -> list[str]:
    split = results["split"]
    pg = results["probe_gain"]
    lines = [
        "",
        f"## Does the probe predict the gain? (ring cohorts: the probe on validation before training, the "
        f"gain on {split} after)",
        "",
        "| cohort | kappa | p_A+p_B | complementarity | same wrong | kappa colour | p_A+p_B colour | gain "
        "| gain colour |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {_num(r['kappa'])} | {_num(r['acc_sum'])} | {_num(r['complementarity'])} | "
        f"{_num(r['same_wrong'])} | {_num(r['kappa_color'])} | {_num(r['acc_sum_color'])} | "
        f"{ci_text(r['gain'], True)} | {ci_text(r['gain_color'], True)} |"
        for r in pg["rows"]
    ]
    lines += [""] + [
        f"Spearman's rho of the mean gain with {x}: "
        + (
            "n/a"
            if t["t"] is None
            else f"{t['rho']:+.3f} (n = {t['n']} cohorts, t = {t['t']:.2f}, "
            f"{'significant' if t['significant'] else 'not significant'} at 5%)"
        )
        for x, t in pg["spearman"].items()
    ]
    return lines


def _claims_md(results: Mapping) -> list[str]:
    lines = ["", "## Claims", "", "| claim | evidence | verdict |", "|---|---|---|"]
    lines += [f"| {c['claim']} | {c['evidence']} | {c['verdict']} |" for c in results["claims"]]
    lines += [
        "",
        "A verdict is *supported* when the whole 95% interval lies on the claimed side, *not supported* "
        "when it lies wholly on the other, else *inconclusive*; (f): *supported* when the gain's rank "
        "correlation is significant (5%) both with kappa (negative) and with p_A + p_B (positive), *partly* "
        "when with one of them. The cohorts share base models, so they are not independent samples: read the "
        "rank test as a guide, not a proof.",
        "",
        f"Wall time: {results['seconds'] / 60:.1f} min ({results['workers']} runs in parallel, one torch "
        "thread each). Plots: " + ", ".join(f"`{p}`" for p in results["plots"]),
        "",
    ]
    return lines


# ---- plots ----------------------------------------------------------------------------------------------------


def plot_probe_vs_gain(pg: Mapping, path: Path) -> Path:
    """Two panels, each cohort's mean gain (with its 95% interval) against its kappa and its p_A + p_B."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2), layout="constrained")
    for ax, key, label in zip(
        fig.subplots(1, 2),
        ("kappa", "acc_sum"),
        ("Cohen's kappa (validation, before)", "p_A + p_B (validation, before)"),
    ):
        for i, r in enumerate(pg["rows"]):
            if r[key] is not None:
                ax.errorbar(
                    [r[key]],
                    [100 * r["gain"]["mean"]],
                    yerr=[100 * r["gain"]["ci"]],
                    fmt="o",
                    color=f"C{i}",
                    capsize=3,
                    label=r["method"],
                )
        t = pg["spearman"][key]
        ax.set_title(f"Spearman rho = {_num(t['rho'], True)} (n = {t['n']} cohorts)")
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("label-free gain, balanced accuracy (points)")
    ax.legend(fontsize=7)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
