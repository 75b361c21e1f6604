"""Reward functions: plain Python callables scored per member, summed (weighted) onto the reward mode's reward.

The one contract, for `CohortTrainer(reward_funcs=[...])` and the YAML `reward.custom: [module:function, ...]`:

    fn(*, member, prompts, completions, answers, peer_answers, **columns) -> list[float | None]

called once per trained member and step (and once more per round of dynamic sampling, algo.resample_zero_variance,
on that round's fresh questions alone), with one entry per completion of that member, question by question
(question b's K responses at b*K ... b*K + K-1):
- `member`: the member's id (a slot id under the two-view and EMA-teacher layouts);
- `prompts`: the question as this member saw it (its view's wording);
- `completions`: the response texts; `answers`: the answers extracted from them (None: none found);
- `peer_answers`: {other member id: the list of that member's K answers to the same question}, per completion;
- `**columns`: the dataset's other columns (those every example of the step has), one value per completion.
The gold answer is never passed: rewards stay label-free (`reward.mode: gt` is the reference that reads it).

It returns one number per completion (a 0-d tensor counts as one); None abstains (adds nothing). A function that
raises, returns the wrong length, anything but numbers, or a number that is not finite (NaN and infinities are
errors, never abstentions) stops the step on every rank with `RewardFunctionFailed` naming the function and the
member; the last checkpoint stays as it was (the reward phase comes before the update).

Before any model loads, each function's signature is checked against the columns the run's data passes
(`check_columns`): a column it cannot take, or a parameter it requires that no call gives, is a ConfigError
naming the function, not a failure at step 1.
"""

from __future__ import annotations

import inspect
import logging
import math
import numbers
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from vlm_corl.config import ConfigError
from vlm_corl.config.loading import CUSTOM_NAME
from vlm_corl.config.schema import custom_rewards
from vlm_corl.errors import UserError, brief
from vlm_corl.registry import REWARDS, UnknownNameError

if TYPE_CHECKING:
    from vlm_corl.config.schema import CohortConfig
    from vlm_corl.data.records import Example
    from vlm_corl.training.rewards.modes import CohortBatch, RewardOutput
    from vlm_corl.training.run.slots import SlotSpec

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
    origin: str = "reward_funcs"  # where the user gave it (reward.custom[0], reward_funcs[1]): messages name it


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
            "(vlm_corl.training.rewards.modes.reward_mode)"
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


def reward_functions(
    fns: Sequence[Callable], weights: Sequence[float] | None, origins: Sequence[str] | None = None
) -> list[RewardFunction]:
    """`fns` with their weights (default 1 each), metric names and origins (where the user gave each; default
    reward_funcs[i]); ValueError naming what does not fit."""
    if weights is not None and len(weights) != len(fns):
        raise ValueError(f"{len(weights)} reward weight(s) for {len(fns)} reward function(s); give one per function")
    out: list[RewardFunction] = []
    taken = {"agreement", "format"}  # the modes' own parts keep their names
    for i, fn in enumerate(fns):
        problem = contract_problem(fn)
        if problem:
            raise ValueError(problem)
        weight = 1.0 if weights is None else _number(weights[i], allow_bool=False)
        if weight is None:
            raise ValueError(f"reward weight {weights[i]!r} of {function_name(fn)} is not a finite number")
        origin = origins[i] if origins is not None else f"reward_funcs[{i}]"
        out.append(RewardFunction(fn, metric_name(fn, taken), weight, origin))
        taken.add(out[-1].name)
    return out


def _is_scalar_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0


def _number(value: object, allow_bool: bool = True) -> float | None:
    """`value` as a finite float (a real number, or a 0-d tensor holding one), or None when it is not one: NaN,
    an infinity, an integer too large for a float, a bool where one is not allowed, anything else."""
    if _is_scalar_tensor(value) and not value.is_complex():
        value = value.item()
    if not isinstance(value, numbers.Real) or (isinstance(value, bool) and not allow_bool):
        return None
    try:
        number = float(value)
    except (OverflowError, TypeError, ValueError):  # 10**400, or a Real subclass that cannot be converted
        return None
    return number if math.isfinite(number) else None


def check_columns(funcs: Sequence[RewardFunction], examples: Sequence[Example]) -> list[str]:
    """Why a function cannot be called with the columns `examples` pass (`call_arguments`: a column is passed
    at a step whose every example has it), one line per function that cannot, checked before any model loads: a
    function without **kwargs must take every column that may be passed, and a parameter it requires (no
    default) must be a contract argument or a column every example has."""
    rows = Counter(key for ex in examples for key in ex.metadata if key not in ARGUMENTS)  # column -> rows with it
    always = {key for key, n in rows.items() if n == len(examples)}
    some = set(rows) - always
    problems = []
    for f in funcs:
        try:
            params = list(inspect.signature(f.fn).parameters.values())
        except (TypeError, ValueError):
            continue  # a builtin or C callable: found out at the first call
        takes_any = any(p.kind is p.VAR_KEYWORD for p in params)
        named = {p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)}
        required = [
            p.name
            for p in params
            if p.default is p.empty and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ARGUMENTS
        ]
        said = []
        for column in [] if takes_any else sorted((always | some) - named):
            passed = "every call" if column in always else "every call whose questions all have it"
            said.append(
                f"does not take the dataset's column {column!r}, which {passed} passes as a keyword argument: "
                f"add a parameter {column}, or **kwargs"
            )
        for name in required:
            if name in some:
                said.append(
                    f"requires {name}, a column only some rows have ({rows[name]} of {len(examples)}): give it a "
                    "default, or give every row the column"
                )
            elif name not in always:
                columns = ", ".join(sorted(always | some)) or "none"
                said.append(
                    f"requires {name}, which is no reward-function argument and no column of the dataset "
                    f"(columns: {columns}): give it a default, or add the column"
                )
        if said:
            problems.append(f"{function_name(f.fn)} " + "; it ".join(said))
    return problems


def check_run_columns(funcs: Sequence[RewardFunction], examples: Sequence[Example], log_it: bool = False) -> None:
    """`check_columns` as a ConfigError naming each function where the user gave it (reward.custom[i],
    reward_funcs[i]); with `log_it`, a warning for each column that a contract argument of the same name hides
    from the functions (it is never passed)."""
    if not funcs:
        return
    problems = [(f.origin, problem) for f in funcs for problem in check_columns([f], examples)]
    if problems:
        raise ConfigError([f"{origin}: {problem}" for origin, problem in problems], [o for o, _ in problems])
    hidden = sorted({key for ex in examples for key in ex.metadata if key in ARGUMENTS})
    if hidden and log_it:
        log.warning(
            "the dataset's column(s) %s are not passed to the reward functions: the reward-function argument(s) "
            "of the same name take their place; rename the column(s) to pass them",
            ", ".join(hidden),
        )


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
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise RewardFunctionFailed(f"{where} returned {type(values).__name__}, not a list of numbers")
    try:
        values = list(values)  # a generator runs the user's code here: its failure is named like a raise
    except Exception as err:  # noqa: BLE001 - the user's code: named, with its traceback in the log
        log.exception("%s raised while its values were read", where)
        raise RewardFunctionFailed(
            f"{where} raised {brief(err)} while its values were read (traceback in the run log)"
        ) from err
    if len(values) != expected:
        raise RewardFunctionFailed(f"{where} returned {len(values)} values for {expected} completions")
    out = []
    for i, v in enumerate(values):
        number = math.nan if v is None else _number(v)
        if number is None:  # NaN and infinities too: only None abstains, so a broken score is never a silent 0
            shown = "an integer too large for a float" if isinstance(v, int) and not isinstance(v, bool) else repr(v)
            raise RewardFunctionFailed(f"{where} returned {shown} at position {i}: expected a finite number or None")
        out.append(number)
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


@dataclass(frozen=True)
class Scorers:
    """Which rank scores which slot: each trained slot (`trained[i]`) by one rank, slot i by rank i mod the
    world's size, so a function runs once per member and step."""

    trained: Sequence[bool]
    world: Any  # vlm_corl.distributed.world: its rank, size and all_gather

    def scores(self, slot: int) -> bool:
        """Whether this rank scores `slot`."""
        return bool(self.trained[slot]) and slot % self.world.size == self.world.rank


def function_rewards(
    funcs: Sequence[RewardFunction],
    batch: CohortBatch,
    examples: Sequence[Example],
    specs: Sequence[SlotSpec],
    scorers: Scorers,
    step: int,
) -> dict[str, torch.Tensor]:
    """{function name: (N, B, K) values, NaN where it abstained or for a slot that does not train}.

    Each trained slot is scored by one rank (`scorers`), so a function runs once per member and step; the ranks
    then exchange the values (one all_gather). A failure on any rank raises RewardFunctionFailed on every rank
    with the same text."""
    n, b, k = batch.shape
    world = scorers.world
    mine, failure = {}, None
    for i in range(n):
        if scorers.scores(i) and failure is None:
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


def run_reward_functions(cfg: CohortConfig, fns=None, weights=None) -> list[RewardFunction]:
    """The run's reward functions: reward.custom's (weights: reward.weights), then `fns` (CohortTrainer's
    reward_funcs: a callable, an import string as reward.custom takes, or a list of them; weights:
    `weights`, one number per function, or a single number for a single function), checked against the
    contract; a ConfigError naming each argument that does not fit, and reward.mode none without any function."""
    problems: list[tuple[str, str]] = []
    api = _api_functions(fns, problems)
    api_weights = _api_weights(weights, len(api), problems)
    named = [REWARDS.get(name) for name in custom_rewards(cfg)]
    single = isinstance(cfg.reward.custom, str)
    yaml = [("reward.custom" if single else f"reward.custom[{i}]", fn) for i, fn in enumerate(named)]
    problems += [(path, problem) for path, fn in [*yaml, *api] if (problem := contract_problem(fn))]
    yaml_weights = list(cfg.reward.weights or [1.0] * len(named))
    for i, w in enumerate(yaml_weights):
        if _number(w, allow_bool=False) is None:
            problems.append((f"reward.weights[{i}]", f"{w!r} is not a finite number"))
    if problems:
        raise ConfigError([f"{path}: {problem}" for path, problem in problems], [path for path, _ in problems])
    if cfg.reward.mode == "none" and not (named or api):
        raise ConfigError(
            [
                "reward.mode: none means only the reward functions, and none is given: add reward.custom or "
                "CohortTrainer(reward_funcs=[...]), or choose a reward mode"
            ],
            ["reward.mode"],
        )
    pairs = [*yaml, *api]
    return reward_functions([fn for _, fn in pairs], yaml_weights + api_weights, [path for path, _ in pairs])


def _api_functions(fns: object, problems: list[tuple[str, str]]) -> list[tuple[str, Callable]]:
    """CohortTrainer's reward_funcs as (where given, function): one callable or import string is one function
    (a string is never iterated letter by letter); a list may mix both. Problems are added, named."""
    if fns is None:
        return []
    if isinstance(fns, str) or callable(fns):
        given = [("reward_funcs", fns)]
    elif isinstance(fns, (bytes, Mapping)) or not isinstance(fns, Iterable):
        kind = "a dict" if isinstance(fns, Mapping) else repr(fns)
        problems.append(("reward_funcs", f"{kind} is neither a reward function nor a list of them"))
        return []
    else:
        given = [(f"reward_funcs[{i}]", fn) for i, fn in enumerate(fns)]
    out = []
    for path, fn in given:
        if isinstance(fn, str):
            if not CUSTOM_NAME.fullmatch(fn):  # reward.custom's rule, and its words
                problems.append((path, f"{fn!r} is not valid; expected module:function, e.g. my_pkg.rewards:score"))
                continue
            try:
                fn = REWARDS.get(fn)
            except Exception as err:  # noqa: BLE001 - a typo, or the user's module failing as it is imported
                said = str(err) if isinstance(err, UnknownNameError) else f"cannot load rewards {fn!r}: {brief(err)}"
                problems.append((path, said))
                continue
        elif not callable(fn):
            problems.append((path, f"{fn!r} is neither a callable nor an import string 'module:function'"))
            continue
        out.append((path, fn))
    return out


def _api_weights(weights: object, n: int, problems: list[tuple[str, str]]) -> list[float]:
    """CohortTrainer's reward_weights for its `n` functions: None (1 each), one number per function, or a single
    number for a single function. Problems are added, named."""
    if weights is None:
        return [1.0] * n
    if isinstance(weights, numbers.Real) and not isinstance(weights, bool) or _is_scalar_tensor(weights):
        weight = _number(weights, allow_bool=False)
        if weight is None:
            problems.append(("reward_weights", f"{weights!r} is not a finite number"))
        elif n != 1:
            problems.append(
                ("reward_weights", f"one weight for {n} reward functions; give a list of {n}, one per function")
            )
        return [1.0] * n if weight is None or n != 1 else [weight]
    if isinstance(weights, (str, bytes, Mapping)) or not isinstance(weights, Iterable):
        problems.append(("reward_weights", f"{weights!r} is neither a number nor a list of numbers"))
        return [1.0] * n
    given = list(weights)
    if len(given) != n:
        problems.append(("reward_weights", f"{len(given)} weight(s) for {n} reward function(s); give one per function"))
        return [1.0] * n
    out = []
    for i, w in enumerate(given):
        weight = _number(w, allow_bool=False)
        if weight is None:
            problems.append((f"reward_weights[{i}]", f"{w!r} is not a finite number"))
        out.append(1.0 if weight is None else weight)
    return out
