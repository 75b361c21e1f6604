"""The model card (README.md) and prompt_format.json `corl export` writes into each exported member: how it was
trained (base model, cohort and peers, reward, steps, data), its evaluations in the run, and the exact prompt
format training used, so that users ask it the same way (`corl eval` reads prompt_format.json back). The card
is huggingface_hub's ModelCard, its metadata header a ModelCardData (`card_data`), so an upload shows on the Hub
with its base model, library, pipeline and evaluation results.

Everything comes from the exported checkpoint's own record (`checkpoint_run`): the config saved with that step
(a resume may have changed the prompt format since: the run's config.yaml is the latest launch's), the reward
functions the run called (the API's cannot be written to YAML) and the data's fingerprint. A checkpoint written
before checkpoints kept their config falls back to the run's config.yaml.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, ModelCard, ModelCardData

from vlm_corl.config import MemberConfig
from vlm_corl.config.schema import PEER_MODES
from vlm_corl.members.member import member_family
from vlm_corl.members.prompt_format import PROMPT_FORMAT, prompt_format
from vlm_corl.members.render import PROMPT_STYLES

# What each reward mode rewarded a member for (`reward_line`); a mode registered by a user's code has none.
REWARD_SOURCES = {
    "ring": "agreement with the vote of the previous member in the ring (its peers' answers; no gold labels)",
    "peers": "agreement with the plurality of the other members' votes (no gold labels)",
    "soft": "the share of the other members whose vote equals its answer (no gold labels)",
    "peers_ema": "agreement with the plurality of the other members' EMA teachers' votes (no gold labels)",
    "gt": "agreement with the dataset's gold answers (GRPO on labels: the supervised reference)",
    "self_vote": "agreement with its own plurality vote (TTRL; no gold labels, no peers)",
    "self_certainty": "its own self-certainty, the mean per-token KL(uniform || p) (no gold labels, no peers)",
    "entropy": "minus its own mean per-token entropy (RENT; no gold labels, no peers)",
    "co_rewarding_1": "agreement with its own vote on the other wording of the question (Co-rewarding I; no gold "
    "labels)",
    "co_rewarding_2": "agreement with the vote of its EMA teacher, a slowly updated copy (Co-rewarding II; no gold "
    "labels)",
    "none": "only what the reward functions gave (no reward mode of its own; no gold labels: they never get them)",
}

PIPELINES = {"vision": "image-text-to-text", "text": "text-generation"}  # the Hub's task of a member's modality
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # ORG/NAME, as the Hub spells a model repository


@dataclass(frozen=True)
class CheckpointRun:
    """What a checkpoint records of the run that wrote it."""

    config: dict  # the config saved with the checkpoint (an old checkpoint: the run's config.yaml), as plain data
    reward_functions: list[dict] | None  # [{function, weight}] the run called; None: not recorded
    data: dict | None  # the training data's fingerprint (vlm_corl.training.run.checkpoint.data_fingerprint)


def checkpoint_run(checkpoint: Path) -> CheckpointRun:
    """The record of the run that wrote `checkpoint` (RUN/checkpoints/step-N): its cohort state's config, reward
    functions and data; the run's config.yaml ({} when absent) for a checkpoint that kept no config."""
    from vlm_corl.training.run.checkpoint import load_cohort_state

    state = load_cohort_state(checkpoint)
    cfg = state.get("config")
    if cfg is None:
        path = checkpoint.parent.parent / "config.yaml"
        cfg = (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}
    return CheckpointRun(cfg, state.get("reward_functions"), state.get("data"))


def write_card(checkpoint: Path, member_id: str, out: Path) -> None:
    """README.md and prompt_format.json into `out` (the exported member `member_id` of `checkpoint`)."""
    run = checkpoint_run(checkpoint)
    members = run.config.get("members") or []
    mine = next((m for m in members if m.get("id") == member_id), {"id": member_id})
    family = member_family(
        MemberConfig(id=member_id, model=str(checkpoint / member_id), family=mine.get("family")),
        checkpoint / member_id,
    )
    # the variables its template was rendered with: the family's defaults, updated by the member's (Member)
    kwargs = {**dict(family.chat_template_kwargs), **(mine.get("chat_template_kwargs") or {})}
    fmt = prompt_format(mine.get("prompt_style") or family.prompt_style, mine.get("system_prompt"), kwargs or None)
    (out / PROMPT_FORMAT).write_text(json.dumps(fmt, indent=2) + "\n")
    header = card_data(checkpoint, run, mine, family.modality, adapter=(out / "adapter_config.json").is_file())
    card = ModelCard(f"---\n{header.to_yaml()}\n---\n\n{card_text(checkpoint, run, mine, fmt, family.modality)}")
    (out / "README.md").write_text(str(card))


def card_data(checkpoint: Path, run: CheckpointRun, mine: dict, modality: str, adapter: bool) -> ModelCardData:
    """The card's metadata header, as the Hub reads it: the base model (`hub_base`), the library that loads the
    export (peft for an adapter), the pipeline of its modality, the tags, and the run's evaluations of this member
    at the newest step up to this checkpoint, one result per benchmark."""
    member_id, step = mine["id"], _step(checkpoint)
    mode = (run.config.get("reward") or {}).get("mode", "ring")
    task = PIPELINES[modality]
    rows = [r for r in _eval_rows(checkpoint.parent.parent, member_id, step) if r.get("accuracy") is not None]
    newest = {r["benchmark"]: r for r in sorted(rows, key=lambda r: r["step"])}  # the last row of each wins
    results = [
        EvalResult(task_type=task, dataset_type=name, dataset_name=name, metric_type="accuracy",
                   metric_value=r["accuracy"], metric_name=f"accuracy (n={r.get('n')}, step {r['step']})")
        for name, r in newest.items()
    ]  # fmt: skip
    return ModelCardData(
        model_name=member_id,
        base_model=hub_base(str(mine.get("model", ""))),
        library_name="peft" if adapter else "transformers",
        pipeline_tag=task,
        tags=["co-rl", "grpo", *([] if mode in ("gt", "none") else ["label-free-rl"])],
        eval_results=results or None,
    )


def hub_base(model: str) -> str | None:
    """The base model's Hub id: the model as written when it is ORG/NAME (a folder named as its Hub repo, as
    `huggingface-cli download ORG/NAME --local-dir ORG/NAME` makes), or the ORG/NAME of a folder of the Hub's
    cache (.../models--ORG--NAME/snapshots/REV); None for any other path (the Hub would link it to no model)."""
    cached = re.search(r"models--([\w.-]+)--([\w.-]+)/snapshots/", model)
    if cached:
        return f"{cached[1]}/{cached[2]}"
    return model if HUB_ID.fullmatch(model) else None


def _step(checkpoint: Path) -> int:
    step = checkpoint.name.removeprefix("step-")
    return int(step) if step.isdigit() else 0


def _eval_rows(run_dir: Path, member_id: str, step: int) -> list[dict]:
    """The member's rows of the run's eval.jsonl up to `step` (this checkpoint's)."""
    path = run_dir / "eval.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    return [r for r in rows if r.get("member") == member_id and r.get("step", 0) <= step]


def _evaluations(run_dir: Path, member_id: str, step: int) -> list[str]:
    rows = _eval_rows(run_dir, member_id, step)
    if not rows:
        return ["No in-loop evaluation was run up to this step (eval.every: 0, or none due yet)."]
    lines = ["| benchmark | step | score | accuracy | n |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.get('benchmark')} | {r['step']} | {r.get('score')} | {r.get('accuracy')} | {r.get('n')} |")
    return lines


def reward_line(reward: dict, functions: list[dict] | None) -> str:
    """The card's reward: the mode, what it rewarded the member for, the reward functions added (the run's
    recorded `functions`, else reward.custom's names) and the format reward."""
    mode = reward.get("mode", "ring")
    custom = reward.get("custom")
    if functions is None or (not functions and custom):  # not recorded: the config's names and weights
        names = [custom] if isinstance(custom, str) else list(custom or [])
        weights = reward.get("weights") or [1.0] * len(names)
        functions = [{"function": n, "weight": w} for n, w in zip(names, weights)]
    line = f"`{mode}`: " + REWARD_SOURCES.get(mode, "a reward mode registered by the run's own code")
    if functions:
        named = ", ".join(f"`{f['function']}` (weight {f['weight']})" for f in functions)
        line += f"; {'reward functions' if mode == 'none' else 'plus the reward functions'} {named}"
    elif mode == "none":
        line += "; the reward functions were given to CohortTrainer and not recorded in this checkpoint"
    if reward.get("format_weight"):
        line += f"; plus a format reward (weight {reward['format_weight']})"
    return line


def _usage(fmt: dict, modality: str) -> list[str]:
    """A transformers snippet that asks the model as training did: a vision member with its image (processor),
    a text member in text (tokenizer), both with the system prompt and template variables it trained with."""
    kwargs = fmt["chat_template_kwargs"] or {}
    other = {k: v for k, v in kwargs.items() if not k.isidentifier()}  # not a keyword: passed as **{...}
    args = "".join(f", {k}={v!r}" for k, v in kwargs.items() if k not in other) + (f", **{other!r}" if other else "")
    system = fmt["system_prompt"]
    if modality == "vision":
        question = PROMPT_STYLES[fmt["prompt_style"]].format(question="What shape is in the image?")
        user = f'[{{"type": "image"}}, {{"type": "text", "text": {json.dumps(question)}}}]'
        system_turn = f'[{{"type": "text", "text": {json.dumps(system)}}}]' if system else None
        templater, auto = "processor", "AutoProcessor"
    else:
        question = PROMPT_STYLES[fmt["prompt_style"]].format(question="What is 7 * 6?")
        user, system_turn = json.dumps(question), json.dumps(system) if system else None
        templater, auto = "tokenizer", "AutoTokenizer"
    return [
        "```python",
        f"from transformers import {auto}",
        "",
        f'{templater} = {auto}.from_pretrained("THIS_FOLDER")',
        "messages = [",
        *([f'    {{"role": "system", "content": {system_turn}}},'] if system_turn else []),
        f'    {{"role": "user", "content": {user}}},',
        "]",
        f"text = {templater}.apply_chat_template(messages, tokenize=False, add_generation_prompt=True{args})",
        "```",
    ]


def card_text(checkpoint: Path, run: CheckpointRun, mine: dict, fmt: dict, modality: str) -> str:
    """The card's Markdown (`modality`: the member's family's, "vision" or "text")."""
    cfg, run_dir, member_id = run.config, checkpoint.parent.parent, mine["id"]
    step = checkpoint.name.removeprefix("step-")
    reward = cfg.get("reward") or {}
    mode = reward.get("mode", "ring")
    others = [f"`{m.get('id')}` ({m.get('model')})" for m in cfg.get("members") or [] if m.get("id") != member_id]
    beside = "peers" if mode in PEER_MODES else "other members (trained beside it, not its reward)"
    data = (cfg.get("data") or {}).get("train") or {}
    fingerprint = f", content sha256 `{run.data['sha256'][:16]}` ({run.data['examples']} examples)" if run.data else ""
    if mode in PEER_MODES:
        kind = "label-free reinforcement learning of a model cohort"
    else:
        kinds = {"gt": "GRPO on gold answers, the supervised reference", "none": "RL with reward functions"}
        kind = kinds.get(mode, f"label-free reinforcement learning, the `{mode}` baseline")
    lines = [
        f"# {member_id}: trained with the Co-RL cohort trainer ({kind})",
        "",
        f"- **Base model**: `{mine.get('model', '?')}`",
        f"- **Cohort**: `{cfg.get('name', run_dir.name)}`; {beside}: {', '.join(others) or 'none'}",
        f"- **Reward**: {reward_line(reward, run.reward_functions)}",
        f"- **Steps**: {step} (of train.max_steps {((cfg.get('train') or {}).get('max_steps'))})",
        f"- **Training data**: loader `{data.get('loader')}`, path `{data.get('path')}`, split `{data.get('split')}`, "
        f"skip {data.get('skip', 0)}, limit {data.get('limit')}{fingerprint}",
        f"- **Run**: `{run_dir}`, checkpoint `{checkpoint.name}`",
        "",
        "## Evaluation in the run",
        "",
        *_evaluations(run_dir, member_id, _step(checkpoint)),
        "",
        "## Prompt format (ask it the way it was trained)",
        "",
        "Each question was followed by this instruction (`{question}` is the question):",
        "",
        "```text",
        fmt["instruction"],
        "```",
        "",
        f"- system prompt: {json.dumps(fmt['system_prompt'])}",
        f"- chat template kwargs: {json.dumps(fmt['chat_template_kwargs'])}",
        "",
        f"The same is in `{PROMPT_FORMAT}`; `corl eval --models THIS_FOLDER` reads it and asks the model the same "
        "way. With transformers, put the instruction in the user turn"
        + (" after the image:" if modality == "vision" else ":"),
        "",
        *_usage(fmt, modality),
        "",
        "Asked without the instruction (or with other template variables) it may answer off-format.",
        "",
    ]
    return "\n".join(lines)
