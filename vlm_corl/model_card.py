"""The model card (README.md) and prompt_format.json `corl export` writes into each exported member: how it was
trained (base model, cohort and peers, reward, steps, data), its evaluations in the run, and the exact prompt
format training used, so that users ask it the same way (`corl eval` reads prompt_format.json back)."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from vlm_corl.config import MemberConfig
from vlm_corl.members.member import member_family
from vlm_corl.members.prompt_format import PROMPT_FORMAT, prompt_format
from vlm_corl.members.render import PROMPT_STYLES


def run_config(checkpoint: Path) -> dict:
    """The run's config.yaml as plain data (RUN/checkpoints/step-N -> RUN/config.yaml); {} when it is absent."""
    path = checkpoint.parent.parent / "config.yaml"
    return (yaml.safe_load(path.read_text()) or {}) if path.is_file() else {}


def write_card(checkpoint: Path, member_id: str, out: Path) -> None:
    """README.md and prompt_format.json into `out` (the exported member `member_id` of `checkpoint`)."""
    cfg = run_config(checkpoint)
    members = cfg.get("members") or []
    mine = next((m for m in members if m.get("id") == member_id), {"id": member_id})
    style = (
        mine.get("prompt_style")
        or member_family(
            MemberConfig(id=member_id, model=str(checkpoint / member_id)), checkpoint / member_id
        ).prompt_style
    )
    fmt = prompt_format(style, mine.get("system_prompt"), mine.get("chat_template_kwargs"))
    (out / PROMPT_FORMAT).write_text(json.dumps(fmt, indent=2) + "\n")
    (out / "README.md").write_text(card_text(checkpoint, cfg, mine, members, fmt))


def _evaluations(run_dir: Path, member_id: str) -> list[str]:
    path = run_dir / "eval.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    rows = [r for r in rows if r.get("member") == member_id]
    if not rows:
        return ["No in-loop evaluation was run (eval.every: 0)."]
    lines = ["| benchmark | step | score | accuracy | n |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.get('benchmark')} | {r['step']} | {r.get('score')} | {r.get('accuracy')} | {r.get('n')} |")
    return lines


def card_text(checkpoint: Path, cfg: dict, mine: dict, members: list, fmt: dict) -> str:
    """The card's Markdown."""
    run_dir, member_id = checkpoint.parent.parent, mine["id"]
    step = checkpoint.name.removeprefix("step-")
    peers = [f"`{m.get('id')}` ({m.get('model')})" for m in members if m.get("id") != member_id]
    reward = cfg.get("reward") or {}
    custom = reward.get("custom")
    data = (cfg.get("data") or {}).get("train") or {}
    example = PROMPT_STYLES[fmt["prompt_style"]].format(question="What shape is in the image?")
    lines = [
        "---",
        "tags: [co-rl, label-free-rl, grpo]",
        "---",
        "",
        f"# {member_id}: trained with Co-RL (label-free reinforcement learning of a model cohort)",
        "",
        f"- **Base model**: `{mine.get('model', '?')}`",
        f"- **Cohort**: `{cfg.get('name', run_dir.name)}`; peers: {', '.join(peers) or 'none'}",
        f"- **Reward**: `{reward.get('mode', 'ring')}`"
        + (f" + reward functions {custom}" if custom else "")
        + " (rewarded by agreement with the peers' answers; no gold labels)",
        f"- **Steps**: {step} (of train.max_steps {((cfg.get('train') or {}).get('max_steps'))})",
        f"- **Training data**: loader `{data.get('loader')}`, path `{data.get('path')}`, split `{data.get('split')}`, "
        f"skip {data.get('skip', 0)}, limit {data.get('limit')}",
        f"- **Run**: `{run_dir}`, checkpoint `{checkpoint.name}`",
        "",
        "## Evaluation in the run",
        "",
        *_evaluations(run_dir, member_id),
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
        "way. With transformers, put the instruction in the user turn:",
        "",
        "```python",
        "messages = [{",
        '    "role": "user",',
        f'    "content": [{{"type": "image"}}, {{"type": "text", "text": {json.dumps(example)}}}],',
        "}]",
        "text = processor.apply_chat_template(messages, add_generation_prompt=True"
        + (f", **{fmt['chat_template_kwargs']!r}" if fmt["chat_template_kwargs"] else "")
        + ")",
        "```",
        "",
        "Asked without the instruction it may answer off-format.",
        "",
    ]
    return "\n".join(lines)
