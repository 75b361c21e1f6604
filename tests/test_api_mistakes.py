"""Issue 46, the Python API's arguments: what a script gives `CohortTrainer` is used as given or refused in one
line naming the argument, never iterated letter by letter, dropped or found wrong only after the models load. A
reward function's import string is one function, a single weight or callback is one; a function whose signature
cannot take the dataset's columns is refused at start; a callback stops a run cleanly with `vlm_corl.StopTraining`; a
non-finite reward is an error naming the function, on every rank."""

from __future__ import annotations

import json
import math

import pytest
import reward_fixtures
import torch
from cohort_helpers import cohort, metrics, on_ranks

import vlm_corl
from vlm_corl import CohortTrainer, RewardFunctionFailed
from vlm_corl.config import ConfigError
from vlm_corl.training.run.callbacks import Callbacks


def _config(tiny_zoo, tmp_path, **reward) -> dict:
    """Two tiny members, 2 steps of 4 questions x 2 responses, no evaluation."""
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("l", tiny_zoo["mllama"])], reward=reward or {"mode": "ring"})
    cfg["rollout"]["n"] = 2
    return cfg


def _rows(n: int = 8, **columns) -> list[dict]:
    """A list dataset of `n` text questions, with `columns` (name -> value) on every row."""
    return [{"question": f"what is {i} + 1?", **columns} for i in range(n)]


# ---- reward_funcs and reward_weights -----------------------------------------------------------------------


def test_an_import_string_is_one_reward_function_and_a_list_may_mix_strings_and_callables(tiny_zoo, tmp_path):
    cfg = _config(tiny_zoo, tmp_path)
    one = CohortTrainer(cfg, reward_funcs="reward_fixtures:shorter_is_better")
    assert [(f.fn, f.name, f.weight) for f in one.reward_funcs] == [
        (reward_fixtures.shorter_is_better, "shorter_is_better", 1.0)
    ]
    mixed = CohortTrainer(
        cfg, reward_funcs=["reward_fixtures:constant", reward_fixtures.shorter_is_better], reward_weights=[0.5, 2]
    )
    assert [(f.fn, f.weight) for f in mixed.reward_funcs] == [
        (reward_fixtures.constant, 0.5),
        (reward_fixtures.shorter_is_better, 2.0),
    ]


def test_reward_funcs_that_cannot_be_loaded_or_called_are_refused_naming_the_entry(tiny_zoo, tmp_path):
    cfg = _config(tiny_zoo, tmp_path)
    with pytest.raises(ConfigError, match=r"^invalid config: reward_funcs: cannot load rewards 'no_such_module:fn'"):
        CohortTrainer(cfg, reward_funcs="no_such_module:fn")
    with pytest.raises(ConfigError, match=r"^invalid config: reward_funcs: 'reward_fixtures.constant' is not valid"):
        CohortTrainer(cfg, reward_funcs="reward_fixtures.constant")  # reward.custom's rule: module:function
    with pytest.raises(ConfigError, match=r"reward_funcs\[1\]: 3 is neither a callable nor an import string"):
        CohortTrainer(cfg, reward_funcs=[reward_fixtures.constant, 3])
    with pytest.raises(ConfigError, match=r"reward_funcs: a dict is neither a reward function nor a list of them"):
        CohortTrainer(cfg, reward_funcs={"brevity": reward_fixtures.constant})


def test_a_single_weight_goes_with_a_single_function_and_wrong_weights_name_reward_weights(tiny_zoo, tmp_path):
    cfg = _config(tiny_zoo, tmp_path)
    trainer = CohortTrainer(cfg, reward_funcs=reward_fixtures.constant, reward_weights=0.25)
    assert [f.weight for f in trainer.reward_funcs] == [0.25]
    two = [reward_fixtures.constant, reward_fixtures.shorter_is_better]
    with pytest.raises(ConfigError, match=r"^invalid config: reward_weights: one weight for 2 reward functions"):
        CohortTrainer(cfg, reward_funcs=two, reward_weights=2.0)
    with pytest.raises(ConfigError, match=r"reward_weights: '1' is neither a number nor a list of numbers"):
        CohortTrainer(cfg, reward_funcs=reward_fixtures.constant, reward_weights="1")
    with pytest.raises(ConfigError, match=r"reward_weights\[1\]: 'x' is not a finite number"):
        CohortTrainer(cfg, reward_funcs=two, reward_weights=[1.0, "x"])
    with pytest.raises(ConfigError, match=r"reward_weights: nan is not a finite number"):
        CohortTrainer(cfg, reward_funcs=reward_fixtures.constant, reward_weights=math.nan)


# ---- callbacks -------------------------------------------------------------------------------------------------


class Steps:
    def on_step_end(self, step, metrics):
        pass


class Misspelled:
    def on_step_end(self, step, metrics):
        pass

    def on_evalute(self, step, results):  # never called: refused, not silently dropped
        pass


def test_a_single_callback_object_is_one_callback_and_wrong_ones_name_callbacks(tiny_zoo, tmp_path):
    cfg = _config(tiny_zoo, tmp_path)
    steps = Steps()
    assert CohortTrainer(cfg, callbacks=steps).callbacks == [steps]
    with pytest.raises(ConfigError, match=r"^invalid config: callbacks: Steps is a class; pass an instance, Steps\(\)"):
        CohortTrainer(cfg, callbacks=Steps)
    with pytest.raises(ConfigError, match=r"callbacks\[1\]: object has none of the methods on_train_begin"):
        CohortTrainer(cfg, callbacks=[steps, object()])
    with pytest.raises(ConfigError, match=r"callbacks: 'log' has none of the methods on_train_begin"):
        CohortTrainer(cfg, callbacks="log")
    with pytest.raises(ConfigError, match=r"callbacks\[0\]: Misspelled.on_evalute is no event.*mean on_evaluate"):
        CohortTrainer(cfg, callbacks=[Misspelled()])


# ---- reward functions against the dataset's columns, before any model loads -----------------------------------


def strict(*, member, prompts, completions, answers, peer_answers):
    """Takes the contract's arguments and no column."""
    return [0.0] * len(completions)


def wants_level(*, completions, level, **_):
    """Needs a `level` column."""
    return [float(level[i]) for i in range(len(completions))]


def test_a_reward_function_that_cannot_take_the_columns_is_refused_before_any_model_loads(
    tiny_zoo, tmp_path, monkeypatch
):
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the reward functions were checked")

    monkeypatch.setattr("vlm_corl.training.run.setup.load_hosted_members", no_model)
    cfg = _config(tiny_zoo, tmp_path, mode="none")
    del cfg["data"]["train"]
    with pytest.raises(ConfigError) as err:
        CohortTrainer(cfg, train_dataset=_rows(topic="sums"), reward_funcs=strict).train()
    assert str(err.value) == (
        "invalid config: reward_funcs: test_api_mistakes:strict does not take the dataset's column 'topic', which "
        "every call passes as a keyword argument: add a parameter topic, or **kwargs"
    )
    with pytest.raises(ConfigError) as err:
        CohortTrainer(cfg, train_dataset=_rows(topic="sums"), reward_funcs=[strict, wants_level]).train()
    assert str(err.value) == (
        "2 config problems:\n"
        "  - reward_funcs[0]: test_api_mistakes:strict does not take the dataset's column 'topic', which every call "
        "passes as a keyword argument: add a parameter topic, or **kwargs\n"
        "  - reward_funcs[1]: test_api_mistakes:wants_level requires level, which is no reward-function argument "
        "and no column of the dataset (columns: topic): give it a default, or add the column"
    )
    yaml = {**_config(tiny_zoo, tmp_path, mode="none", custom="test_api_mistakes:strict")}
    with pytest.raises(ConfigError, match=r"^invalid config: reward.custom: test_api_mistakes:strict does not take"):
        CohortTrainer(yaml).train()  # easyvqa's rows carry question_type and image_id


def test_a_column_only_some_rows_have_is_one_a_function_must_accept_or_not_require(tiny_zoo, tmp_path, monkeypatch):
    """A column some rows lack is passed at the steps whose every question has it: a function without **kwargs must
    take it, and one that requires it would fail at the other steps."""
    from vlm_corl.data.records import Example
    from vlm_corl.training.rewards.reward_funcs import check_columns, reward_functions

    examples = [Example("a", "?", metadata={"level": 1}), Example("b", "?", metadata={})]
    problems = check_columns(reward_functions([strict, wants_level], None), examples)
    assert problems == [
        "test_api_mistakes:strict does not take the dataset's column 'level', which every call whose questions "
        "all have it passes as a keyword argument: add a parameter level, or **kwargs",
        "test_api_mistakes:wants_level requires level, a column only some rows have (1 of 2): give it a default, "
        "or give every row the column",
    ]
    assert check_columns(reward_functions([wants_level], None), examples[:1]) == []


def test_a_column_named_like_an_argument_is_not_passed_and_the_log_says_so(caplog):
    from vlm_corl.data.records import Example
    from vlm_corl.training.rewards.reward_funcs import check_run_columns, reward_functions

    examples = [Example("a", "?", metadata={"answers": "4", "topic": "sums"})]
    check_run_columns(reward_functions([reward_fixtures.constant], None), examples, log_it=True)
    assert "the dataset's column(s) answers are not passed to the reward functions" in caplog.text


# ---- a callback's clean stop -----------------------------------------------------------------------------------


class StopAfterFirstStep:
    """Asks the run to stop after step 1 (of 3), returning StopTraining; records what it is shown afterwards."""

    def __init__(self):
        self.events = []

    def on_step_end(self, step, metrics):
        self.events.append(("step", step))
        return vlm_corl.StopTraining("reward is good enough") if step == 1 else None

    def on_save(self, step, path):
        self.events.append(("save", step, path.name))

    def on_train_end(self, summary):
        self.events.append(("end", summary["stopped_by_callback"]["step"]))


def test_a_callback_stops_the_run_cleanly_with_a_summary_and_the_final_checkpoint(tiny_zoo, tmp_path):
    from vlm_corl.training.run.checkpoint import load_cohort_state

    cfg = _config(tiny_zoo, tmp_path)
    cfg["train"]["max_steps"] = 3
    stopper = StopAfterFirstStep()
    summary = CohortTrainer(cfg, callbacks=stopper).train()  # a single callback object, not in a list
    stop = {
        "callback": "StopAfterFirstStep",
        "event": "on_step_end",
        "step": 1,
        "reason": "reward is good enough",
    }
    assert summary["stopped_by_callback"] == stop and summary["steps"] == 1
    written = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert written["stopped_by_callback"] == stop and written["checkpoint"] == str(
        tmp_path / "run" / "checkpoints" / "step-1"
    )
    assert load_cohort_state(tmp_path / "run" / "checkpoints" / "step-1")["step"] == 1  # train.save_last's
    assert sorted((r["step"], r["member"]) for r in metrics(tmp_path / "run")) == [(1, "l"), (1, "q")]
    assert stopper.events == [("step", 1), ("save", 1, "step-1"), ("end", 1)]


class StopAtBegin:
    def on_train_begin(self):
        raise vlm_corl.StopTraining("nothing to do")


def test_a_stop_raised_before_the_first_step_trains_nothing_and_returns_the_summary(tiny_zoo, tmp_path):
    cfg = _config(tiny_zoo, tmp_path)
    summary = CohortTrainer(cfg, callbacks=[StopAtBegin()]).train()
    assert summary["stopped_by_callback"] == {
        "callback": "StopAtBegin",
        "event": "on_train_begin",
        "step": 0,
        "reason": "nothing to do",
    }
    assert summary["steps"] == 0 and summary["checkpoint"] is None
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or metrics(tmp_path / "run") == []
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["stopped_by_callback"]["step"] == 0


def test_a_stop_on_the_main_rank_reaches_every_rank(tmp_path):
    """Callbacks run on rank 0 only; the stop reaches rank 1 at the agreement point, so both leave the loop."""

    def on_rank(world):
        callbacks = Callbacks([StopAfterFirstStep()], is_main=world.is_main)
        callbacks.fire("on_step_end", 1, 1, [])
        return callbacks.agree(world, tmp_path, None)

    first, second = on_ranks(2, on_rank)
    assert (
        first
        == second
        == {
            "callback": "StopAfterFirstStep",
            "event": "on_step_end",
            "step": 1,
            "reason": "reward is good enough",
        }
    )


# ---- non-finite rewards ----------------------------------------------------------------------------------------


class Returns:
    """A reward function that returns `value` for member 'l' (slot 1: scored on rank 1 of 2) and 0.5 otherwise."""

    def __init__(self, value):
        self.value, self.__name__, self.__qualname__ = value, "returns", "returns"

    def __call__(self, *, member, completions, **_):
        if member != "l":
            return [0.5] * len(completions)
        return self.value(len(completions)) if callable(self.value) else [self.value] * len(completions)


def _broken_generator(n):
    yield 0.5
    raise KeyError("level")


@pytest.mark.parametrize(
    "value, said",
    [
        (math.nan, "returned nan at position 0: expected a finite number or None"),
        (-math.inf, "returned -inf at position 0: expected a finite number or None"),
        (10**400, "returned an integer too large for a float at position 0: expected a finite number or None"),
        (torch.tensor(math.inf), "returned tensor(inf) at position 0: expected a finite number or None"),
        (lambda n: torch.full((n,), math.nan), "returned nan at position 0: expected a finite number or None"),
        (_broken_generator, "raised KeyError: 'level' while its values were read (traceback in the run log)"),
    ],
)
def test_a_non_finite_or_unreadable_reward_is_an_error_naming_the_function_on_every_rank(value, said):
    from vlm_corl.data.records import Example
    from vlm_corl.training.rewards.modes import CohortBatch
    from vlm_corl.training.rewards.reward_funcs import Scorers, function_rewards, reward_functions
    from vlm_corl.training.run.slots import SlotSpec

    batch = CohortBatch(("q", "l"), [[["a", "b"]], [["a", None]]], [[["x", "yy"]], [["x", "y"]]], [[[1, 1]]] * 2,
                        [None], [None])  # fmt: skip
    specs = [SlotSpec("q", "q", "original"), SlotSpec("l", "l", "original")]
    funcs = reward_functions([Returns(value)], None)

    def on_rank(world):
        try:
            return function_rewards(funcs, batch, [Example("e", "?")], specs, Scorers([True, True], world), 3)
        except RewardFunctionFailed as err:
            return str(err)

    first, second = on_ranks(2, on_rank)
    assert first == second
    assert first.startswith("reward function test_api_mistakes:returns for member 'l' at step 3 ")
    assert said in first


def test_a_zero_dimensional_tensor_is_a_number_and_none_abstains():
    from vlm_corl.training.rewards.reward_funcs import checked_values

    values = checked_values([torch.tensor(0.5), None, 2, torch.tensor([1.5])[0]], 4, "fn")
    assert values[0] == 0.5 and math.isnan(values[1]) and values[2:] == [2.0, 1.5]
