"""When each config field applies: one table beside the schema (`RULES`), read by `loading.config_warnings`.

A field that does something only under some other setting (`algo.clip_low` only under `policy_loss: grpo`, a
round limit only with its switch, vLLM's settings only with a member on vLLM) has a `Rule`: a pure predicate of
the config saying whether it applies, the config as it is when it does not, the setting that would make it apply,
and what the run does instead. A field set to a non-default value whose rule does not hold gets one warning at
start and in `corl config`; config.yaml keeps what the user wrote. Every other field is in `ALWAYS` (it applies in
every config) or `REFUSED` (validate refuses every config where it would not apply); tests/test_config_applies.py
checks that each schema field is in exactly one of the three and each rule warns where it should, and only there.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from vlm_corl.config.engine_layout import member_engine
from vlm_corl.config.parse import field_default, flow_yaml
from vlm_corl.config.schema import TEACHER_MODES, TWO_VIEW_MODES, CohortConfig, MemberConfig, custom_rewards


@dataclass(frozen=True)
class Rule:
    """When `field` applies. `field` is dotted (`algo.clip_low`); a member's field is `members[].NAME`, and its
    predicate also gets the member. `under`, `needs` and `instead` are format strings over `cfg` (and `m`, `i`
    for a member's field); `instead` may be a function of the config. `off`: values that ask for what the run
    does anyway where the rule fails (never warned)."""

    field: str
    applies: Callable[..., bool]
    under: str  # the config as it is when the field does not apply, e.g. "under algo.policy_loss={cfg.algo...}"
    needs: str  # the setting that would make it apply
    instead: str | Callable[[CohortConfig], str]  # what the run does instead
    off: tuple = ()


# What each objective bounds its update with: said where another objective's field does not apply.
OBJECTIVE_BOUNDS = {
    "grpo": "grpo clips each token's ratio at 1 - algo.clip_low and 1 + algo.clip_high",
    "gspo": "gspo clips each sequence's ratio with algo.gspo_clip_low/gspo_clip_high",
    "cispo": "cispo caps the importance weight with algo.cispo_max_weight",
    "sapo": "sapo gates the token ratio with algo.sapo_tau_pos/sapo_tau_neg",
}


def _objective(cfg: CohortConfig) -> str:
    return OBJECTIVE_BOUNDS[cfg.algo.policy_loss]


def on_vllm(cfg: CohortConfig) -> list[MemberConfig]:
    """The members whose rollout engine resolves to vLLM (members[i].engine, else rollout.engine); their EMA
    teachers follow them."""
    return [m for m in cfg.members if member_engine(cfg, m) == "vllm"]


def _sleeps_at_level(cfg: CohortConfig) -> bool:
    """Whether some engine sleeps at rollout.vllm.sleep_level: a trained member's on vLLM under sleep mode that
    holds its full weights (a LoRA member serving its adapter, frozen peers and EMA teachers sleep at 1)."""
    adapter = cfg.rollout.vllm.lora_sync == "adapter"
    full = [m for m in on_vllm(cfg) if m.trainable and not (m.lora is not None and adapter)]
    return cfg.rollout.vllm.enable_sleep_mode and bool(full)


def _zero3(cfg: CohortConfig) -> bool:
    """Whether train.deepspeed asks for ZeRO stage 3 (validate has read the file already)."""
    if cfg.train.deepspeed is None:
        return False
    from vlm_corl.members.deepspeed_update import zero_stage  # torch: only where a DeepSpeed config is given

    return zero_stage(cfg.train.deepspeed) == 3


def _checkpoints(cfg: CohortConfig) -> bool:
    return cfg.train.save_every > 0 or cfg.train.save_last


def renders_paraphrases(mode: str, views: Iterable[str]) -> bool:
    """Whether some slot of a cohort renders a paraphrase view: a member's own view (`views`: the members'), or
    the second wording of a two-view reward (reward.mode `mode`)."""
    return mode in TWO_VIEW_MODES or any(view != "original" for view in views)


def _two_wordings(cfg: CohortConfig) -> bool:
    return renders_paraphrases(cfg.reward.mode, (m.view for m in cfg.members))


_VLLM = ("with every member on the hf engine", "rollout.engine=vllm or a member's engine: vllm")
_NO_VLLM = "the HF engine rolls out every member"
_EVAL = ("with eval.every=0", "eval.every > 0", "the run never evaluates in the loop")


def _objective_rule(field: str, loss: str) -> Rule:
    """The rule of a field that bounds one objective's update (algo.policy_loss: `loss`)."""
    under = "under algo.policy_loss={cfg.algo.policy_loss}"
    return Rule(field, lambda c: c.algo.policy_loss == loss, under, f"algo.policy_loss={loss}", _objective)


RULES: tuple[Rule, ...] = (
    *(_objective_rule(f"algo.{name}", "grpo") for name in ("clip_low", "clip_high")),
    *(_objective_rule(f"algo.{name}", "gspo") for name in ("gspo_clip_low", "gspo_clip_high")),
    _objective_rule("algo.cispo_max_weight", "cispo"),
    *(_objective_rule(f"algo.{name}", "sapo") for name in ("sapo_tau_pos", "sapo_tau_neg")),
    Rule("algo.kl_estimator", lambda c: c.algo.kl_beta > 0, "with algo.kl_beta=0", "algo.kl_beta > 0",
         "the loss has no KL term and no reference model is loaded"),
    Rule("algo.drgrpo_norm", lambda c: c.algo.loss_agg == "drgrpo", "under algo.loss_agg={cfg.algo.loss_agg}",
         "algo.loss_agg=drgrpo", "{cfg.algo.loss_agg} normalises the loss by the tokens it sums, not a constant"),
    Rule("algo.adv_eps", lambda c: c.algo.scale_rewards != "none", "with algo.scale_rewards=none",
         "algo.scale_rewards=group or batch", "advantages are only centred: no std to add it to"),
    Rule("algo.resample_max_rounds", lambda c: c.algo.resample_zero_variance,
         "with algo.resample_zero_variance=false", "algo.resample_zero_variance=true",
         "no question is replaced: zero-variance groups train with zero advantage"),
    Rule("algo.overlong_penalty_factor", lambda c: c.algo.overlong_penalty > 0, "with algo.overlong_penalty=0",
         "algo.overlong_penalty > 0 (the window, in tokens)", "no overlong penalty is added to the reward", off=(0.0,)),
    Rule("algo.rollout_is_cap", lambda c: c.algo.rollout_is != "none", "with algo.rollout_is=none",
         "algo.rollout_is=token_truncated, token_mask, sequence_truncated or sequence_mask",
         "no importance weight corrects the loss"),
    Rule("algo.rollout_is_max_abs_dlogp", lambda c: c.algo.rollout_is != "none", "with algo.rollout_is=none",
         "algo.rollout_is (any correction)",
         "training has no rollout guard (corl preflight still reads it as its push check's limit)", off=(0.0,)),
    Rule("rollout.vllm.gpu_memory_utilization", lambda c: bool(on_vllm(c)), *_VLLM, _NO_VLLM),
    Rule("rollout.vllm.enforce_eager", lambda c: bool(on_vllm(c)), *_VLLM, _NO_VLLM),
    Rule("rollout.vllm.enable_sleep_mode", lambda c: bool(on_vllm(c)), *_VLLM, _NO_VLLM),
    Rule("rollout.vllm.kv_cache_memory_bytes", lambda c: bool(on_vllm(c)), *_VLLM, _NO_VLLM),
    Rule("rollout.vllm.sleep_level", _sleeps_at_level,
         "without sleep mode on a trained member's full-weight vLLM engine",
         "rollout.vllm.enable_sleep_mode=true with a trained member on vllm holding its full weights",
         "no engine sleeps at it (frozen peers, EMA teachers and adapter-serving engines sleep at 1)"),
    Rule("rollout.vllm.lora_sync", lambda c: any(m.lora is not None for m in on_vllm(c)),
         "without a LoRA member on the vllm engine", "members[i].lora on a member whose engine is vllm",
         "no vLLM engine follows a LoRA member"),
    Rule("rollout.hf_static_cache", lambda c: len(on_vllm(c)) < len(c.members),
         "with every member on the vllm engine", "a member on the hf engine (members[i].engine: hf)",
         "vLLM rolls out and evaluates every member (corl eval has its own --hf-static-cache)"),
    Rule("reward.teacher_decay_start", lambda c: c.reward.mode in TEACHER_MODES,
         "under reward.mode={cfg.reward.mode}", "reward.mode=co_rewarding_2 or peers_ema", "no EMA teacher is kept"),
    Rule("reward.teacher_decay_end", lambda c: c.reward.mode in TEACHER_MODES,
         "under reward.mode={cfg.reward.mode}", "reward.mode=co_rewarding_2 or peers_ema", "no EMA teacher is kept"),
    Rule("reward.weights", lambda c: bool(custom_rewards(c)), "without reward.custom",
         "reward.custom (module:function, one weight each)", "no reward function is added to the mode's reward"),
    Rule("reward.format_weight", lambda c: c.reward.mode not in ("self_certainty", "entropy", "none"),
         "under reward.mode={cfg.reward.mode}", "an answer-matching reward.mode (ring, peers, soft, gt, ...)",
         "{cfg.reward.mode}'s reward has no format term"),
    Rule("train.lr", lambda c: any(m.trainable and m.lr is None for m in c.members),
         "with every trained member setting its own members[i].lr", "members[i].lr=null on a trained member",
         "each member trains at its own lr"),
    Rule("train.gather_bucket_mb", _zero3, "without a ZeRO-3 train.deepspeed config",
         "train.deepspeed naming a config with zero_optimization.stage 3", "nothing is partitioned to gather"),
    Rule("train.async_checkpoint", lambda c: c.train.deepspeed is None,
         "under train.deepspeed={cfg.train.deepspeed}",
         "train.deepspeed=null", "DeepSpeed's engine writes its partitions itself, in the step", off=(False,)),
    Rule("train.keep_last", _checkpoints, "with train.save_every=0 and train.save_last=false",
         "train.save_every > 0 or train.save_last=true", "the run writes no checkpoint"),
    Rule("train.overwrite", lambda c: c.train.resume is not True, "with train.resume=true",
         "train.resume=false or auto", "the run continues its newest checkpoint (or stops if there is none)"),
    Rule("train.device_memory_gb", lambda c: c.train.check_memory != "off", "with train.check_memory=off",
         "train.check_memory=auto, error or warn", "no memory plan is made at start (corl plan still reads it)"),
    Rule("eval.benchmarks", lambda c: c.eval.every > 0, *_EVAL),
    Rule("eval.limit", lambda c: c.eval.every > 0, *_EVAL),
    Rule("eval.temperature", lambda c: c.eval.every > 0, *_EVAL),
    Rule("eval.max_new_tokens", lambda c: c.eval.every > 0, *_EVAL),
    Rule("eval.max_category_drop", lambda c: c.eval.every > 0, *_EVAL, off=(None,)),
    Rule("logging.samples_per_step", lambda c: c.logging.samples_every > 0, "with logging.samples_every=0",
         "logging.samples_every > 0", "no samples are written"),
    Rule("logging.category_window", lambda c: c.logging.category_key is not None,
         "with logging.category_key=null", "logging.category_key (auto or a metadata key)",
         "the run keeps no per-category metrics"),
    Rule("logging.tracker_timeout_s", lambda c: bool(c.logging.report_to), "with logging.report_to=[]",
         "a tracker in logging.report_to", "no tracker starts: metrics go to metrics.jsonl only"),
    Rule("data.paraphrases", _two_wordings, "with every member on view original",
         "a member's view: paraphrase:K (or reward.mode=co_rewarding_1)", "every member sees the original wording"),
    Rule("data.view_fallback", _two_wordings, "with every member on view original",
         "a member's view: paraphrase:K (or reward.mode=co_rewarding_1)", "every member sees the original wording"),
    Rule("members[].lr", lambda c, m: m.trainable, "on frozen member {m.id!r} (members[{i}].trainable=false)",
         "members[{i}].trainable=true", "a frozen peer never updates"),
)  # fmt: skip

# Fields that apply in every config: the switches the rules read, and what every run uses.
ALWAYS = frozenset(
    {"name", "output_dir", "seed", "members"}
    | {f"members[].{n}" for n in ("id", "model", "family", "view", "trainable", "prompt_style", "system_prompt")}
    | {f"members[].{n}" for n in ("seed", "dtype", "attn_implementation", "trust_remote_code", "engine")}
    | {"members[].chat_template_kwargs", "members[].ranks"}
    # LoRA's own fields apply wherever members[i].lora is given (the switch, refused on a frozen peer)
    | {f"members[].lora.{n}" for n in ("r", "alpha", "dropout", "target_modules", "vision")}
    | {f"data.train.{n}" for n in ("loader", "path", "split", "limit", "skip", "options")}
    | {f"data.{n}" for n in ("train", "batch_size", "shuffle", "seed", "max_image_pixels", "prompt_cache_mb")}
    | {f"rollout.{n}" for n in ("engine", "n", "temperature", "top_p", "top_k", "max_new_tokens")}
    | {f"rollout.{n}" for n in ("max_prompt_tokens", "dtype", "stop", "vllm")}
    # vote_threshold: the votes it gates are logged (agreement, unanimity) under every mode
    | {f"reward.{n}" for n in ("mode", "custom", "vote_threshold", "answer_style")}
    | {f"algo.{n}" for n in ("policy_loss", "kl_beta", "loss_agg", "scale_rewards", "filter_zero_variance")}
    | {f"algo.{n}" for n in ("resample_zero_variance", "overlong_penalty", "mask_truncated", "updates_per_batch")}
    | {"algo.rollout_is"}
    | {f"train.{n}" for n in ("max_steps", "min_lr_ratio", "warmup_ratio", "weight_decay", "adam_beta1")}
    | {f"train.{n}" for n in ("adam_beta2", "grad_clip", "micro_batch_size", "gradient_checkpointing")}
    | {f"train.{n}" for n in ("save_every", "save_last", "resume", "mixed_precision", "deepspeed")}
    | {f"train.{n}" for n in ("dist_timeout_s", "max_nonfinite_steps", "check_memory", "on_collapse")}
    | {"eval.every", "logging.report_to", "logging.samples_every", "logging.progress", "logging.log_every"}
    | {"logging.category_key"}
    | {"data", "rollout", "reward", "algo", "train", "eval", "logging"}  # the sections
)

# Fields validate refuses wherever they would not apply (no warning is ever needed): where they apply.
REFUSED = {
    "rollout.vllm.tensor_parallel_size": "1 only (other values are refused)",
    "eval.keep_best": "one of eval.benchmarks, with eval.every > 0 (refused otherwise)",
    "members[].lora": "members[i].trainable=true (refused on a frozen peer)",
}


def _value(obj: Any, dotted: str) -> tuple[Any, Any]:
    """(value, default) of the dotted field of a config section or member."""
    *parents, name = dotted.split(".")
    for part in parents:
        obj = getattr(obj, part)
    field = next(f for f in dataclasses.fields(obj) if f.name == name)
    return getattr(obj, name), field_default(field)


def _message(rule: Rule, path: str, value: Any, names: dict) -> str:
    instead = rule.instead(names["cfg"]) if callable(rule.instead) else rule.instead.format(**names)
    return (
        f"{path}={flow_yaml(value)} does not apply {rule.under.format(**names)}: {instead} "
        f"(set {rule.needs.format(**names)} to use it)"
    )


def _places(rule: Rule, cfg: CohortConfig) -> list[tuple[str, str, Any, tuple, dict]]:
    """Where `rule`'s field is in `cfg`: (dotted path, field name in its owner, owner, the predicate's arguments,
    the message's format names); a member's field once per member."""
    name = rule.field.removeprefix("members[].")
    if name == rule.field:
        return [(rule.field, rule.field, cfg, (cfg,), {"cfg": cfg})]
    return [
        (f"members[{i}].{name}", name, m, (cfg, m), {"cfg": cfg, "m": m, "i": i}) for i, m in enumerate(cfg.members)
    ]


def inapplicable(cfg: CohortConfig) -> list[tuple[str, str]]:
    """(field, warning) for every field set to a non-default value that does not apply in `cfg` (`RULES`), in
    the table's order."""
    found = []
    for rule in RULES:
        for path, name, owner, args, names in _places(rule, cfg):
            value, default = _value(owner, name)
            if value != default and value not in rule.off and not rule.applies(*args):
                found.append((path, _message(rule, path, value, names)))
    return found


def markdown_table() -> str:
    """The table docs/training.md holds (tests/test_config_applies.py checks it is there as printed)."""
    lines = ["| field | applies only with |", "|---|---|"]
    lines += [f"| `{r.field}` | {r.needs.replace('{i}', 'i')} |" for r in RULES]
    lines += [f"| `{field}` | {where} |" for field, where in REFUSED.items()]
    return "\n".join(lines)
