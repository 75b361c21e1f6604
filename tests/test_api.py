"""The Python API (issue 35, first part): `CohortTrainer(config, callbacks=...).train()` is what `corl train`
runs; callbacks see each event on the main process, and one that raises stops the run on every rank, named,
with the last checkpoint intact."""

from __future__ import annotations

import json

import pytest
import reward_fixtures
from cohort_helpers import cohort, metrics, on_ranks

from vlm_corl import CallbackFailed, CohortTrainer
from vlm_corl.config import ConfigError
from vlm_corl.training.run.callbacks import Callbacks
from vlm_corl.training.run.checkpoint import load_cohort_state


class Recorder:
    """Every event it is given, in order."""

    def __init__(self):
        self.events = []

    def on_train_begin(self):
        self.events.append(("begin",))

    def on_step_end(self, step, metrics):
        self.events.append(("step", step, sorted(row["member"] for row in metrics)))

    def on_evaluate(self, step, results):
        self.events.append(("evaluate", step, sorted({row["member"] for row in results})))

    def on_save(self, step, path):
        self.events.append(("save", step, path.name, path.is_dir()))

    def on_train_end(self, summary):
        self.events.append(("end", summary["run_dir"]))


def _config(tiny_zoo, tmp_path) -> dict:
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("l", tiny_zoo["mllama"])], reward={"mode": "ring"})
    cfg["train"]["save_every"] = 1
    cfg["eval"] = {"every": 2, "benchmarks": ["easyvqa"], "limit": 3, "max_new_tokens": 4}
    return cfg


def test_a_dict_config_trains_and_the_callbacks_see_every_event_in_order(tiny_zoo, tmp_path):
    recorder = Recorder()
    summary = CohortTrainer(_config(tiny_zoo, tmp_path), callbacks=[recorder]).train()
    run_dir = str(tmp_path / "run")
    assert summary["run_dir"] == run_dir
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["run_dir"] == run_dir
    assert recorder.events == [
        ("begin",),
        ("evaluate", 0, ["l", "q"]),  # the step-0 baseline
        ("save", 1, "step-1", True),
        ("step", 1, ["l", "q"]),
        ("save", 2, "step-2", True),
        ("evaluate", 2, ["l", "q"]),
        ("step", 2, ["l", "q"]),
        ("end", run_dir),
    ]
    assert sorted((r["step"], r["member"]) for r in metrics(tmp_path / "run")) == [
        (1, "l"),
        (1, "q"),
        (2, "l"),
        (2, "q"),
    ]


class FailsAtStep1:
    def on_step_end(self, step, metrics):
        raise ValueError("no such column")


def test_a_callback_that_raises_stops_the_run_named_and_the_checkpoint_stays_intact(tiny_zoo, tmp_path):
    with pytest.raises(CallbackFailed) as err:
        CohortTrainer(_config(tiny_zoo, tmp_path), callbacks=[FailsAtStep1()]).train()
    assert "callback FailsAtStep1.on_step_end raised at step 1: ValueError: no such column" in str(err.value)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-1"
    assert f"the last complete checkpoint, {checkpoint}, is intact" in str(err.value)
    assert load_cohort_state(checkpoint)["step"] == 1
    assert not (tmp_path / "run" / "checkpoints" / "step-2").exists()


def test_config_mistakes_and_callbacks_without_events_are_refused_before_training(tiny_zoo, tmp_path):
    cfg = _config(tiny_zoo, tmp_path)
    cfg["rollout"]["n"] = 0
    with pytest.raises(ConfigError, match="rollout.n"):
        CohortTrainer(cfg)
    with pytest.raises(ConfigError, match="rollout.temperature"):
        CohortTrainer(_config(tiny_zoo, tmp_path), overrides=["rollout.temperature=-1"])
    with pytest.raises(ConfigError, match=r"callbacks\[0\]: object has none of the methods on_train_begin"):
        CohortTrainer(_config(tiny_zoo, tmp_path), callbacks=[object()])


def test_a_failure_on_the_main_rank_stops_every_rank(tmp_path):
    """Callbacks run on rank 0 only; its failure reaches rank 1 at the agreement point, so no rank waits alone."""

    def on_rank(world):
        callbacks = Callbacks([FailsAtStep1()], is_main=world.is_main)
        callbacks.fire("on_step_end", 1, 1, [])
        try:
            callbacks.agree(world, tmp_path, None)
        except CallbackFailed as err:
            return str(err)
        return None

    first, second = on_ranks(2, on_rank)
    assert first == second and "FailsAtStep1.on_step_end raised at step 1" in first
    assert "no checkpoint was written yet" in first


# ---- datasets and reward functions ----------------------------------------------------------------------


def _dataset_config(tiny_zoo, tmp_path, **reward) -> dict:
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("l", tiny_zoo["mllama"])], reward=reward or {"mode": "none"})
    del cfg["data"]["train"]
    cfg["rollout"]["n"] = 2
    return cfg


def test_the_api_script_gives_every_member_the_functions_rewards(tiny_zoo, tmp_path):
    """tests/api_script.py in this process (the scale-out suite runs it under torchrun too): a Dataset of 16 rows
    with a renamed question column, one reward function, a callback; 2 steps."""
    import math

    from api_script import main

    zoo = tmp_path / "zoo"
    zoo.mkdir()
    for family in ("qwen2_vl", "mllama"):
        (zoo / family).symlink_to(tiny_zoo[family])
    summary = main(zoo, tmp_path)
    calls = json.loads((tmp_path / "calls-0.json").read_text())
    assert calls == [
        {"member": m, "n": 8, "peers": [peer], "topic": ["shapes"]}
        for _ in range(2)
        for m, peer in (("q", "l"), ("l", "q"))
    ]
    assert json.loads((tmp_path / "steps.json").read_text()) == [1, 2]
    rows = metrics(tmp_path / "run")
    assert sorted((r["step"], r["member"]) for r in rows) == [(1, "l"), (1, "q"), (2, "l"), (2, "q")]
    for r in rows:  # reward.mode none: the reward is the function's, abstentions (every fifth) adding 0
        assert r["reward_brevity"] < 0 and math.isclose(r["reward_mean"], r["reward_brevity"] * 6 / 8, rel_tol=1e-5)
    assert summary["data"] == {"used": 16, "kept": 16, "skip": 0, "skipped": {}, "skipped_examples": {}}
    assert summary["reward_functions"] == [{"name": "brevity", "weight": 1.0}]


def test_bad_rows_of_a_list_dataset_are_skipped_counted_and_reported(tiny_zoo, tmp_path, caplog):
    from PIL import Image

    picture = Image.new("RGB", (32, 32), "red")
    rows = [{"question": f"what color is it? {i}", "answer": "red", "image": picture} for i in range(6)]
    rows += [{"question": "", "image": picture}, {"question": "a missing image?", "image": str(tmp_path / "no.png")}]
    rows += [{"question": "what color is it? 0", "image": picture}]  # its id repeats no other: kept
    summary = CohortTrainer(
        _dataset_config(tiny_zoo, tmp_path), train_dataset=rows, reward_funcs=reward_fixtures.shorter_is_better
    ).train()
    assert summary["data"]["kept"] == 7
    assert summary["data"]["skipped"] == {"empty_question": 1, "missing_image": 1}
    assert "skipped 2" in caplog.text and "missing_image: 1" in caplog.text


def test_dataset_mistakes_name_the_argument_and_the_column(tiny_zoo, tmp_path):
    import datasets

    from vlm_corl.data.loaders import DataError

    ds = datasets.Dataset.from_dict({"query": ["q"], "solution": ["a"]})
    cfg = _dataset_config(tiny_zoo, tmp_path)
    fn = reward_fixtures.constant
    with pytest.raises(DataError, match=r"train_dataset: no question column .*columns: query, solution"):
        CohortTrainer(cfg, train_dataset=ds, reward_funcs=fn)
    with pytest.raises(DataError, match=r"train_dataset: no column 'answer_text' \(for answer\)"):
        CohortTrainer(cfg, train_dataset=ds, columns={"question": "query", "answer": "answer_text"}, reward_funcs=fn)
    with pytest.raises(DataError, match=r"unknown field\(s\) \['label'\]"):
        CohortTrainer(cfg, train_dataset=ds, columns={"label": "solution"}, reward_funcs=fn)
    with pytest.raises(DataError, match="must be a datasets.Dataset, a datasets.IterableDataset or a list of dicts"):
        CohortTrainer(cfg, train_dataset="data.jsonl", reward_funcs=fn)
    twice = {**cfg, "data": {"train": {"loader": "easyvqa"}, "batch_size": 4}}
    with pytest.raises(ConfigError, match="data.train.loader: the training data would come from two places"):
        CohortTrainer(twice, train_dataset=ds, columns={"question": "query"}, reward_funcs=fn)
    with pytest.raises(ConfigError, match="eval.every: eval_dataset is evaluated every eval.every steps"):
        CohortTrainer(cfg, eval_dataset=ds, columns={"question": "query"}, reward_funcs=fn)


def test_reward_function_mistakes_are_refused_before_training(tiny_zoo, tmp_path):
    cfg = _dataset_config(tiny_zoo, tmp_path)
    cfg["data"]["train"] = {"loader": "easyvqa", "limit": 16}
    with pytest.raises(ConfigError, match="reward.mode: none means only the reward functions, and none is given"):
        CohortTrainer(cfg)
    with pytest.raises(ConfigError, match=r"reward_weights: 2 weight\(s\) for 1 reward function"):
        CohortTrainer(cfg, reward_funcs=[reward_fixtures.constant], reward_weights=[1.0, 2.0])
    with pytest.raises(ConfigError, match=r"old_style does not take the reward-function arguments.*lacks member"):
        CohortTrainer(cfg, reward_funcs=[old_style])
    yaml_cfg = {**cfg, "reward": {"mode": "none", "custom": ["test_api:old_style"]}}
    with pytest.raises(ConfigError, match=r"reward.custom\[0\]: test_api:old_style does not take the reward-function"):
        CohortTrainer(yaml_cfg)


def old_style(batch, cfg):
    """A cohort-level reward (a reward mode's signature), not a reward function."""


class FailsOnMember:
    """A reward function that fails for member 'l' at step 2, in one of three ways."""

    def __init__(self, how: str):
        self.how, self.__name__, self.__qualname__ = how, f"fails_{how}", f"fails_{how}"
        self.step = {}

    def __call__(self, *, member, completions, **_):
        self.step[member] = self.step.get(member, 0) + 1
        values = [0.5] * len(completions)
        if member != "l" or self.step[member] < 2:
            return values
        if self.how == "raise":
            raise KeyError("no column 'level'")
        return values[:-1] if self.how == "length" else ["high"] * len(completions)


@pytest.mark.parametrize(
    "how, said",
    [
        ("raise", "raised KeyError: \"no column 'level'\" (traceback in the run log)"),
        ("length", "returned 15 values for 16 completions"),  # 4 questions x 4 responses
        ("type", "returned 'high' at position 0: expected a finite number or None"),
    ],
)
def test_a_failing_reward_function_stops_the_step_named_with_the_checkpoint_intact(tiny_zoo, tmp_path, how, said):
    from vlm_corl import RewardFunctionFailed

    cfg = _config(tiny_zoo, tmp_path)
    cfg["eval"] = {"every": 0}
    with pytest.raises(RewardFunctionFailed) as err:
        CohortTrainer(cfg, reward_funcs=[FailsOnMember(how)]).train()
    assert f"reward function test_api:fails_{how} for member 'l' at step 2 {said}" in str(err.value)
    assert load_cohort_state(tmp_path / "run" / "checkpoints" / "step-1")["step"] == 1
    assert not (tmp_path / "run" / "checkpoints" / "step-2").exists()


def test_a_reward_function_failure_on_one_rank_stops_every_rank():
    """Slots are scored on rank (slot mod world size): member 'l' (slot 1) on rank 1; rank 0 learns of its
    failure in the same all_gather, so neither rank waits alone."""
    from vlm_corl import RewardFunctionFailed
    from vlm_corl.data.records import Example
    from vlm_corl.training.rewards.modes import CohortBatch
    from vlm_corl.training.rewards.reward_funcs import Scorers, function_rewards, reward_functions
    from vlm_corl.training.run.slots import SlotSpec

    batch = CohortBatch(("q", "l"), [[["a", "b"]], [["a", None]]], [[["x", "yy"]], [["x", "y"]]], [[[1, 1]]] * 2,
                        [None], [None])  # fmt: skip
    specs = [SlotSpec("q", "q", "original"), SlotSpec("l", "l", "original")]
    funcs = reward_functions([FailsOnMember("raise")], None)
    funcs[0].fn.step = {"l": 1}

    def on_rank(world):
        try:
            return function_rewards(funcs, batch, [Example("e", "?")], specs, Scorers([True, True], world), 2)
        except RewardFunctionFailed as err:
            return str(err)

    first, second = on_ranks(2, on_rank)
    assert first == second and "for member 'l' at step 2 raised KeyError" in first


def test_a_resume_with_other_data_is_refused(tiny_zoo, tmp_path):
    import datasets

    cfg = _dataset_config(tiny_zoo, tmp_path)
    cfg["train"].update(max_steps=1, save_every=1)
    one = datasets.Dataset.from_dict({"question": [f"what shape is {i}?" for i in range(8)]})
    CohortTrainer(cfg, train_dataset=one, reward_funcs=reward_fixtures.constant).train()
    other = datasets.Dataset.from_dict({"question": [f"what color is {i}?" for i in range(8)]})
    cfg["train"].update(max_steps=2, resume=True)
    with pytest.raises(ConfigError, match="data.train.options"):
        CohortTrainer(cfg, train_dataset=other, reward_funcs=reward_fixtures.constant).train()
    summary = CohortTrainer(cfg, train_dataset=one, reward_funcs=reward_fixtures.constant).train()  # same data: on
    assert sorted((r["step"], r["member"]) for r in metrics(tmp_path / "run")) == [
        (1, "l"),
        (1, "q"),
        (2, "l"),
        (2, "q"),
    ]
    assert summary["steps"] == 2


def test_an_iterable_dataset_and_its_decoded_images_load_like_a_file(tmp_path):
    """A streamed dataset yields decoded PIL images: they are read as PNG bytes, and limit stops the stream."""
    import datasets
    import easy_vqa

    from vlm_corl.data.images import load_image
    from vlm_corl.data.loaders import load_examples
    from vlm_corl.data.python_data import register_dataset

    paths = easy_vqa.get_train_image_paths()
    ds = datasets.Dataset.from_dict(
        {"q": ["what shape?"] * 3, "img": [paths[0], paths[1], paths[2]], "level": [1, 2, 3]}
    )
    stream = ds.cast_column("img", datasets.Image()).to_iterable_dataset()
    options = register_dataset(stream, {"question": "q", "image": "img"}, "train_dataset")
    data = load_examples("python", None, limit=2, **options)
    assert [ex.metadata for ex in data.examples] == [{"level": 1}, {"level": 2}]
    assert isinstance(data.examples[0].images[0], bytes)
    assert load_image(data.examples[0].images[0]).size == load_image(paths[0]).size


def test_the_data_line_and_summary_give_what_the_run_uses_after_skip_and_limit(caplog):
    """skip 30, limit 20: 50 records read and kept, the run trains on 20 of them, and says so."""
    import logging

    from vlm_corl.config.schema import DatasetConfig
    from vlm_corl.training.run.setup import load_training_examples

    with caplog.at_level(logging.INFO, logger="vlm_corl"):
        examples, report = load_training_examples(DatasetConfig(loader="easyvqa", skip=30, limit=20))
    assert len(examples) == 20 and report.as_dict()["used"] == 20 and report.kept == 50
    assert "easyvqa[train]: kept 50, skipped 0; the run uses 20 (after the first 30 and the limit)" in caplog.text


def test_progress_to_a_log_file_is_plain_lines_not_bar_frames(tiny_zoo, tmp_path, caplog, capsys):
    """Under pytest stderr is not a terminal: the run logs a plain line per ~5% of its steps, and no tqdm frame."""
    import logging

    cfg = _config(tiny_zoo, tmp_path)
    cfg["eval"] = {"every": 0}
    cfg["logging"]["progress"] = True
    with caplog.at_level(logging.INFO, logger="vlm_corl"):
        CohortTrainer(cfg).train()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step ")]
    assert [line.split(":")[0] for line in lines] == ["step 1/2 (50%)", "step 2/2 (100%)"]
    assert "reward q " in lines[0] and "s/step" in lines[0]
    assert "\r" not in capsys.readouterr().err
