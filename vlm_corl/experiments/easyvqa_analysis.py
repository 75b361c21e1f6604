"""The easy-vqa experiment's numbers, from its results (pure functions of results.json, so `--plots-only`
recomputes them): per seed and member the change against its own base model, with collapsed types counted as no
gain; the method table (mean ± 95% t-interval over seeds); the probe's ranking; probe vs gain (Spearman's ρ); the
verdict on each claim; results.md and the plots.

Gains are balanced accuracy on easy-vqa test (the mean over yes/no, shape and colour) after training minus
that of the member's own base model; a cohort's gain is the mean over its trained members. A member has
**collapsed** on a type when one answer makes up at least COLLAPSE_SHARE of its answers there while the gold
answers are more varied: its gain on that type counts as none (min(Δ, 0)), whatever its accuracy ("gain").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path

from vlm_corl.evaluation.stats import mean_ci, spearman, t975
from vlm_corl.experiments.easyvqa_data import TYPES

KEYS = ("accuracy", *TYPES)  # "accuracy" is the balanced accuracy (test questions are balanced by type)
ORDER = ("yes/no", "shape", "color")  # question types, in table order
COLLAPSE_SHARE = 0.9
PREDICTS = 0.7  # claim (f): the rank correlation the probe's headroom must reach


# ---- per seed --------------------------------------------------------------------------------------------


def collapsed(answers: Mapping[str, int], majority_share: float) -> bool:
    """Whether one answer makes up COLLAPSE_SHARE of a member's answers to a type whose gold answers are more
    varied than that (`majority_share`: the share of the type's most common gold answer)."""
    total = sum(answers.values())
    return total > 0 and max(answers.values()) / total >= COLLAPSE_SHARE > majority_share


def member_deltas(after: Mapping, before: Mapping, majority: Mapping[str, Mapping]) -> dict[str, float]:
    """One trained member's scores (`after`, a brief of its evaluation) against its base model's (`before`):
    {key: after, "d_" + key: after − base, "collapsed_" + type: 0/1, "g_" + type and "gain": the changes with a
    collapsed type's counted as min(Δ, 0)}."""
    row = {"accuracy": after["accuracy"], **after["by_type"]}
    base = {"accuracy": before["accuracy"], **before["by_type"]}
    out = {**row, **{f"d_{k}": row[k] - base[k] for k in KEYS}}
    for t in TYPES:
        flag = collapsed(after["answers"].get(t, {}), majority[t]["share"])
        out[f"collapsed_{t}"] = float(flag)
        out[f"g_{t}"] = min(out[f"d_{t}"], 0.0) if flag else out[f"d_{t}"]
    out["gain"] = statistics.fmean(out[f"g_{t}"] for t in TYPES)
    return out


def cohort_mean(deltas: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """The mean over a run's trained members of every number `member_deltas` gives."""
    keys = next(iter(deltas.values())).keys()
    return {k: statistics.fmean(d[k] for d in deltas.values()) for k in keys}


def per_seed(results: Mapping) -> dict[str, dict[str, dict]]:
    """{method: {seed: {"members": member_deltas, "cohort": cohort_mean and the constant share per type}}}."""
    out: dict[str, dict[str, dict]] = {}
    for seed, methods in results["seeds"].items():
        for method, run in methods.items():
            bases = results["methods"][method]["trained"]
            deltas = {
                mid: member_deltas(e, results["bases"][bases[mid]]["test"], results["majority"])
                for mid, e in run["eval"].items()
            }
            cohort = {**cohort_mean(deltas), **{f"constant_{t}": v for t, v in run["constant"].items()}}
            out.setdefault(method, {})[seed] = {"members": deltas, "cohort": cohort}
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


def paired(seeded: Mapping, a: str, b: str, key: str = "gain") -> dict:
    """mean_ci over the seeds both methods ran of (cohort[key] of a − that of b)."""
    seeds = sorted(set(seeded[a]) & set(seeded[b]))
    return mean_ci([seeded[a][s]["cohort"][key] - seeded[b][s]["cohort"][key] for s in seeds])


# ---- the probe --------------------------------------------------------------------------------------------


def probe_of(results: Mapping, method: str) -> dict:
    """The probe's figures of a method's cohort under the method's own reward mode (validation, before
    training): headroom (mean ± interval, per type), the abstain share, the confidence prediction, κ, p_A + p_B."""
    m = results["methods"][method]
    report = next(r for r in results["probe"]["ranking"] if r["cohort"] == m["cohort"])
    mode = report["modes"].get(m["mode"]) or report["modes"]["peers"]
    return {
        "cohort": m["cohort"],
        "rank": report["rank"],
        "headroom": mode["headroom"],
        "reachable": mode["reachable"],
        "abstain": mode["abstain"],
        "settled": report["settled"],
        "kappa": report["kappa"],
        "acc_sum": report["acc_sum"],
    }


def rank_test(x: Sequence[float], y: Sequence[float]) -> dict:
    """Spearman's ρ with its t statistic t = ρ √((n − 2) / (1 − ρ²)) and whether |t| clears the two-sided 5%
    critical value t_{0.975, n−2} (the usual large-sample test; n ≥ 3)."""
    rho = spearman(x, y)
    n = len(x)
    if rho is None or n < 3:
        return {"rho": rho, "n": n, "t": None, "significant": False}
    t = math.inf if abs(rho) == 1 else rho * math.sqrt((n - 2) / (1 - rho * rho))
    return {"rho": rho, "n": n, "t": t, "significant": abs(t) > t975(n - 2)}


LABEL_FREE = ("peers", "peers_ema", "ring", "soft")


def probe_vs_gain(results: Mapping, seeded: Mapping) -> dict:
    """One row per label-free cohort that trains every member (peers and ring methods, not frozen peers): its
    probe before training and its gain after (mean_ci over seeds), and the rank correlation over the cohorts of
    each probe figure with the mean gain."""
    rows = []
    for method, m in results["methods"].items():
        if m["mode"] not in LABEL_FREE or m["role"] == "frozen" or method not in seeded:
            continue
        p = probe_of(results, method)
        seeds = seeded[method].values()
        rows.append(
            {
                "method": method,
                "members": len(m["trained"]),
                "headroom": p["headroom"]["all"]["mean"],
                "reachable": p["reachable"]["all"]["mean"],
                "settled": p["settled"]["headroom"]["all"]["mean"],
                "kappa": p["kappa"],
                "acc_sum": p["acc_sum"],
                "gain": mean_ci([s["cohort"]["gain"] for s in seeds]),
                "seeds": len(seeds),
            }
        )
    tests = {}
    for x in ("headroom", "reachable", "settled", "kappa", "acc_sum"):
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


def all_of(verdicts: Sequence[str]) -> str:
    """Every part supported: supported; any part not supported: not supported; else inconclusive."""
    if all(v == "supported" for v in verdicts):
        return "supported"
    return "not supported" if "not supported" in verdicts else "inconclusive"


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


def diversity_claim(results: Mapping, picked: str, self_vote: str) -> tuple:
    """Claim (g): the change of the batch answer entropy over training of self_vote, of the pick and their
    paired difference (mean_ci over seeds, or None), and the verdict: supported when self_vote's falls and
    the pick's does not."""
    e_self, e_pick = entropy_change(results, self_vote), entropy_change(results, picked)
    d_self, d_pick = mean_ci_or_none(list(e_self.values())), mean_ci_or_none(list(e_pick.values()))
    d_pair = mean_ci_or_none([e_pick[s] - e_self[s] for s in sorted(set(e_self) & set(e_pick))])
    if d_self is None or d_pick is None:
        return d_self, d_pick, d_pair, "inconclusive"
    falls = verdict(d_self, 0.0, above=False)
    holds = "supported" if d_pick["mean"] - d_pick["ci"] > -0.05 else "not supported"  # within 0.05 nats
    return d_self, d_pick, d_pair, all_of([falls, holds])


def roles(results: Mapping) -> dict[str, str]:
    """{role: method name} of the methods the claims compare."""
    return {m["role"]: name for name, m in results["methods"].items() if m["role"]}


def claims(results: Mapping, seeded: Mapping, table: Mapping, pg: Mapping) -> list[dict]:
    """The issue's claims (a)-(g) against the data (gains with collapsed types counted as none)."""
    r = roles(results)
    pick = r["pick"]
    gain = table[pick]["cohort"]["gain"]
    vs_self = paired(seeded, pick, r["self_vote"])
    gap = paired(seeded, r["gt"], pick)
    vs_homog = paired(seeded, pick, r["homogeneous"])
    members = {mid: v["gain"] for mid, v in table[pick].items() if mid != "cohort"}
    d_self, d_pick, d_pair, diversity = diversity_claim(results, pick, r["self_vote"])
    rho = pg["spearman"]["headroom"]
    rho_text = "n/a" if rho["rho"] is None else f"{rho['rho']:+.2f} over {rho['n']} cohorts"
    if rho["rho"] is None or rho["n"] < 8:
        predicts = "inconclusive"
    else:
        predicts = "supported" if rho["rho"] >= PREDICTS else "not supported"
    worst = min(members, key=lambda mid: members[mid]["mean"])
    picked = results["methods"][pick]
    evidence_a = f"gain {pts(gain)}"
    if "pick_peers" in r:  # the same cohort under the paper's `peers`, beside the main reward
        evidence_a += f"; with peers: {pts(table[r['pick_peers']]['cohort']['gain'])}"
    return [
        {
            "claim": f"(a) the cohort the probe picks ({picked['cohort']}, {picked['mode']}) gains >= +5 points",
            "evidence": evidence_a,
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
            "claim": "(d) diverse beats homogeneous at equal size",
            "evidence": f"paired difference {pts(vs_homog)}",
            "verdict": verdict(vs_homog, 0.0, above=True),
        },
        {
            "claim": "(e) no member of the picked cohort loses more than 2 points",
            "evidence": "; ".join(f"{mid} {pts(v)}" for mid, v in members.items()) + f" (lowest: {worst})",
            "verdict": all_of([verdict(v, -0.02, above=True) for v in members.values()]),
        },
        {
            "claim": f"(f) the probe's label headroom predicts the gain (Spearman rho >= {PREDICTS}, >= 8 cohorts)",
            "evidence": f"rho {rho_text}" + (" (significant at 5%)" if rho["significant"] else ""),
            "verdict": predicts,
        },
        {
            "claim": "(g) self_vote's answer diversity falls while the picked cohort's does not",
            "evidence": "change of the batch answer entropy over training (nats): self_vote "
            f"{ci_text(d_self, True)}, the pick {ci_text(d_pick, True)}, difference {ci_text(d_pair, True)}",
            "verdict": diversity,
        },
    ]


def analyse(results: Mapping) -> dict:
    """results with the per-seed numbers' tables, the probe-vs-gain analysis and the claims (re)computed."""
    seeded = per_seed(results)
    table = method_table(seeded)
    pg = probe_vs_gain(results, seeded)
    return {
        **results,
        "base_table": base_table(results["bases"]),
        "table": table,
        "probe_gain": pg,
        "claims": claims(results, seeded, table, pg),
    }


# ---- markdown ------------------------------------------------------------------------------------------------


def ci_text(ci: Mapping | None, signed: bool = False, scale: float = 1.0) -> str:
    """`mean ± half-width` (3 decimals; ×`scale`), or "n/a"."""
    if ci is None:
        return "n/a"
    return f"{scale * ci['mean']:{'+' if signed else ''}.3f} ± {scale * ci['ci']:.3f}"


def _num(v: float | None, signed: bool = False) -> str:
    return "n/a" if v is None else f"{v:{'+' if signed else ''}.3f}"


def markdown(results: Mapping) -> str:
    """results.md: setup, the base models, the probe, the method table, probe vs gain, the claims."""
    sections = (_setup_md, _bases_md, _probe_md, _methods_md, _probe_gain_md, _claims_md)
    return "\n".join(line for section in sections for line in section(results))


def _setup_md(results: Mapping) -> list[str]:
    b = results["budget"]
    where = "easy-vqa test" if results["split"] == "test" else "validation (a tuning run: train from #35000, not test)"
    return [
        "# Label-free learning on easy-vqa (tiny models, CPU)",
        "",
        f"Every method: {b['rl_steps']} steps × {b['batch_size']} unlabelled questions × K={b['rollout_n']} at "
        f"temperature 1, lr {b['rl_lr']}, on every question type of easy-vqa train [20000, 35000), balanced. Seeds "
        f"(RL: sampling and data order): {b['seeds']} for the pick, the homogeneous cohort, self_vote and gt; "
        f"{b['more_seeds']} for the other methods; {b['frozen_seeds']} for frozen peers. Base models (tiny, built "
        f"once): {b['warm_steps']} supervised steps on 1000 labelled questions before #20000, a third of each "
        "type: one per zoo VLM family on slices 4000 apart, and four more qwen2_vl on the same slices (the "
        f"homogeneous side). Scored greedily on {b['eval_limit']} {where} questions balanced over yes/no, shape, "
        f"colour. Probe: one pass per base model on {b['probe_limit']} validation questions (train from #35000), "
        f"K={b['rollout_n']} samples at temperature 1, before training. Mean ± 95% t-interval over seeds; Δ = "
        "change vs the member's own base model; **gain** = Δ balanced with a collapsed type's Δ counted as "
        f"min(Δ, 0) (collapsed: one answer for ≥ {COLLAPSE_SHARE:.0%} of the type's questions); **cohort** = the "
        "mean over the trained members.",
        "",
    ]


def _bases_md(results: Mapping) -> list[str]:
    lines = [
        f"## Base models ({results['split']})",
        "",
        "| base | balanced | yes/no | shape | colour |",
        "|---|---|---|---|---|",
    ]
    maj = results["majority"]
    lines.append(
        "| majority-class reference (one constant per type) | "
        f"{statistics.fmean(maj[t]['share'] for t in ORDER):.3f} | "
        + " | ".join(f"{maj[t]['share']:.3f} ({maj[t]['answer']})" for t in ORDER)
        + " |"
    )
    q = results["question_only"]
    lines.append(
        f"| question-only baseline (no image) | {q['accuracy']:.3f} | "
        + " | ".join(f"{q['by_type'][t]:.3f}" for t in ORDER)
        + " |"
    )
    lines += [
        f"| {bid} | {r['accuracy']:.3f} | " + " | ".join(f"{r[t]:.3f}" for t in ORDER) + " |"
        for bid, r in results["base_table"].items()
    ]
    return lines


PROBE_ROWS = 12  # the best cohorts shown in results.md (results.json keeps all)


def _probe_md(results: Mapping) -> list[str]:
    from vlm_corl.training.rewards.headroom import HEADROOM_NOTE, ranking_markdown

    used = {m["cohort"] for m in results["methods"].values()}
    ranking = results["probe"]["ranking"]
    shown = [r for r in ranking if r["rank"] <= PROBE_ROWS or r["cohort"] in used]
    return [
        "",
        f"## The probe: label headroom of every candidate cohort (validation, before training; {len(ranking)} "
        f"ranked, the best {PROBE_ROWS} and every trained one shown)",
        "",
        HEADROOM_NOTE,
        "",
        *ranking_markdown(ranking, shown, used),
    ]


def _methods_md(results: Mapping) -> list[str]:
    lines = [
        "",
        f"## Methods ({results['split']})",
        "",
        "| method | member | balanced | Δ balanced | **gain** | Δ yes/no | Δ shape | Δ colour | collapsed "
        "(yes/no, shape, colour) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for method, members in results["table"].items():
        for who, r in sorted(members.items(), key=lambda kv: kv[0] == "cohort"):
            if who == "cohort":  # the share of questions every member answers with the type's one constant
                flags = ", ".join(f"{r[f'constant_{t}']['mean']:.2f}" for t in ORDER) + " all one answer"
            else:
                flags = ", ".join(f"{r[f'collapsed_{t}']['mean']:.1f}" for t in ORDER)
            cells = [
                ci_text(r["accuracy"]),
                ci_text(r["d_accuracy"], True),
                f"**{ci_text(r['gain'], True)}**",
                *(ci_text(r[f"d_{t}"], True) for t in ORDER),
                flags,
            ]
            lines.append(f"| {method} | {'**cohort**' if who == 'cohort' else who} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Collapsed, per member: the share of seeds on which one answer made up ≥ "
        f"{COLLAPSE_SHARE:.0%} of its answers to the type; per cohort: the share of the type's questions on which "
        "every trained member gave the type's one most common answer.",
    ]
    return lines


def _probe_gain_md(results: Mapping) -> list[str]:
    pg = results["probe_gain"]
    lines = [
        "",
        f"## Does the probe predict the gain? (label-free cohorts: the probe on validation before training, "
        f"the gain on {results['split']} after)",
        "",
        "| cohort | members | seeds | headroom | reachable | settled headroom | kappa | p_A+p_B | gain |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['method']} | {r['members']} | {r['seeds']} | {_num(100 * r['headroom'], True)} | "
        f"{_num(100 * r['reachable'], True)} | "
        f"{_num(100 * r['settled'], True)} | {_num(r['kappa'])} | {_num(r['acc_sum'])} | "
        f"{ci_text(r['gain'], True)} |"
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
        "when it lies wholly on the other, else *inconclusive*. The cohorts share base models, so they are not "
        "independent samples: read the rank test as a guide, not a proof.",
        "",
        f"Wall time of the last invocation: {results['seconds'] / 60:.1f} min ({results['workers']} runs in parallel, "
        "one torch thread each; a resumed experiment skips its finished jobs); the runs' own times sum to "
        f"{results['run_seconds'] / 3600:.2f} h of one core. Plots: " + ", ".join(f"`{p}`" for p in results["plots"]),
        "",
    ]
    return lines


# ---- plots ----------------------------------------------------------------------------------------------------


def plot_probe_vs_gain(pg: Mapping, path: Path) -> Path:
    """Each label-free cohort's mean gain (with its 95% interval) against its label headroom, the part of it
    its members' samples reach, and its p_A + p_B."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.2), layout="constrained")
    for ax, key, label in zip(
        fig.subplots(1, 3),
        ("headroom", "reachable", "acc_sum"),
        (
            "label headroom, points (validation, before)",
            "reachable headroom, points (validation, before)",
            "p_A + p_B, mean pair (validation, before)",
        ),
    ):
        for i, r in enumerate(pg["rows"]):
            if r[key] is not None:
                x = r[key] if key == "acc_sum" else 100 * r[key]
                ax.errorbar(
                    [x],
                    [100 * r["gain"]["mean"]],
                    yerr=[100 * r["gain"]["ci"]],
                    fmt="o",
                    color=colormaps["tab20"](i % 20),  # more cohorts than the default cycle's 10 colours
                    capsize=3,
                    label=r["method"],
                )
        t = pg["spearman"][key]
        ax.set_title(f"Spearman rho = {_num(t['rho'], True)} (n = {t['n']} cohorts)")
        ax.axhline(0, color="gray", linewidth=0.8)
        ax.set_xlabel(label)
        ax.set_ylabel("label-free gain, balanced (points)")
    ax.legend(fontsize=6)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


CURVES = {
    "pseudo_label_acc": "pseudo-label accuracy (diagnostic, vs gold)",
    "reward_mean": "reward",
    "agreement": "agreement with the label source",
    "distinct_answers": "distinct answers per group",
    "answer_entropy_batch": "answer entropy across the batch (nats)",
}


def plot_all(out: Path, results: Mapping) -> list[str]:
    """The probe-vs-gain scatter and one PNG per training diagnostic over steps (one line per method, the mean
    over seeds and trained members, read from the runs' metrics.jsonl)."""
    from vlm_corl.reporting.run_plots import plot_metric, read_jsonl

    paths = [plot_probe_vs_gain(results["probe_gain"], out / "probe_vs_gain.png").name]
    for key, title in CURVES.items():
        runs = {}
        for method, m in results["methods"].items():
            rows = [
                row
                for seed in results["seeds"].values()
                for run_dir in seed.get(method, {}).get("run_dirs", [])
                for row in read_jsonl(out / run_dir / "metrics.jsonl")
                if row["member"] in m["trained"] and row.get(key) is not None
            ]
            if rows:
                runs[method] = rows
        if runs:
            name = "reward" if key == "reward_mean" else key
            plot_metric(runs, key, out / f"{name}.png", title)
            paths.append(f"{name}.png")
    return paths


# ---- the README's summary ----------------------------------------------------------------------------------

README_BLOCK = "easyvqa-summary"


def summary_md(results: Mapping) -> str:
    """The README's block: the cohort row of every method (gain with collapsed types counted as none, Δ per
    type, the share of questions every member answers with one constant) and the claims' verdicts."""
    from vlm_corl.training.rewards.headroom import ranking_markdown

    used = {m["cohort"] for m in results["methods"].values()}
    ranking = results["probe"]["ranking"]
    lines = [
        *_bases_md(results)[2:],
        "",
        f"The probe (validation, before training; the trained cohorts of the {len(ranking)} it ranked; headroom in "
        "points):",
        "",
        *ranking_markdown(ranking, [r for r in ranking if r["cohort"] in used]),
        "",
        f"Picked by the probe: **{results['methods'][roles(results)['pick']]['cohort']}**. Scored on "
        f"{results['budget']['eval_limit']} easy-vqa {results['split']} questions; mean ± 95% interval over seeds, "
        "in points; the cohort's mean over its trained members.",
        "",
        "| method | seeds | **gain** | Δ balanced | Δ yes/no | Δ shape | Δ colour | all one answer (yes/no, shape, "
        "colour) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for method, members in results["table"].items():
        c = members["cohort"]
        constant = ", ".join(f"{c[f'constant_{t}']['mean']:.2f}" for t in ORDER)
        cells = [f"**{_points(c['gain'])}**", _points(c["d_accuracy"]), *(_points(c[f"d_{t}"]) for t in ORDER)]
        lines.append(f"| {method} | {c['gain']['n']} | " + " | ".join(cells) + f" | {constant} |")
    lines += ["", "| claim | evidence | verdict |", "|---|---|---|"]
    lines += [f"| {c['claim']} | {c['evidence']} | {c['verdict']} |" for c in results["claims"]]
    return "\n".join(lines) + "\n"


def _points(ci: Mapping) -> str:
    return f"{100 * ci['mean']:+.1f} ± {100 * ci['ci']:.1f}"


def replace_block(text: str, block: str, body: str) -> str:
    """`text` with the part between `<!-- block: ... -->` and `<!-- /block -->` replaced by `body`; a
    ValueError when the markers are missing."""
    import re

    pattern = re.compile(rf"(<!-- {block}:[^>]*-->\n)(.*?)(<!-- /{block} -->)", re.S)
    if not pattern.search(text):
        raise ValueError(f"no <!-- {block}: ... --> ... <!-- /{block} --> markers")
    return pattern.sub(lambda m: m.group(1) + body + m.group(3), text, count=1)
