"""Which config fields may change when a run resumes: one row per field of the schema (a test fails on a field
without one), the table in docs/reliability.md printed from here (`python -m vlm_corl.config.resume_rules`).

A field may not change when its new value would make the saved state mean something else (other weights,
another optimizer, a data order that no longer matches the sampler's position) or would be ignored because the
checkpoint restores the old one (the learning rate and Adam's hyperparameters live in the optimizer and schedule
states). Every checkpoint keeps the config it was written under; `changed_at_resume` compares the two. The
training data itself is compared by content, not by these fields (`vlm_corl.training.run.checkpoint.data_fingerprint`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

WEIGHTS = "the checkpoint's weights were trained as this"
OPTIMIZER = (
    "the optimizer and schedule states restored from the checkpoint hold the old value: the new one would be ignored"
)
DATA = "the sampler's saved position indexes this data order: another would mix or skip examples"
LAYOUT = "the checkpoint holds state for this layout"


@dataclass(frozen=True)
class Rule:
    """Whether a field may change at resume, and why (`why` is shown when a forbidden change is refused)."""

    may_change: bool
    why: str


def _free(why: str) -> Rule:
    return Rule(True, why)


def _fixed(why: str) -> Rule:
    return Rule(False, why)


RULES: dict[str, Rule] = {
    "name": _free("a label"),
    "output_dir": _free("where the run is (a moved run directory resumes)"),
    "seed": _fixed("the random streams restored from the checkpoint were seeded with it"),
    "members": _fixed("the cohort's members and their order (the ring's labels follow it) are the checkpoint's"),
    "members[].id": _fixed("the checkpoint's directories are named by member id"),
    "members[].model": _fixed(WEIGHTS + ": another base model would load the checkpoint into other weights"),
    "members[].family": _fixed(WEIGHTS),
    "members[].view": _free("the wording a member sees"),
    "members[].trainable": _fixed("a frozen member has no optimizer state; a trained one needs its own"),
    "members[].prompt_style": _free("prompting"),
    "members[].system_prompt": _free("prompting"),
    "members[].seed": _fixed("the member's sampling streams continue from it"),
    "members[].lr": _fixed(OPTIMIZER),
    "members[].dtype": _fixed(WEIGHTS + " (the saved weights' dtype and the masters' meaning)"),
    "members[].attn_implementation": _free("a kernel choice"),
    "members[].trust_remote_code": _free("a loading permission"),
    "members[].engine": _free("the rollout engine samples from the same weights"),
    "members[].chat_template_kwargs": _free("prompting"),
    "members[].lora": _fixed("the checkpoint holds an adapter of this rank, alpha and targets (or whole weights)"),
    "members[].ranks": _free("plain members save whole states; under train.deepspeed the group size is fixed"),
    "data.train.loader": _fixed(DATA),
    "data.train.path": _free(
        "the data is checked by its content, not its path (RUN/data_fingerprint.json): another path to the same "
        "bytes resumes, other bytes are refused"
    ),
    "data.train.split": _fixed(DATA),
    "data.train.limit": _fixed(DATA),
    "data.train.skip": _fixed(DATA),
    "data.train.options": _fixed(DATA),
    "data.batch_size": _fixed(DATA),
    "data.shuffle": _fixed(DATA),
    "data.seed": _fixed(DATA),
    "data.max_image_pixels": _free("how images are rendered"),
    "data.prompt_cache_mb": _free("a cache"),
    "data.paraphrases": _free("the wordings a member may see"),
    "data.view_fallback": _free("the wordings a member may see"),
    "rollout.engine": _free("the rollout engine samples from the same weights"),
    "rollout.n": _free("sampling"),
    "rollout.temperature": _free("sampling"),
    "rollout.top_p": _free("sampling"),
    "rollout.top_k": _free("sampling"),
    "rollout.max_new_tokens": _free("sampling"),
    "rollout.max_prompt_tokens": _free("sampling"),
    "rollout.dtype": _free("compute precision"),
    "rollout.stop": _free("sampling"),
    "rollout.hf_static_cache": _free("engine kernels: the same tokens and log-probs"),
    "rollout.vllm.gpu_memory_utilization": _free("engine memory"),
    "rollout.vllm.tensor_parallel_size": _free("engine layout"),
    "rollout.vllm.enforce_eager": _free("engine kernels"),
    "rollout.vllm.enable_sleep_mode": _free("engine memory"),
    "rollout.vllm.sleep_level": _free("engine memory"),
    "rollout.vllm.kv_cache_memory_bytes": _free("engine memory"),
    "rollout.vllm.lora_sync": _free("how the engine gets the weights"),
    "reward.mode": _fixed(LAYOUT + ": EMA teachers (co_rewarding_2, peers_ema) and the slots a mode rolls out"),
    "reward.custom": _free("the reward (a change of method, logged in config.yaml)"),
    "reward.weights": _free("the reward (a change of method, logged in config.yaml)"),
    "reward.vote_threshold": _free("the reward"),
    "reward.format_weight": _free("the reward"),
    "reward.answer_style": _free("the reward"),
    "reward.teacher_decay_start": _free("the EMA schedule, read at every step"),
    "reward.teacher_decay_end": _free("the EMA schedule, read at every step"),
    "algo.policy_loss": _free("the loss (a change of method, logged in config.yaml)"),
    "algo.clip_low": _free("the loss"),
    "algo.clip_high": _free("the loss"),
    "algo.gspo_clip_low": _free("the loss"),
    "algo.gspo_clip_high": _free("the loss"),
    "algo.cispo_max_weight": _free("the loss"),
    "algo.sapo_tau_pos": _free("the loss"),
    "algo.sapo_tau_neg": _free("the loss"),
    "algo.kl_beta": _fixed("the KL reference exists only when kl_beta > 0: it would start from the resumed weights"),
    "algo.kl_estimator": _free("the loss"),
    "algo.loss_agg": _free("the loss"),
    "algo.drgrpo_norm": _free("the loss"),
    "algo.scale_rewards": _free("the advantages"),
    "algo.adv_eps": _free("the advantages"),
    "algo.filter_zero_variance": _free("which groups train"),
    "algo.resample_zero_variance": _free("which questions train (the data stream goes on from the checkpoint)"),
    "algo.resample_max_rounds": _free("which questions train"),
    "algo.overlong_penalty": _free("the reward"),
    "algo.overlong_penalty_factor": _free("the reward"),
    "algo.mask_truncated": _free("which responses train"),
    "algo.updates_per_batch": _free("optimizer steps per batch (the schedule is recomputed)"),
    "algo.rollout_is": _free("the off-policy correction"),
    "algo.rollout_is_cap": _free("the off-policy correction"),
    "algo.rollout_is_max_abs_dlogp": _free("a guard"),
    "train.max_steps": _free("extend or shorten the run (the schedule is recomputed)"),
    "train.lr": _fixed(OPTIMIZER),
    "train.min_lr_ratio": _free("the schedule's shape, recomputed from the config"),
    "train.warmup_ratio": _free("the schedule's shape, recomputed from the config"),
    "train.weight_decay": _fixed(OPTIMIZER),
    "train.adam_beta1": _fixed(OPTIMIZER),
    "train.adam_beta2": _fixed(OPTIMIZER),
    "train.grad_clip": _free("clipping"),
    "train.micro_batch_size": _free("memory (the same gradient)"),
    "train.gradient_checkpointing": _free("memory (the same gradient)"),
    "train.save_every": _free("checkpoints"),
    "train.save_last": _free("checkpoints"),
    "train.keep_last": _free("checkpoints"),
    "train.async_checkpoint": _free("how checkpoints are written"),
    "train.resume": _free("resuming"),
    "train.overwrite": _free("resuming"),
    "train.mixed_precision": _free("compute precision (fp32 masters either way)"),
    "train.deepspeed": _fixed(LAYOUT + ": DeepSpeed keeps one optimizer-state file per rank of the member"),
    "train.gather_bucket_mb": _free("memory"),
    "train.dist_timeout_s": _free("a timeout"),
    "train.max_nonfinite_steps": _free("a guard"),
    "train.check_memory": _free("a check"),
    "train.device_memory_gb": _free("a check"),
    "train.on_collapse": _free("a guard"),
    "eval": _free("evaluation"),
    "logging": _free("logging"),
}
# Sections whose every field may change share their section's row: a new field there needs none.
FREE_SECTIONS = ("eval.", "logging.")


def rule_for(path: str) -> Rule | None:
    """The rule of a schema path (`members[].lora`, `train.lr`); fields of `FREE_SECTIONS` share theirs."""
    if path in RULES:
        return RULES[path]
    section = next((s for s in FREE_SECTIONS if path.startswith(s)), None)
    return RULES[section[:-1]] if section else None


def _get(raw: dict, path: str) -> Any:
    for part in path.split("."):
        raw = raw.get(part) if isinstance(raw, dict) else None
    return raw


def changed_at_resume(saved: dict, new: dict) -> list[tuple[str, Any, Any, str]]:
    """(field as the new config names it, checkpoint's value, new value, why) for every field that changed
    though its rule forbids it; `saved` and `new` are configs as plain data (`config_to_dict`)."""
    found = []
    if new.get("train", {}).get("deepspeed"):
        rules = {**RULES, "members[].ranks": _fixed(LAYOUT + ": DeepSpeed's state files are per rank")}
    else:
        rules = RULES
    old_ids, new_ids = [m["id"] for m in saved.get("members", [])], [m["id"] for m in new.get("members", [])]
    if old_ids != new_ids:
        return [("members", old_ids, new_ids, rules["members"].why)]
    for path, rule in rules.items():
        if rule.may_change or path == "members":
            continue
        if path.startswith("members[]."):
            key = path.split(".", 1)[1]
            for i, (old, now) in enumerate(zip(saved["members"], new["members"])):
                if old.get(key) != now.get(key):
                    found.append((f"members[{i}].{key}", old.get(key), now.get(key), rule.why))
        elif _get(saved, path) != _get(new, path):
            found.append((path, _get(saved, path), _get(new, path), rule.why))
    return found


def markdown_table() -> str:
    """The table docs/reliability.md holds (tests/test_resume_rules.py checks it is there as printed)."""
    lines = ["| field | may change at resume | why |", "|---|---|---|"]
    for path, rule in RULES.items():
        field = f"`{path}`" + (" (every field)" if f"{path}." in FREE_SECTIONS else "")
        lines.append(f"| {field} | {'yes' if rule.may_change else '**no**'} | {rule.why} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
