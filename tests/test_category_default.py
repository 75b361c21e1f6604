"""`logging.category_key: auto` (the default): the category field the training loader declares, when every
example carries it; an explicit key or null wins. (End to end: tests/test_collapse_guard.py runs the guard on
easy-vqa without setting the key.)"""

import dataclasses

from vlm_corl.config.schema import CohortConfig, DataConfig, DatasetConfig, LoggingConfig, MemberConfig
from vlm_corl.data.loaders import loader_category
from vlm_corl.data.records import Example
from vlm_corl.training.run.setup import category_key


def cfg(loader="easyvqa", **logging):
    return CohortConfig(
        members=[MemberConfig(id="a", model="m")],
        data=DataConfig(train=DatasetConfig(loader=loader)),
        logging=LoggingConfig(**logging),
    )


def examples(**metadata):
    return [Example(id=f"e{i}", question="q?", answer="1", metadata=dict(metadata)) for i in range(3)]


def test_the_loaders_declare_their_category():
    assert loader_category("easyvqa") == "question_type"
    assert loader_category("math500") == "subject"
    assert loader_category("vlm_corl.experiments.easyvqa_data:load") == "question_type"
    assert loader_category("jsonl") is None and loader_category("gsm8k") is None


def test_auto_uses_the_declared_key_when_every_example_has_it():
    assert cfg().logging.category_key == "auto"
    assert category_key(cfg(), examples(question_type="color")) == "question_type"
    assert category_key(cfg("math500"), examples(subject="algebra")) == "subject"
    # a declared key some example lacks, or a loader that declares none: no per-category metrics
    some = examples(question_type="color")
    some[1] = dataclasses.replace(some[1], metadata={})
    assert category_key(cfg(), some) is None
    assert category_key(cfg("jsonl"), examples(question_type="color")) is None


def test_an_explicit_key_or_null_wins():
    assert category_key(cfg(category_key="topic"), examples(question_type="color")) == "topic"
    assert category_key(cfg(category_key=None), examples(question_type="color")) is None
