"""The cohort config schema: nested dataclasses holding every default, each field with a one-line doc.

Field metadata carries the doc (`help`) and declarative constraints that the generic parser in
`vlm_corl.config.parse` checks: ge/gt/le/lt (numeric bounds), pattern=(regex, what it means), min_items
(lists), why (said when a bound or length is violated). Checks across fields live in `loading.validate`.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field
from typing import Any, Literal

RewardMode = Literal[
    "ring",
    "peers",
    "soft",
    "peers_ema",
    "gt",
    "self_vote",
    "self_certainty",
    "entropy",
    "co_rewarding_1",
    "co_rewarding_2",
    "none",
]
PEER_MODES = ("ring", "peers", "soft", "peers_ema")  # label_n comes from the other members' votes
TWO_VIEW_MODES = ("co_rewarding_1",)  # one member rolls out twice: the original wording and its view
TEACHER_MODES = ("co_rewarding_2", "peers_ema")  # each trained member keeps an EMA teacher (a slowly updated copy)

# Qwen-VL reads one image token per 28x28 pixels: 1280 tokens at the image cap, which the prompt limit must hold
# with room for the text (InternVL's 12 tiles + thumbnail are 3,328 tokens).
MAX_IMAGE_PIXELS = 1280 * 28 * 28
MAX_PROMPT_TOKENS = 4096


def _f(help: str, default: Any = MISSING, *, factory: Any = MISSING, **constraint: Any) -> Any:
    """A dataclass field with its one-line doc and optional constraints (see the module docstring)."""
    return field(default=default, default_factory=factory, metadata={"help": help, **constraint})


@dataclass(kw_only=True)
class LoraConfig:
    """Low-rank adapters (PEFT LoRA) trained instead of the member's weights: the base stays frozen in its dtype,
    only the adapters train (fp32)."""

    r: int = _f("adapter rank", 16, ge=1)
    alpha: float = _f("scaling numerator: the adapter's update is scaled by alpha / r", 32.0, gt=0)
    dropout: float = _f(
        "dropout on the adapter's input during updates (0 keeps the update's log-probs those the rollout sampled)",
        0.0,
        ge=0,
        lt=1,
    )
    target_modules: list[str] | None = _f(
        "names (last part, e.g. q_proj) of the language model's linear layers that get adapters; null = its "
        "attention and MLP projections (q/k/v/o_proj, gate/up/down_proj); [] with vision: true = the vision "
        "tower alone",
        None,
    )
    vision: bool = _f("also adapt every linear layer of the vision tower (frozen otherwise)", False)


@dataclass(kw_only=True)
class MemberConfig:
    """One cohort member: a decoupled model with its own view, prompt, optimizer and ranks."""

    id: str = _f(
        "unique member name, used in logs and as its checkpoint directory name",
        pattern=(r"(?!\.\.?$)[A-Za-z0-9_.-]+", "letters, digits, '_', '.', '-' (but not '.' or '..')"),
    )
    model: str = _f(
        "local Hugging Face model directory with a config.json (a relative path: beside the cohort file where it "
        "exists there, else from the working directory)"
    )
    family: str | None = _f(
        "model family registry name, or generic (any architecture the Auto classes load, served from its own "
        "processor and chat template); null = detect from config.json model_type",
        None,
    )
    view: str = _f(
        "question wording this member sees: original | paraphrase:K (K >= 1)",
        "original",
        pattern=(r"original|paraphrase:[1-9][0-9]*", "original or paraphrase:K with K >= 1, e.g. paraphrase:1"),
    )
    trainable: bool = _f("false = frozen peer: rolls out and votes, never updates", True)
    prompt_style: Literal["boxed", "answer_tags"] | None = _f(
        "answer format asked for in the prompt: boxed | answer_tags; null = the family's default", None
    )
    system_prompt: str | None = _f("system prompt; null = the prompt style's default", None)
    seed: int = _f("offset added to the run seed for this member's sampling", 0, ge=0)
    lr: float | None = _f("learning rate for this member; null = train.lr", None, gt=0)
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = _f("weights dtype when loading", "auto")
    attn_implementation: str = _f("transformers attention implementation: sdpa, eager, flash_attention_2, ...", "sdpa")
    trust_remote_code: bool = _f("allow custom modelling code shipped with the checkpoint", False)
    engine: Literal["hf", "vllm"] | None = _f(
        "this member's rollout engine: hf | vllm; null = rollout.engine (Llama-3.2-Vision needs hf: vLLM dropped "
        "encoder-decoder models)",
        None,
    )
    chat_template_kwargs: dict[str, Any] | None = _f(
        "extra variables for the chat template, merged over the family's defaults key by key (Qwen3: "
        "enable_thinking false), e.g. {enable_thinking: true}",
        None,
    )
    lora: LoraConfig | None = _f(
        "train LoRA adapters instead of the whole model (checkpoints hold the adapter in PEFT's format; corl export "
        "--merge writes merged models); null = full fine-tuning",
        None,
    )
    ranks: list[int] | None = _f(
        "process ranks this member runs on (data-parallel over them); null = an even automatic split of the "
        "launched processes",
        None,
        min_items=1,
        why="a member needs at least one rank",
    )


@dataclass(kw_only=True)
class DatasetConfig:
    """Where examples come from."""

    loader: str = _f(
        "loader registry name or module:function",
        "easyvqa",
        pattern=(r"[A-Za-z0-9_.-]+(:[A-Za-z_][A-Za-z0-9_.]*)?", "a registry name or module:function"),
    )
    path: str | None = _f("file or directory the loader reads; null = the loader's default", None)
    split: str = _f("dataset split", "train")
    limit: int | None = _f("use at most this many examples; null = all", None, ge=1)
    skip: int = _f("examples skipped from the start (e.g. to keep a labelled slice disjoint)", 0, ge=0)
    options: dict[str, Any] = _f("loader-specific keyword arguments", factory=dict)


@dataclass(kw_only=True)
class DataConfig:
    """The training stream, shared in lockstep by every member."""

    train: DatasetConfig = _f("training examples (labels never reach a label-free reward)", factory=DatasetConfig)
    batch_size: int = _f("prompts per step; every member gets the same example ids", 64, ge=1)
    shuffle: bool = _f("shuffle the example order each epoch", True)
    seed: int = _f("the one data-order seed shared by all members", 0, ge=0)
    max_image_pixels: int = _f(
        "larger images are downscaled (aspect kept) to this many pixels (Qwen-VL: resized onto its 28-pixel grid "
        "by qwen-vl-utils, one image token per 28x28 pixels)",
        MAX_IMAGE_PIXELS,
        ge=1,
    )
    prompt_cache_mb: float = _f(
        "host memory each member's renderer keeps in rendered prompts (processor tensors: ~24 MB of fp32 pixels "
        "per Qwen2.5-VL image at the default cap), least recently used dropped first",
        4096.0,
        gt=0,
    )
    paraphrases: str | None = _f("path of a paraphrase cache aligned by example id; null = none", None)
    view_fallback: Literal["error", "original"] = _f("when an example lacks a member's view: error | original", "error")


@dataclass(kw_only=True)
class VllmConfig:
    """vLLM engine settings (used when rollout.engine=vllm)."""

    gpu_memory_utilization: float = _f(
        "share of GPU memory the vLLM engines of one process may take in all (split evenly among them)", 0.5, gt=0, le=1
    )
    tensor_parallel_size: int = _f("GPUs one vLLM engine spans; only 1 is supported (one engine per rank)", 1, ge=1)
    enforce_eager: bool = _f("disable CUDA graphs (faster start, slower decode)", False)
    enable_sleep_mode: bool = _f(
        "free vLLM's GPU memory during updates (CUDA only; one engine per process: vLLM allows one sleeping "
        "instance per process); trained members sleep at sleep_level, frozen peers and EMA teachers at 1",
        False,
    )
    sleep_level: int = _f(
        "sleep level of a fully trained member's engine: 2 (vLLM discards its weights; the sync pushes them anyway) "
        "| 1 (its weights kept in pinned host memory: for a family whose level-2 wake-up is incomplete); LoRA "
        "members serving adapters, frozen peers and EMA teachers always sleep at 1",
        2,
        ge=1,
        le=2,
        why="vLLM's sleep levels are 1 and 2",
    )
    kv_cache_memory_bytes: int | None = _f(
        "KV cache size in bytes (needed on CPU, where the share above is of RAM); null = use the share", None, ge=1
    )
    lora_sync: Literal["merged", "adapter"] = _f(
        "how a LoRA member's engine follows its updates: merged (the merged weights are pushed, one layer at a "
        "time) | adapter (only the adapter is written and served by vLLM's LoRA support: the base is loaded once; "
        "language-model adapters only, ranks up to 512)",
        "merged",
    )


@dataclass(kw_only=True)
class RolloutConfig:
    """Sampling of K responses per prompt per member."""

    engine: Literal["hf", "vllm"] = _f("rollout engine: hf (transformers generate) | vllm", "hf")
    hf_static_cache: Literal["auto", "on", "off"] = _f(
        "the HF engine's decoding steps over a static KV cache, captured as CUDA graphs on CUDA "
        "(members/static_decode.py; the same tokens and log-probs): auto (on CUDA) | on | off (today's loop)",
        "auto",
    )
    n: int = _f(
        "K samples per prompt (paper: 4 for VLMs, 8 for text)",
        4,
        ge=2,
        why="a group needs at least 2 samples for an advantage",
    )
    temperature: float = _f("sampling temperature", 1.0, gt=0, why="greedy rollouts make every group identical")
    top_p: float = _f("nucleus sampling mass", 1.0, gt=0, le=1)
    top_k: int = _f("top-k sampling; 0 = off", 0, ge=0)
    max_new_tokens: int = _f("longest response, in tokens", 256, ge=1)
    max_prompt_tokens: int = _f(
        "longest rendered prompt, in tokens (image tokens included); a longer example is skipped for every member "
        "and counted in the run log and summary.json",
        MAX_PROMPT_TOKENS,
        ge=1,
    )
    dtype: Literal["auto", "float32", "bfloat16"] = _f(
        "precision of rollouts and evaluation (HF engine: autocast over the fp32 masters; vLLM: the engine's "
        "weights, the masters cast on every sync): auto = bfloat16 on CUDA, the checkpoint's dtype elsewhere",
        "auto",
    )
    stop: list[str] = _f("extra stop strings", factory=list)
    vllm: VllmConfig = _f("vLLM engine settings", factory=VllmConfig)


@dataclass(kw_only=True)
class RewardConfig:
    """How each response is scored (docs/method.md)."""

    mode: RewardMode = _f(
        "reward: ring | peers | soft | peers_ema (Co-RL; peers_ema: the other members' EMA teachers vote) or a "
        "baseline; none = only the reward functions (reward.custom, CohortTrainer's reward_funcs)",
        "ring",
    )
    custom: str | list[str] | None = _f(
        "reward functions as module:function (one or a list), each fn(*, member, prompts, completions, answers, "
        "peer_answers, **columns) -> list[float | None], added to the mode's reward (docs/python-api.md)",
        None,
    )
    weights: list[float] | None = _f("weights of reward.custom's functions, in order; null = 1 each", None)
    vote_threshold: float = _f(
        "self-consistency tau: a member abstains when its plurality answer's share is below it", 0.0, ge=0, le=1
    )
    format_weight: float = _f("weight of the format reward added to the answer reward", 0.0, ge=0)
    answer_style: Literal["auto", "boxed", "answer_tags"] = _f(
        "answer extraction: auto (follow each member's prompt style) | boxed | answer_tags", "auto"
    )
    teacher_decay_start: float = _f(
        "co_rewarding_2, peers_ema: EMA teacher decay at step 0 (cosine schedule)", 0.99, gt=0, lt=1
    )
    teacher_decay_end: float = _f("co_rewarding_2, peers_ema: EMA teacher decay at the last step", 0.9999, gt=0, lt=1)


@dataclass(kw_only=True)
class AlgoConfig:
    """The GRPO objective (docs/method.md tables every objective and correction with its formula and source)."""

    policy_loss: Literal["grpo", "gspo", "cispo", "sapo"] = _f(
        "the policy-gradient objective: grpo (token ratio, PPO clip: clip_low/clip_high) | gspo (one "
        "length-normalised ratio per sequence, clipped per sequence: gspo_clip_low/gspo_clip_high) | cispo (the "
        "clipped importance weight, held constant, times the log-prob's gradient: no token dropped; "
        "cispo_max_weight) | sapo (a sigmoid gate of the token ratio instead of the clip: sapo_tau_pos/sapo_tau_neg)",
        "grpo",
    )
    clip_low: float = _f(
        "epsilon_low: ratio clipped below at 1 - clip_low (policy_loss grpo)",
        0.2,
        ge=0,
        lt=1,
        why="1 - clip_low must stay positive",
    )
    clip_high: float = _f("epsilon_high: ratio clipped above at 1 + clip_high (policy_loss grpo)", 0.2, ge=0)
    gspo_clip_low: float = _f(
        "policy_loss gspo: the sequence ratio clipped below at 1 - gspo_clip_low (GSPO's paper: 3e-4; its "
        "geometric-mean ratio stays near 1, so GRPO's 0.2 would never clip)",
        3e-4,
        ge=0,
        lt=1,
        why="1 - gspo_clip_low must stay positive",
    )
    gspo_clip_high: float = _f(
        "policy_loss gspo: the sequence ratio clipped above at 1 + gspo_clip_high (GSPO's paper: 4e-4)", 4e-4, ge=0
    )
    cispo_max_weight: float = _f(
        "policy_loss cispo: the cap of the importance weight min(pi / pi_old, cap) (no lower bound, as MiniMax-M1 "
        "ran it; 5 as TRL recommends after ScaleRL)",
        5.0,
        gt=0,
    )
    sapo_tau_pos: float = _f("policy_loss sapo: the gate's temperature for positive advantages", 1.0, gt=0)
    sapo_tau_neg: float = _f(
        "policy_loss sapo: the gate's temperature for advantages <= 0 (larger: their off-policy tokens fade faster)",
        1.05,
        gt=0,
    )
    kl_beta: float = _f("weight of the KL penalty to the initial model; 0 = no reference model", 0.0, ge=0)
    kl_estimator: Literal["k1", "k3"] = _f("KL estimator: k1 | k3 (low variance)", "k3")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "drgrpo"] = _f("loss aggregation over tokens", "token_mean")
    drgrpo_norm: int | None = _f("Dr.GRPO constant normaliser; null = rollout.max_new_tokens", None, ge=1)
    scale_rewards: Literal["group", "batch", "none"] = _f("advantage std: per group | whole batch | none", "group")
    adv_eps: float = _f("epsilon added to the std in the advantage", 1e-6, gt=0)
    filter_zero_variance: bool = _f("drop groups whose rewards are all equal from the loss", False)
    resample_zero_variance: bool = _f(
        "DAPO's dynamic sampling: a question on which every trained member's rewards are all equal (no gradient "
        "for anyone) is replaced by a fresh question from the data stream, rolled out and rewarded like the rest, "
        "until none is left or resample_max_rounds rounds ran (metrics: resampled_groups, resample_rounds, "
        "zero_variance_left)",
        False,
    )
    resample_max_rounds: int = _f(
        "algo.resample_zero_variance: the most rounds of replacements per step (each rolls out its replacements "
        "once for every member; what is still zero-variance after them trains with zero advantage)",
        3,
        ge=1,
    )
    overlong_penalty: int = _f(
        "DAPO's overlong reward shaping: L_cache, the last tokens of rollout.max_new_tokens over which a penalty "
        "added to the reward falls linearly from 0 to -1 (a response cut at the budget gets -1); 0 = off",
        0,
        ge=0,
    )
    overlong_penalty_factor: float = _f("weight of the overlong penalty (algo.overlong_penalty)", 1.0, ge=0)
    mask_truncated: bool = _f(
        "DAPO's overlong filtering: responses cut at rollout.max_new_tokens (no end token) are left out of the "
        "loss (their group's advantages are computed with them)",
        False,
    )
    updates_per_batch: int = _f("optimizer passes over each rollout batch", 1, ge=1)
    rollout_is: Literal["none", "token_truncated", "token_mask", "sequence_truncated", "sequence_mask"] = _f(
        "off-policy correction for the engine/trainer probability gap, r = pi_train / pi_rollout: none | "
        "token_truncated (each token's loss times min(r, rollout_is_cap)) | token_mask (times r, or 0 where r > "
        "the cap) | sequence_truncated (each sequence's tokens times min(R, cap), R the product of its tokens' r) "
        "| sequence_mask (times R, or 0 where R > the cap: TRL's default, cap 3)",
        "none",
    )
    rollout_is_cap: float = _f(
        "the cap C of the importance weight (algo.rollout_is): truncated at C, or masked above C", 2.0, ge=1
    )
    rollout_is_max_abs_dlogp: float = _f(
        "with algo.rollout_is: stop the run (exit 3, naming the member) when a step's rollouts, each the first "
        "after a weight sync, differ from the policy by more than this mean |log pi_train - log pi_rollout| per "
        "token (an engine serving other weights than the trainer's; bf16 kernels differ by ~0.01-0.05); 0 = "
        "never stop",
        1.0,
        ge=0,
    )


@dataclass(kw_only=True)
class TrainConfig:
    """Optimisation and checkpointing (per member, never shared)."""

    max_steps: int = _f("training steps", 100, ge=1)
    lr: float = _f("learning rate (peak of the cosine schedule)", 1e-6, gt=0)
    min_lr_ratio: float = _f("cosine schedule floor as a fraction of lr", 0.1, ge=0, le=1)
    warmup_ratio: float = _f("share of max_steps spent in linear warmup", 0.03, ge=0, lt=1)
    weight_decay: float = _f("AdamW weight decay", 0.0, ge=0)
    adam_beta1: float = _f("Adam beta1", 0.9, ge=0, lt=1)
    adam_beta2: float = _f("Adam beta2", 0.95, ge=0, lt=1)
    grad_clip: float = _f("max gradient norm; 0 = no clipping", 1.0, ge=0)
    micro_batch_size: int | Literal["auto"] = _f(
        "responses per forward/backward (gradients are accumulated): a number, or auto = on CUDA the largest whose "
        "planned peak fits the device's memory (vlm_corl.planning.micro_batch), elsewhere 8",
        "auto",
        ge=1,
    )
    gradient_checkpointing: bool = _f("recompute activations to save memory", False)
    save_every: int = _f("checkpoint every N steps; 0 = only at the end", 50, ge=0)
    save_last: bool = _f(
        "checkpoint at the last step too (false with save_every 0: a run that keeps only its metrics, such as a "
        "sweep's or a benchmark's)",
        True,
    )
    keep_last: int = _f("checkpoints kept; older ones are pruned", 2, ge=1)
    async_checkpoint: bool | Literal["auto"] = _f(
        "write checkpoints in the background: the step takes host copies, a thread writes the files while training "
        "goes on, and the checkpoint counts (and older ones are pruned) only once every file is on disk: true | "
        "false | auto (on CUDA; never under DeepSpeed)",
        "auto",
    )
    resume: bool | Literal["auto"] = _f("continue from the newest complete checkpoint: true | false | auto", False)
    overwrite: bool = _f(
        "clear a run already in output_dir when not resuming (otherwise such a run is an error)", False
    )
    mixed_precision: Literal["auto", "no", "bf16"] = _f(
        "update forward under bf16 autocast (weights and optimizer stay fp32): auto (bf16 on CUDA, no elsewhere) "
        "| no | bf16",
        "auto",
    )
    deepspeed: str | None = _f(
        "DeepSpeed JSON config for every trainable member's update (ZeRO 2/3, e.g. configs/deepspeed/zero2.json); "
        "null = plain data parallel (gradients summed over the member's ranks)",
        None,
    )
    gather_bucket_mb: float = _f(
        "ZeRO-3: megabytes of parameters gathered at a time when the full weights are streamed (vLLM weight sync, "
        "EMA teacher, checkpoint); the rest stays partitioned",
        512.0,
        gt=0,
    )
    dist_timeout_s: float = _f("seconds a collective may wait for the other ranks before the job stops", 1800.0, gt=0)
    max_nonfinite_steps: int = _f(
        "consecutive optimizer steps a member may skip for a non-finite loss or gradient norm before the run "
        "stops (exit 3, naming the member and the last complete checkpoint); each skip is logged and counted "
        "(nonfinite_skipped in metrics.jsonl)",
        3,
        ge=1,
    )
    check_memory: Literal["auto", "error", "warn", "off"] = _f(
        "the memory plan made before any model loads (corl plan; written to plan.json) and the "
        "checkpoints' disk: error = a layout that cannot fit, or an output_dir disk too small for the checkpoints, "
        "stops with exit 2 | warn = log it and go on | off | auto = error on CUDA, warn elsewhere (the disk: error "
        "everywhere)",
        "auto",
    )
    device_memory_gb: float | None = _f(
        "memory per rank the plan checks against, in GB; null = the device's (a CUDA card's total, or on a CPU "
        "the host's RAM shared by the node's processes)",
        None,
        gt=0,
    )
    on_collapse: Literal["warn", "stop", "rollback"] = _f(
        "when a collapse detector flags a member (batch, category or in-loop eval): warn | stop (exit 3, naming "
        "the member, category and evidence) | rollback (stop and set aside the checkpoints taken since the flag)",
        "warn",
    )


@dataclass(kw_only=True)
class EvalConfig:
    """Periodic benchmark evaluation during training."""

    benchmarks: list[str] = _f(
        "benchmark registry names or benchmark YAML files (vlm_corl.evaluation.benchmark_file)", factory=list
    )
    every: int = _f("evaluate every N steps; 0 = off", 0, ge=0)
    limit: int | None = _f("examples per benchmark; null = all", None, ge=1)
    temperature: float = _f("evaluation sampling temperature; 0 = greedy", 0.0, ge=0)
    max_new_tokens: int | None = _f("longest evaluation response; null = the benchmark's own", None, ge=1)
    max_category_drop: float | None = _f(
        "flag a member whose accuracy on a category falls more than this below its step-0 evaluation (eval.every "
        "also evaluates before the first update); null = no such flag",
        0.2,
        gt=0,
        le=1,
    )
    keep_best: str | None = _f(
        "keep every trained member's weights at its best in-loop score on this benchmark (one of eval.benchmarks) "
        "in RUN/best/<member>/; null = don't",
        None,
    )


@dataclass(kw_only=True)
class LoggingConfig:
    """Where metrics go (metrics.jsonl is always written)."""

    report_to: list[Literal["tensorboard", "wandb", "trackio", "mlflow"]] = _f(
        "experiment trackers that get every metrics.jsonl series (one per member), the config, the sampled "
        "responses and summary.json: any of tensorboard (RUN/tensorboard), wandb (RUN/wandb; WANDB_MODE=offline "
        "works without a network), trackio, mlflow (MLFLOW_TRACKING_URI, else RUN/mlruns); [] = metrics.jsonl "
        "only. Each but tensorboard is an extra: pip install 'co-rl[wandb]'",
        factory=lambda: ["tensorboard"],
    )
    samples_every: int = _f(
        "every N steps (and at step 1) write logging.samples_per_step questions' responses, answers, votes, labels "
        "and rewards of every member to samples.jsonl and the trackers; 0 = never",
        10,
        ge=0,
    )
    samples_per_step: int = _f("questions written each time samples are written", 2, ge=1)
    progress: bool = _f("show a progress bar", True)
    log_every: int = _f("write metrics every N steps", 1, ge=1)
    category_key: str | None = _f(
        "examples' metadata key naming their category: metrics and the collapse detector per category; auto = "
        "the category field the data's loader declares (question_type for easy-vqa, subject for MATH), when the "
        "examples carry it; null = none",
        "auto",
    )
    category_window: int = _f(
        "steps the per-category metrics are averaged over (one batch holds few of each)", 10, ge=1
    )
    tracker_timeout_s: float = _f(
        "seconds each tracker of logging.report_to may take to start (log in, reach its server) before the run "
        "stops with an error naming it",
        30.0,
        gt=0,
    )


@dataclass(kw_only=True)
class CohortConfig:
    """A whole cohort run."""

    name: str = _f("run name", "cohort")
    output_dir: str = _f("run directory (config.yaml, metrics.jsonl, checkpoints/, summary.json)", "runs/cohort")
    seed: int = _f("run seed (model init, sampling)", 0, ge=0)
    members: list[MemberConfig] = _f("the cohort members", min_items=1, why="a cohort needs at least one model")
    data: DataConfig = _f("training data", factory=DataConfig)
    rollout: RolloutConfig = _f("sampling", factory=RolloutConfig)
    reward: RewardConfig = _f("reward", factory=RewardConfig)
    algo: AlgoConfig = _f("GRPO objective", factory=AlgoConfig)
    train: TrainConfig = _f("optimisation and checkpoints", factory=TrainConfig)
    eval: EvalConfig = _f("evaluation", factory=EvalConfig)
    logging: LoggingConfig = _f("logging", factory=LoggingConfig)


def custom_rewards(cfg: CohortConfig) -> list[str]:
    """reward.custom as a list of module:function names (it may be given as one string)."""
    custom = cfg.reward.custom
    return [] if custom is None else [custom] if isinstance(custom, str) else list(custom)


def has_teachers(cfg: CohortConfig) -> bool:
    """Whether the run's reward keeps an EMA teacher per trained member (its slots, engines and memory)."""
    return cfg.reward.mode in TEACHER_MODES


def resolve_async(setting: bool | str, device_type: str, deepspeed: bool) -> bool:
    """Does this run write its checkpoints in the background? `train.async_checkpoint`: true | false | auto (on
    CUDA, where a checkpoint's write is long against a step; on a CPU the host copy costs about as much as the
    write). Never under DeepSpeed, whose engine writes its partitions itself. The run's writer and the memory
    planner's host plan both follow it."""
    if deepspeed:
        return False
    if setting == "auto":
        return device_type == "cuda"
    return bool(setting)


def slots_per_member(cfg: CohortConfig) -> int:
    """How many slots (renderers, rollouts) each member has: two under a two-view or EMA-teacher reward, else
    one (the layouts of vlm_corl.training.run.slots, which the reward registry declares)."""
    modes = TWO_VIEW_MODES + TEACHER_MODES
    return 2 if cfg.reward.mode in modes else 1
