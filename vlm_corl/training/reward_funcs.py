"""Reward functions: plain Python callables scored per member, summed (weighted) onto the reward mode's reward.

The one contract, for `CohortTrainer(reward_funcs=[...])` and the YAML `reward.custom: [module:function, ...]`:

    fn(*, member, prompts, completions, answers, peer_answers, **columns) -> list[float | None]

called once per trained member and step, with one entry per completion of that member, question by question
(question b's K responses at b*K ... b*K + K-1):
- `member`: the member's id (a slot id under the two-view and EMA-teacher layouts);
- `prompts`: the question as this member saw it (its view's wording);
- `completions`: the response texts; `answers`: the answers extracted from them (None: none found);
- `peer_answers`: {other member id: the list of that member's K answers to the same question}, per completion;
- `**columns`: the dataset's other columns (those every example of the step has), one value per completion.
The gold answer is never passed: rewards stay label-free (`reward.mode: gt` is the reference that reads it).

It returns one number per completion; None abstains (adds nothing). A function that raises, returns the wrong
length or anything but numbers stops the step on every rank with `RewardFunctionFailed` naming the function and
the member; the last checkpoint stays as it was (the reward phase comes before the update).
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from vlm_corl.config import ConfigError
from vlm_corl.config.schema import custom_rewards
from vlm_corl.errors import UserError, brief
from vlm_corl.registry import REWARDS

if TYPE_CHECKING:
    from vlm_corl.config.schema import CohortConfig
    from vlm_corl.data.records import Example
    from vlm_corl.training.rewards import CohortBatch, RewardOutput
    from vlm_corl.training.slots import SlotSpec

log = logging.getLogger(__name__)

ARGUMENTS = ("member", "prompts", "completions", "answers", "peer_answers")


class RewardFunctionFailed(UserError):
    """A reward function raised or returned something unusable; the message names it, the member and the step."""


@dataclass(frozen=True)
class RewardFunction:
    """A reward function with the name its metrics carry (`reward_<name>`) and its weight in the sum."""

    fn: Callable[..., Sequence[Any]]
    name: str
    weight: float = 1.0


def contract_problem(fn: object) -> str | None:
    """Why `fn` cannot be called as a reward function, or None: it must take the contract's arguments by
    keyword (or **kwargs) and need no positional one."""
    if not callable(fn):
        return f"{fn!r} is not callable"
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None  # a builtin or C callable: found out at the first call
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
    missing = [a for a in ARGUMENTS if a not in named and not takes_any]
    required = [p.name for p in params if p.default is p.empty and p.kind is p.POSITIONAL_ONLY]
    if missing or required:
        return (
            f"{function_name(fn)} does not take the reward-function arguments: it should be "
            f"fn(*, member, prompts, completions, answers, peer_answers, **columns) -> list[float | None]"
            + (f" (it lacks {', '.join(missing)})" if missing else "")
            + (f" (it requires {', '.join(required)})" if required else "")
            + "; a cohort-level reward fn(batch, cfg) is registered as a reward mode instead "
            "(vlm_corl.training.rewards.reward_mode)"
        )
    return None


def function_name(fn: object) -> str:
    """How messages and metrics name a reward function: its module:qualname where it has one."""
    qual = getattr(fn, "__qualname__", None) or type(fn).__name__
    module = getattr(fn, "__module__", None)
    return f"{module}:{qual}" if module and module != "__main__" else qual


def metric_name(fn: object, taken: set[str]) -> str:
    """A short unique metric name for `fn` (its function name; a number added on a clash)."""
    base = (getattr(fn, "__name__", None) or type(fn).__name__).strip("<>").replace(".", "_") or "fn"
    name, i = base, 2
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    return name


def reward_functions(fns: Sequence[Callable], weights: Sequence[float] | None) -> list[RewardFunction]:
    """`fns` with their weights (default 1 each) and metric names; ValueError naming what does not fit."""
    if weights is not None and len(weights) != len(fns):
        raise ValueError(f"{len(weights)} reward weight(s) for {len(fns)} reward function(s); give one per function")
    out: list[RewardFunction] = []
    taken = {"agreement", "format"}  # the modes' own parts keep their names
    for i, fn in enumerate(fns):
        problem = contract_problem(fn)
        if problem:
            raise ValueError(problem)
        weight = 1.0 if weights is None else weights[i]
        if not isinstance(weight, numbers.Real) or isinstance(weight, bool) or not math.isfinite(weight):
            raise ValueError(f"reward weight {weight!r} of {function_name(fn)} is not a finite number")
        out.append(RewardFunction(fn, metric_name(fn, taken), float(weight)))
        taken.add(out[-1].name)
    return out


def call_arguments(
    n: int, batch: CohortBatch, examples: Sequence[Example], specs: Sequence[SlotSpec]
) -> dict[str, Any]:
    """The keyword arguments of slot n's call: flat per completion, question by question (see the module doc)."""
    k = len(batch.answers[n][0])
    per = lambda values: [v for v in values for _ in range(k)]  # noqa: E731 - one value per question -> per completion
    shared = set.intersection(*(set(ex.metadata) for ex in examples)) if examples else set()
    columns = {key: per([ex.metadata[key] for ex in examples]) for key in sorted(shared) if key not in ARGUMENTS}
    return {
        "member": specs[n].id,
        "prompts": per([ex.wording_for(specs[n].view) for ex in examples]),
        "completions": [t for group in batch.texts[n] for t in group],
        "answers": [a for group in batch.answers[n] for a in group],
        "peer_answers": {
            specs[m].id: per([list(group) for group in batch.answers[m]]) for m in range(len(specs)) if m != n
        },
        **columns,
    }


def checked_values(values: Any, expected: int, where: str) -> list[float]:
    """A function's return as floats (NaN = abstained); RewardFunctionFailed text when it is unusable."""
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    try:
        values = list(values)
    except TypeError:
        raise RewardFunctionFailed(f"{where} returned {type(values).__name__}, not a list of numbers") from None
    if len(values) != expected:
        raise RewardFunctionFailed(f"{where} returned {len(values)} values for {expected} completions")
    out = []
    for i, v in enumerate(values):
        if v is None:
            out.append(math.nan)
        elif isinstance(v, numbers.Real) and math.isfinite(float(v)):
            out.append(float(v))
        else:
            raise RewardFunctionFailed(f"{where} returned {v!r} at position {i}: expected a finite number or None")
    return out


def score_slot(
    funcs: Sequence[RewardFunction], n: int, batch: CohortBatch, examples: Sequence[Example], specs, step: int
) -> dict[str, list[float]]:
    """Every function's values for slot n (NaN = abstain); RewardFunctionFailed naming the function and member."""
    kwargs = call_arguments(n, batch, examples, specs)
    expected = len(kwargs["completions"])
    out = {}
    for f in funcs:
        where = f"reward function {function_name(f.fn)} for member {specs[n].id!r} at step {step}"
        try:
            values = f.fn(**kwargs)
        except Exception as err:  # noqa: BLE001 - the user's code: named, with its traceback in the log
            log.exception("%s raised", where)
            raise RewardFunctionFailed(f"{where} raised {brief(err)} (traceback in the run log)") from err
        out[f.name] = checked_values(values, expected, where)
    return out


def function_rewards(
    funcs: Sequence[RewardFunction],
    batch: CohortBatch,
    examples: Sequence[Example],
    specs: Sequence[SlotSpec],
    trained: Sequence[bool],
    world,
    step: int,
) -> dict[str, torch.Tensor]:
    """{function name: (N, B, K) values, NaN where it abstained or for a slot that does not train}.

    Each trained slot is scored by one rank (slot i by rank i mod world size), so a function runs once per
    member and step; the ranks then exchange the values (one all_gather). A failure on any rank raises
    RewardFunctionFailed on every rank with the same text."""
    n, b, k = batch.shape
    mine, failure = {}, None
    for i in range(n):
        if trained[i] and i % world.size == world.rank and failure is None:
            try:
                mine[i] = score_slot(funcs, i, batch, examples, specs, step)
            except RewardFunctionFailed as err:
                failure = str(err)
    gathered = world.all_gather((mine, failure))
    failures = [f for _, f in gathered if f is not None]
    if failures:
        raise RewardFunctionFailed(failures[0])
    out = {f.name: torch.full((n, b, k), math.nan) for f in funcs}
    for part, _ in gathered:
        for i, values in part.items():
            for name, flat in values.items():
                out[name][i] = torch.tensor(flat).view(b, k)
    return out


def add_function_rewards(scored: RewardOutput, values: dict[str, torch.Tensor], funcs: Sequence[RewardFunction]):
    """The mode's rewards plus each function's weighted values (an abstention adds 0); each function's values
    become a reward part (`reward_<name>` in the metrics, averaged over the completions it scored)."""
    total = scored.rewards.clone()
    for f in funcs:
        total += f.weight * torch.nan_to_num(values[f.name], nan=0.0)
    return replace(scored, rewards=total, parts={**scored.parts, **values})


def run_reward_functions(cfg: CohortConfig, fns=None, weights: Sequence[float] | None = None) -> list[RewardFunction]:
    """The run's reward functions: reward.custom's (weights: reward.weights), then `fns` (CohortTrainer's
    reward_funcs; weights: `weights`), checked against the contract; ConfigError for what does not fit, and for
    reward.mode none without any function."""

    if callable(fns):
        fns = [fns]
    fns = list(fns or [])
    if weights is not None and len(weights) != len(fns):
        raise ConfigError(
            [f"reward_weights: {len(weights)} weight(s) for {len(fns)} reward function(s); give one per function"],
            ["reward_weights"],
        )
    named = [REWARDS.get(name) for name in custom_rewards(cfg)]
    single = isinstance(cfg.reward.custom, str)
    wrong = [
        (("reward.custom" if single else f"reward.custom[{i}]"), problem)
        for i, fn in enumerate(named)
        if (problem := contract_problem(fn))
    ]
    if wrong:
        raise ConfigError([f"{path}: {problem}" for path, problem in wrong], [path for path, _ in wrong])
    yaml_weights = cfg.reward.weights or [1.0] * len(named)
    api_weights = list(weights) if weights is not None else [1.0] * len(fns)
    if cfg.reward.mode == "none" and not (named or fns):
        raise ConfigError(
            [
                "reward.mode: none means only the reward functions, and none is given: add reward.custom or "
                "CohortTrainer(reward_funcs=[...]), or choose a reward mode"
            ],
            ["reward.mode"],
        )
    try:
        return reward_functions(named + fns, yaml_weights + api_weights)
    except ValueError as err:
        raise ConfigError([f"reward_funcs: {err}"], ["reward_funcs"]) from None
