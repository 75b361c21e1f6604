"""`corl export` writes a model card and prompt_format.json into each member (issue 36, item 4): the card names
the base model, peers, reward, steps, data, the run's evaluations and the prompt format; `corl eval`'s loading
reads the format back, so an export is asked (and scores) as its checkpoint was; the files are 0644.

Issue 46, kind 5: the card describes the checkpoint's own run, from the config saved with that step and the
run's reward setup: a `gt` run says it read gold answers, a reward-function run names its functions, a text
member gets a text snippet with the chat-template variables it trained with, an earlier step its own format."""

from __future__ import annotations

import json
import stat
from typing import get_args

import pytest
import reward_fixtures
from cohort_helpers import cohort
from huggingface_hub import ModelCard, metadata_load

from vlm_corl import CohortTrainer
from vlm_corl.commands.export import main as export
from vlm_corl.config import MemberConfig
from vlm_corl.config.schema import RewardMode
from vlm_corl.evaluation.scoring import EASYVQA, benchmark_examples, evaluate_dir, evaluate_member
from vlm_corl.members.member import load_member
from vlm_corl.members.prompt_format import member_config
from vlm_corl.members.render import PROMPT_STYLES
from vlm_corl.reporting.model_card import CheckpointRun, card_data, hub_base, reward_line


def test_the_export_carries_its_card_and_prompt_format_and_scores_as_the_checkpoint(tiny_zoo, tmp_path, capsys):
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen2_vl"]), ("l", tiny_zoo["mllama"])], reward={"mode": "ring"})
    cfg["members"][0].update(prompt_style="boxed", system_prompt="Answer briefly.")  # not the family's default
    cfg["eval"] = {"every": 2, "benchmarks": ["easyvqa"], "limit": 3, "max_new_tokens": 4}
    CohortTrainer(cfg).train()
    assert export([str(tmp_path / "run"), "--out", str(tmp_path / "export")]) == 0
    assert "q: model + model card" in capsys.readouterr().out
    q = tmp_path / "export" / "q"
    card = (q / "README.md").read_text()
    said = [f"`{tiny_zoo['qwen2_vl']}`", f"peers: `l` ({tiny_zoo['mllama']})", "**Reward**: `ring`", "**Steps**: 2"]
    said += ["loader `easyvqa`", "| easyvqa | 2 |", "within \\boxed{}", '"Answer briefly."']
    said += ['{"type": "image"}', "processor.apply_chat_template("]  # a vision member is asked with its image
    for text in said:
        assert text in card, text
    header = ModelCard.load(q / "README.md").data  # the Hub's own reading of the card's metadata
    assert (header.pipeline_tag, header.library_name, header.base_model) == ("image-text-to-text", "transformers", None)
    assert header.tags == ["co-rl", "grpo", "label-free-rl"]
    evaluated = [json.loads(line) for line in (tmp_path / "run" / "eval.jsonl").read_text().splitlines()]
    mine = [r for r in evaluated if r["member"] == "q" and r["step"] == 2]
    assert [(e.dataset_name, e.metric_type, e.metric_value) for e in header.eval_results] == [
        ("easyvqa", "accuracy", mine[0]["accuracy"])
    ]
    fmt = json.loads((q / "prompt_format.json").read_text())
    assert fmt["prompt_style"] == "boxed" and fmt["system_prompt"] == "Answer briefly."
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in q.iterdir()}
    assert set(modes.values()) == {0o644}, modes
    # read back: the export is asked as the checkpoint was, and answers the same
    asked = member_config(q)
    member = load_member(asked, device=None)
    shown = PROMPT_STYLES["boxed"].format(question="What shape is in the image?")
    assert snippet_prompt(card, q) == member.apply_chat_template(shown, 1, "Answer briefly.")
    assert (asked.prompt_style, asked.system_prompt) == ("boxed", "Answer briefly.")
    examples = benchmark_examples(EASYVQA, 4)
    checkpoint = MemberConfig(id="q", model=str(tmp_path / "run" / "checkpoints" / "step-2" / "q"), trainable=False,
                              prompt_style="boxed", system_prompt="Answer briefly.")  # fmt: skip
    before = evaluate_member(load_member(checkpoint, device=None), examples, EASYVQA)
    after = evaluate_dir(q, EASYVQA, examples)
    assert [r["response"] for r in after["records"]] == [r["response"] for r in before["records"]]
    assert after["accuracy"] == before["accuracy"]
    # the family's default format (no prompt_format.json) asks differently
    assert member_config(tiny_zoo["qwen2_vl"]).prompt_style is None


SNIPPET_TEXT = PROMPT_STYLES["answer_tags"].format(question="What is 7 * 6?")


def snippet_prompt(card: str, folder) -> str:
    """The prompt text the card's transformers snippet renders, run on the exported `folder`."""
    code = card.split("```python\n", 1)[1].split("```", 1)[0]
    scope: dict = {}
    exec(code.replace("THIS_FOLDER", str(folder)), scope)
    return scope["text"]


@pytest.fixture(scope="module")
def text_run(tiny_zoo, tmp_path_factory):
    """Two text members, reward.mode none with one reward function: step 1 asked in the boxed style, then resumed
    to step 2 in answer tags (the prompt style may change at resume). Qwen3's family renders its template with
    enable_thinking false."""
    tmp = tmp_path_factory.mktemp("text_card")
    cfg = cohort(tmp, [("q", tiny_zoo["qwen3"]), ("l", tiny_zoo["llama"])], reward={"mode": "none"})
    cfg["data"] = {"train": {"loader": "math500", "split": "test", "limit": 8}, "batch_size": 2}
    cfg["rollout"]["n"] = 2
    cfg["members"][0]["prompt_style"] = "boxed"
    cfg["train"].update(max_steps=1, save_every=1)
    CohortTrainer(cfg, reward_funcs=reward_fixtures.shorter_is_better).train()
    cfg["members"][0]["prompt_style"] = "answer_tags"
    cfg["train"].update(max_steps=2, resume=True)
    CohortTrainer(cfg, reward_funcs=reward_fixtures.shorter_is_better).train()
    return tmp / "run"


def test_an_earlier_step_is_exported_with_the_format_that_step_trained_with(text_run, tmp_path):
    """The run's config.yaml is the latest launch's; an export of step 1 records step 1's own config."""
    assert export([str(text_run), "--step", "1", "--out", str(tmp_path / "one")]) == 0
    assert export([str(text_run), "--out", str(tmp_path / "two")]) == 0
    first = json.loads((tmp_path / "one" / "q" / "prompt_format.json").read_text())
    last = json.loads((tmp_path / "two" / "q" / "prompt_format.json").read_text())
    assert (first["prompt_style"], last["prompt_style"]) == ("boxed", "answer_tags")
    assert "within \\boxed{}" in (tmp_path / "one" / "q" / "README.md").read_text()
    assert member_config(tmp_path / "one" / "q").prompt_style == "boxed"


def test_a_text_members_card_asks_in_text_with_the_template_kwargs_it_trained_with(text_run, tmp_path):
    assert export([str(text_run), "--out", str(tmp_path / "out")]) == 0
    q = tmp_path / "out" / "q"
    card = (q / "README.md").read_text()
    assert '{"type": "image"}' not in card and "processor" not in card
    assert "tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, " in card
    assert "enable_thinking=False" in card
    assert json.loads((q / "prompt_format.json").read_text())["chat_template_kwargs"] == {"enable_thinking": False}
    header = metadata_load(q / "README.md")
    assert (header["pipeline_tag"], header["library_name"]) == ("text-generation", "transformers")
    assert "model-index" not in header  # no evaluation in this run
    llama = (tmp_path / "out" / "l" / "README.md").read_text()  # a family without template variables
    assert "add_generation_prompt=True)" in llama and '{"type": "image"}' not in llama
    # the card's snippet, run, renders the prompt training rendered
    member = load_member(member_config(q), device=None)
    assert snippet_prompt(card, q) == member.apply_chat_template(SNIPPET_TEXT, 0, None)


def test_a_reward_function_run_names_its_function_and_claims_no_peer_agreement(text_run, tmp_path):
    assert export([str(text_run), "--out", str(tmp_path / "out")]) == 0
    card = (tmp_path / "out" / "q" / "README.md").read_text()
    reward = next(line for line in card.splitlines() if line.startswith("- **Reward**"))
    assert "`reward_fixtures:shorter_is_better`" in reward and "weight 1.0" in reward
    assert "peers" not in reward and "agreement" not in reward


def test_a_gt_runs_card_says_it_was_rewarded_with_gold_answers(tiny_zoo, tmp_path):
    cfg = cohort(tmp_path, [("q", tiny_zoo["qwen3"]), ("l", tiny_zoo["llama"])], reward={"mode": "gt"})
    cfg["data"] = {"train": {"loader": "math500", "split": "test", "limit": 4}, "batch_size": 2}
    cfg["rollout"]["n"] = 2
    cfg["train"].update(max_steps=1, save_every=1)
    CohortTrainer(cfg).train()
    assert export([str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    card = (tmp_path / "out" / "q" / "README.md").read_text()
    reward = next(line for line in card.splitlines() if line.startswith("- **Reward**"))
    assert "`gt`" in reward and "gold answers" in reward
    assert "no gold labels" not in card and "label-free" not in card


@pytest.mark.parametrize("mode", get_args(RewardMode))
def test_every_reward_mode_is_described_and_only_gt_reads_labels(mode):
    line = reward_line({"mode": mode, "custom": "reward_fixtures:constant"}, [])
    assert line.startswith(f"`{mode}`") and "`reward_fixtures:constant`" in line
    assert ("gold answers" in line) == (mode == "gt") and ("no gold labels" in line) == (mode != "gt")


def test_the_cards_header_names_the_hub_base_an_adapters_library_and_the_newest_evaluation(tmp_path):
    """card_data on a run's record alone: an adapter export is peft's; each benchmark's result is the member's
    newest row up to the checkpoint's step; the Hub id of the base, written or from the Hub's cache."""
    checkpoint = tmp_path / "run" / "checkpoints" / "step-3"
    checkpoint.mkdir(parents=True)
    rows = [("q", 1, "easyvqa", 0.25), ("q", 3, "easyvqa", 0.5), ("l", 3, "easyvqa", 0.75), ("q", 5, "easyvqa", 1.0)]
    rows = [{"member": m, "step": s, "benchmark": b, "accuracy": a, "n": 4} for m, s, b, a in rows]
    (tmp_path / "run" / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = CheckpointRun({"reward": {"mode": "gt"}}, None, None)
    mine = {"id": "q", "model": "Qwen/Qwen2-VL-2B-Instruct"}
    card = ModelCard(f"---\n{card_data(checkpoint, run, mine, 'vision', adapter=True).to_yaml()}\n---\n")
    card.save(tmp_path / "README.md")
    header = metadata_load(tmp_path / "README.md")
    assert (header["base_model"], header["library_name"]) == ("Qwen/Qwen2-VL-2B-Instruct", "peft")
    assert header["tags"] == ["co-rl", "grpo"]  # gold answers: not label-free
    results = header["model-index"][0]["results"]
    assert [(r["dataset"]["name"], r["metrics"][0]["value"]) for r in results] == [("easyvqa", 0.5)]
    cache = "/home/u/.cache/huggingface/hub/models--Qwen--Qwen3-4B/snapshots/0123abc"
    assert (hub_base(cache), hub_base("/data/models/qwen3"), hub_base("models/qwen3/")) == ("Qwen/Qwen3-4B", None, None)
