"""A cohort member at run time: its model, processor, optimizer and schedule, loaded from its config.

Members are fully decoupled: each owns its parameters, optimizer state and schedule, and nothing here is
shared between two members.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import logging
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import SafetensorError
from transformers import AutoProcessor, AutoTokenizer
from transformers.optimization import get_cosine_with_min_lr_schedule_with_warmup

from vlm_corl.distributed.world import default_device, sum_over
from vlm_corl.errors import UserError, brief
from vlm_corl.members.families import GENERIC, Family, detect_family
from vlm_corl.members.families.generic import SWITCHED_OFF
from vlm_corl.members.finite import check_finite_weights
from vlm_corl.members.lora import (
    adapter_tensors,
    base_model_dir,
    inject,
    is_adapter_dir,
    load_merged,
    merged_weights,
    scalings,
)
from vlm_corl.members.precision import DTYPES, cast_parameters, rollout_dtype, serves_lower, update_autocast_dtype
from vlm_corl.members.rollout import Policy
from vlm_corl.members.state_files import TRAINER_STATE, host_copy, named_tensors, read_state
from vlm_corl.registry import FAMILIES

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from vlm_corl.config.schema import MemberConfig, TrainConfig
    from vlm_corl.data.records import Example


@dataclass(frozen=True)
class LoadedModel:
    """A member's module with the processor and tokenizer loaded beside it from its directory (`_load_files`):
    what `Member` is built around, handed over as one."""

    model: Any  # the torch module (adapters injected, fp32 masters for a trainable member)
    processor: Any
    tokenizer: Any


class Member:
    """One model of the cohort with everything needed to render for it, sample from it and update it.

    `checkpoint_dtype` is the dtype its weights were loaded in (what checkpoints are saved in, whatever the fp32
    masters of a trainable member); `rollout_dtype` the one rollouts and evaluation compute in
    (vlm_corl.members.precision)."""

    def __init__(
        self,
        cfg,
        family: Family,
        loaded: LoadedModel,
        device: torch.device,
        checkpoint_dtype: torch.dtype | None = None,
        rollout_dtype: torch.dtype | None = None,
    ):
        self.cfg, self.family, self.model = cfg, family, loaded.model
        self.processor, self.tokenizer = loaded.processor, loaded.tokenizer
        self.device = device
        self.checkpoint_dtype = checkpoint_dtype or loaded.model.dtype
        self.rollout_dtype = rollout_dtype or self.checkpoint_dtype
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        self.reference = None  # frozen initial weights, only when the KL penalty is on
        self.autocast_dtype: torch.dtype | None = None
        self.group = None  # process group of the member's ranks when it is data-parallel (vlm_corl.distributed.world)
        self.deepspeed = None  # a DeepSpeedUpdate when train.deepspeed is set (vlm_corl.members.deepspeed_update)
        self.peft = None  # PEFT's wrapper of a LoRA member (its adapters are injected into `model` itself)
        self.lora_scaling: dict[str, float] = {}  # adapted layer -> alpha / r (vlm_corl.members.lora)
        # The copy in the rollout dtype that HF rollouts sample from, where weights that move (a trained member's
        # fp32 masters, an EMA teacher's fp32 weights) are served lower (`precision.samples_from_copy`); built
        # once and refreshed in place by the HF engine's sync (`refresh_rollout_copy`)
        self.rollout_copy: torch.nn.Module | None = None

    @property
    def id(self) -> str:
        return self.cfg.id

    @property
    def prompt_style(self) -> str:
        return self.cfg.prompt_style or self.family.prompt_style

    @property
    def is_vision(self) -> bool:
        return self.family.modality == "vision"

    @property
    def mrope(self) -> bool:
        """Qwen-VL models compute their 3-D rotary positions (from the attention mask) themselves."""
        return hasattr(getattr(self.model, "model", None), "get_rope_index")

    @property
    def generation_module(self) -> torch.nn.Module:
        """The module HF rollouts, evaluation and scoring passes run: the rollout-dtype copy where there is one
        (a trained member's or an EMA teacher's, `rollout_copy`, fresh from the sync after every update), the
        live model, or under DeepSpeed ZeRO-3 with the HF engine the full copy refreshed after every update (a
        partitioned member has none: see `partitioned`). Never what the update or a checkpoint reads: those use
        the weights themselves (`train_module`, `full_weights`)."""
        if self.rollout_copy is not None:
            return self.rollout_copy
        return self.deepspeed.full_model if self.deepspeed is not None else self.model

    @torch.no_grad()
    def refresh_rollout_copy(self) -> None:
        """Copy the current weights into the rollout-dtype copy, where there is one (a trained member's, an EMA
        teacher's), in place: its tensors keep their addresses, so captured CUDA graphs replay over the new
        weights."""
        if self.rollout_copy is None:
            return
        for copied, weight in zip(self.rollout_copy.parameters(), self.model.parameters()):  # one structure
            copied.copy_(weight)

    @property
    def partitioned(self) -> bool:
        """DeepSpeed ZeRO-3 without a full copy: the weights exist whole only while streamed (`full_weights`)."""
        return self.deepspeed is not None and self.deepspeed.partitioned

    @property
    def streams_weights(self) -> bool:
        """ZeRO-3 (with or without the HF engine's copy): `full_weights` is a collective over the member's ranks."""
        return self.deepspeed is not None and self.deepspeed.stage == 3

    def full_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(state-dict name, tensor) of the member's full weights (the fp32 masters of a trainable member), each
        parameter once, then the persistent buffers: what the vLLM sync, an EMA teacher, a checkpoint and the
        replica checksum read. Under ZeRO-3 it is a collective over the member's ranks (every rank iterates to
        the end) that gathers a bucket of parameters at a time, never a second full copy. A LoRA member's are
        merged (base + adapters, under the base model's names), one layer at a time."""
        raw = self.deepspeed.full_weights() if self.deepspeed is not None else named_tensors(self.model)
        if self.peft is None:
            return raw
        return merged_weights(raw, self.lora_scaling, copy=self.streams_weights)  # ZeRO-3's gathers are released

    def adapter_weights(self) -> dict[str, torch.Tensor]:
        """A LoRA member's adapter tensors (host copies, PEFT's names); a collective under ZeRO-3 as above, over
        the adapters alone (the frozen base is never gathered for them)."""
        raw = (
            self.deepspeed.full_weights(trainable_only=True)
            if self.deepspeed is not None
            else named_tensors(self.model)
        )
        return adapter_tensors(raw)

    @property
    def scoring_module(self) -> torch.nn.Module:
        """What no-gradient scoring passes run: the full module, or a partitioned member's engine (its ranks in
        lockstep, inside `updating()`)."""
        return self.train_module if self.partitioned else self.generation_module

    @property
    def train_module(self) -> torch.nn.Module:
        """What the update's forward passes call: the model, or its DeepSpeed engine (whose forward keeps ZeRO's
        gradient accumulation across micro-batches)."""
        return self.deepspeed.engine if self.deepspeed is not None else self.model

    @property
    def eos_token_ids(self) -> list[int]:
        """Ids that end a response: the generation config's, then the tokenizer's and the family's end-of-turn
        tokens (a base checkpoint's generation config may name only <|endoftext|>, or nothing)."""
        eos = self.model.generation_config.eos_token_id
        ids = [eos] if isinstance(eos, int) else list(eos or [])
        ids += [self.tokenizer.eos_token_id] + self._family_ids[0]
        return list(dict.fromkeys(i for i in ids if i is not None))

    @property
    def suppressed_ids(self) -> list[int]:
        """Tokens generation never samples (control/vision tokens: the generation config's and the family's,
        stop tokens excepted); the policy's log-probs exclude them too."""
        listed = list(self.model.generation_config.suppress_tokens or [])
        stop = set(self.eos_token_ids)
        return sorted({*listed, *(i for i in self._family_ids[1] if i not in stop)})

    @functools.cached_property
    def _family_ids(self) -> tuple[list[int], list[int]]:
        """(stop, control) token ids of the member's family in its tokenizer (looked up once: a real
        vocabulary has 150k entries)."""
        family, tokenizer = self.family, self.tokenizer
        return family.eos_token_ids(tokenizer, self.processor), family.suppressed_token_ids(tokenizer)

    def policy(self, temperature: float = 1.0) -> Policy:
        """The member's policy facts at a sampling temperature (vlm_corl.members.rollout.Policy)."""
        return Policy(self.tokenizer.pad_token_id, temperature, tuple(self.suppressed_ids), self.mrope)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"] if self.optimizer is not None else 0.0

    # ---- rendering --------------------------------------------------------------------------------------

    def apply_chat_template(self, text: str, num_images: int, system_prompt: str | None) -> str:
        """The member's chat template around one user turn (images first, then the text)."""
        if self.is_vision:
            content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
            system = [{"type": "text", "text": system_prompt}] if system_prompt else None
            templater = self.processor
        else:
            if num_images:
                raise ValueError(
                    f"member {self.id!r} is a text-only model but the example has {num_images} image(s): "
                    "use text data for text members, or a vision-language model"
                )
            content, system, templater = text, system_prompt, self.tokenizer
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": content}]
        return templater.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False, **self.chat_template_kwargs
        )

    @property
    def chat_template_kwargs(self) -> dict:
        """Variables the chat template renders with: the family's defaults, updated key by key with
        members[i].chat_template_kwargs (giving one key keeps Qwen3's `enable_thinking: false`)."""
        return {**dict(self.family.chat_template_kwargs), **(self.cfg.chat_template_kwargs or {})}

    def prepare_image(self, image, max_pixels: int):
        """A loaded picture at the size this member's model reads (`Family.prepare_image`; else unchanged)."""
        return self.family.prepare_image(image, self.processor, max_pixels) if self.family.prepare_image else image

    def process(self, chat_text: str, images: list) -> dict[str, torch.Tensor]:
        """Processor tensors for one prompt (batch dim 1), on the host: a rendered prompt is cached and moved to
        the device only while a rollout or an update uses it (`batching.on_device`). The template already holds
        any BOS token."""
        if self.is_vision:
            out = self.processor(
                text=[chat_text], images=[images] if images else None, return_tensors="pt", add_special_tokens=False
            )
        else:
            out = self.tokenizer([chat_text], return_tensors="pt", add_special_tokens=False)
        return {k: v for k, v in out.items() if isinstance(v, torch.Tensor)}

    def rollout_autocast(self) -> torch.autocast:
        """Autocast to the rollout dtype around HF rollouts and evaluation, when it is below the weights' (a LoRA
        member's fp32 base sampled in bf16; a no-op over a rollout copy, already in the rollout dtype). Under
        torch.no_grad (as the HF engine runs it) autocast caches its weight casts for the whole context: a rollout
        casts each weight once, not once per decoded token."""
        weights = next((self.model if self.partitioned else self.generation_module).parameters()).dtype
        lower = serves_lower(self.rollout_dtype, weights)
        return torch.autocast(self.device.type, dtype=self.rollout_dtype if lower else torch.bfloat16, enabled=lower)

    # ---- optimisation -----------------------------------------------------------------------------------

    def setup_optimizer(self, train: TrainConfig, total_updates: int, deepspeed: bool = False) -> None:
        """AdamW with a warmup + cosine schedule down to train.min_lr_ratio × lr (and gradient checkpointing).

        Without DeepSpeed the gradients and Adam's moments exist from here on (torch allocates the moments at the
        first step), so a vLLM engine built after this measures free memory with them already taken. Under
        DeepSpeed (`deepspeed`) the engine keeps gradients and moments in its own buffers over its partitions:
        nothing is allocated here, and `attach_deepspeed` creates the moments once the engine exists, also
        before any vLLM engine."""
        if train.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.autocast_dtype = update_autocast_dtype(train.mixed_precision, self.device)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            params,
            lr=self.cfg.lr or train.lr,
            betas=(train.adam_beta1, train.adam_beta2),
            weight_decay=train.weight_decay,
            fused=adamw_fused(self.device, deepspeed, params),
        )
        if not deepspeed:
            # Zero (not None) gradients: a step whose every sequence has zero advantage then updates exactly as
            # if the zero-gradient backward had run (Adam moments still advance).
            for p in params:
                p.grad = torch.zeros_like(p)
            allocate_adam_state(self.optimizer)
        self.scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            self.optimizer,
            num_warmup_steps=round(train.warmup_ratio * total_updates),
            num_training_steps=total_updates,
            min_lr_rate=train.min_lr_ratio,
        )

    def autocast(self, module: torch.nn.Module | None = None) -> torch.autocast:
        """bf16 autocast for the update's forward pass when train.mixed_precision=bf16 (weights stay fp32), around
        a forward of `module`. Off around the DeepSpeed engine, whose forward opens the same autocast itself (its
        config's `torch_autocast`, `deepspeed_update.load_deepspeed_config`): one opened outside makes DeepSpeed
        log that it overrides it."""
        engine = self.deepspeed is not None and module is self.deepspeed.engine
        return torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.bfloat16,
            enabled=self.autocast_dtype is not None and not engine,
        )

    def backward(self, loss: torch.Tensor) -> None:
        if self.deepspeed is not None:
            self.deepspeed.backward(loss)
        else:
            loss.backward()

    def updating(self) -> contextlib.AbstractContextManager[None]:
        """Context around one update (DeepSpeed needs to know which member's engine runs)."""
        return self.deepspeed.updating() if self.deepspeed is not None else contextlib.nullcontext()

    def micro_batch_count(self, n: int) -> int:
        """How many micro-batches this rank runs when it has `n`: DeepSpeed needs every rank of the member to
        run as many as the busiest one (the rest are zero-loss fillers); plain data parallel does not."""
        return self.deepspeed.lockstep_count(n) if self.deepspeed is not None else n

    def step(self, grad_clip: float, loss: torch.Tensor | None = None) -> tuple[float, bool]:
        """Sum the gradients over the member's ranks, clip, step the optimizer and the schedule, zero the
        gradients; returns the pre-clip grad norm and whether the step was applied.

        Each rank's loss is already normalised by the whole batch's totals, so the sum over ranks is the
        full-batch gradient and every rank applies the same update (its weights stay identical). The numerical
        guard: a step whose summed gradient norm, or any rank's `loss` (a flag reduced with the gradients, so
        the ranks agree), is not finite is skipped: no optimizer or schedule step, Adam's moments unchanged.
        Under DeepSpeed its optimizer skips a step whose gradient norm is not finite (and counts it)."""
        if self.deepspeed is not None:
            return self.deepspeed.step()
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        bad_loss = torch.zeros(1, device=self.device, dtype=params[0].grad.dtype)
        if loss is not None:
            bad_loss += (~torch.isfinite(loss)).to(bad_loss.dtype)
        sum_over(self.group, [p.grad for p in params] + [bad_loss])
        norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else float("inf"))
        norm, bad = torch.stack([norm.to(bad_loss.dtype), bad_loss[0]]).tolist()  # one host sync for both
        applied = math.isfinite(norm) and bad == 0.0
        if applied:
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=False)
        return norm, applied

    # ---- persistence ------------------------------------------------------------------------------------

    def save(self, directory: Path, write: bool = True) -> None:
        """HF-format weights + processor (loadable by from_pretrained), and the optimizer/schedule state.

        Every rank of the member calls this; only the one with `write` (its first rank) writes the weights:
        the others hold identical ones. Under DeepSpeed every rank writes its own optimizer-state partition."""
        directory = Path(directory)
        if self.deepspeed is not None:
            directory.mkdir(parents=True, exist_ok=True)
            self.deepspeed.save_state(directory)
        self.save_weights(directory, write)
        if write and self.optimizer is not None and self.deepspeed is None:
            state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}
            if self.checkpoint_dtype != torch.float32 and self.peft is None:
                # the weights are saved rounded: keep the masters exact (a LoRA member's adapter is saved in fp32)
                state["masters"] = {n: p.detach().cpu() for n, p in self.model.named_parameters() if p.requires_grad}
            torch.save(state, directory / TRAINER_STATE)

    def snapshot(self, write: bool = True) -> Callable[[Path], None]:
        """Host copies of what `save` writes, taken now; the returned function writes them into a directory
        later (a background checkpoint: training goes on meanwhile, the copies do not change). The same files as
        `save`; not for a DeepSpeed member (its engine writes its own state: `save`). Only the member's writer
        (`write`) copies anything: the others hold the same weights."""
        if self.deepspeed is not None:
            raise ValueError(f"member {self.id!r} runs under DeepSpeed: its checkpoint is written by `save`")
        if not write:
            return lambda directory: None
        if self.peft is not None:
            adapter = self.adapter_weights()  # host copies already
            weights, dtype = None, None
        else:
            dtype = self.checkpoint_dtype if self.cfg.trainable else None
            weights = {name: _saved(t, dtype) for name, t in self.full_weights()}
        trainer = None
        if self.optimizer is not None:
            trainer = host_copy({"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()})
            if self.checkpoint_dtype != torch.float32 and self.peft is None:
                trainer["masters"] = host_copy({n: p for n, p in self.model.named_parameters() if p.requires_grad})
        model, files = self.model, self.processor if self.is_vision else self.tokenizer

        def write_files(directory: Path) -> None:
            if self.peft is not None:
                self.peft.save_pretrained(directory, state_dict=adapter, safe_serialization=True)
            else:
                _write_model(model, directory, weights, dtype)
            files.save_pretrained(directory)
            if trainer is not None:
                torch.save(trainer, Path(directory) / TRAINER_STATE)

        return write_files

    def save_weights(self, directory: Path, write: bool = True) -> None:
        """HF-format weights + processor only (a best-so-far model); every rank of the member calls it (under
        ZeRO-3 the weights are gathered over its ranks), the one with `write` writes. A trained member's weights
        are saved in the dtype it was loaded in (its fp32 masters go to the trainer state: `save`), a frozen
        one's as they are. A LoRA member saves its adapter only, in PEFT's format (`PeftModel.from_pretrained`
        loads it onto the base), with the processor files."""
        if self.peft is not None:
            adapter = self.adapter_weights()
            if write:
                self.peft.save_pretrained(directory, state_dict=adapter, safe_serialization=True)
                (self.processor if self.is_vision else self.tokenizer).save_pretrained(directory)
            return
        dtype = self.checkpoint_dtype if self.cfg.trainable else None
        state = None
        if self.streams_weights or dtype not in (None, torch.float32):
            # the writer keeps a host copy of each (gathered) tensor, in the saved dtype; the others only take part
            state = {name: _saved(t, dtype) for name, t in self.full_weights() if write}
        if not write:
            return
        _write_model(self.model, directory, state, dtype)  # the weights themselves, never the rollout copy
        (self.processor if self.is_vision else self.tokenizer).save_pretrained(directory)

    def sum_over_ranks(self, value: float | dict[str, float]) -> float | dict[str, float]:
        """A per-rank number (a loss share, a count), or a dict of them (one collective), summed over the
        member's ranks."""
        if self.group is None:
            return value
        values = value if isinstance(value, dict) else {"": value}
        t = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        sum_over(self.group, [t])
        summed = dict(zip(values, t.tolist()))
        return summed if isinstance(value, dict) else summed[""]

    def load_trainer_state(self, directory: Path) -> None:
        if self.deepspeed is not None:
            self.deepspeed.load_state(directory)
            return
        state = read_state(Path(directory) / TRAINER_STATE)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        with torch.no_grad():
            params = dict(self.model.named_parameters())
            for name, master in state.get("masters", {}).items():
                params[name].copy_(master)


def allocate_adam_state(optimizer: torch.optim.Optimizer) -> None:
    """Create Adam's moments now, exactly as its first step would: a step at learning rate 0 on zero gradients
    leaves the weights and the (zero) moments unchanged, and its step count is reset, so the first real step is
    bit-identical to one on a lazily initialised optimizer."""
    rates = [group["lr"] for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    for state in optimizer.state.values():
        state["step"].zero_()


def adamw_fused(device: torch.device, deepspeed: bool, params: Iterable[torch.Tensor]) -> bool:
    """Does the member's AdamW run fused (one kernel for the whole step, without foreach's full-size
    temporaries)? On CUDA, when every trained parameter is a floating-point tensor on a CUDA device (torch's
    condition for `fused=True`; `device` decides for parameters still on the meta device), and not under
    DeepSpeed, whose ZeRO partitions step through its own optimizer wrapper. Elsewhere the foreach
    implementation (torch's default) runs."""
    if device.type != "cuda" or deepspeed:
        return False
    return all(p.is_floating_point() and p.device.type in ("cuda", "meta") for p in params)


def _write_model(model, directory: Path, state: dict | None, dtype: torch.dtype | None) -> None:
    """`model.save_pretrained` into `directory` (weights from `state` where given), by whichever rank calls it,
    with the saved `dtype` recorded in config.json. transformers 5 writes only on world rank 0 once
    torch.distributed is up (`should_save_on_this_rank`); a member's writer is its own first rank, so that
    decision is ours (the instance attribute wins). It is set on a shallow view of the module, never on the live
    one: a background checkpoint's thread and `keep_best` may save the same module at once (each setting and
    deleting the attribute raised AttributeError in the other), and save_pretrained writes the module's dtype and
    architectures into the config it saves, here a copy (the trainer's config stays untouched by the thread)."""
    view = copy.copy(model)  # the live module's parameters, buffers and submodules; its own attributes
    view.config = copy.deepcopy(model.config)
    view.should_save_on_this_rank = lambda is_main_process: is_main_process
    view.save_pretrained(directory, safe_serialization=True, state_dict=state)
    if dtype is not None:
        _record_dtype(Path(directory) / "config.json", dtype)


def _saved(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A host copy of one weight, floating ones in `dtype` (None: as they are); one tensor at a time, so a
    checkpoint never needs a second copy of the model on the device."""
    keep = dtype is None or not t.is_floating_point()
    return t.detach().to("cpu", dtype=t.dtype if keep else dtype, copy=True)


def _record_dtype(config_path: Path, dtype: torch.dtype) -> None:
    """Write the saved weights' dtype into config.json (save_pretrained records the module's, fp32 for the
    masters): a later `from_pretrained(dtype="auto")` or vLLM engine then loads them as saved."""
    config = json.loads(config_path.read_text())
    name = str(dtype).removeprefix("torch.")
    if config.get("dtype") == name:
        return
    for part in [config] + [v for v in config.values() if isinstance(v, dict) and "dtype" in v]:
        if "dtype" in part:
            part["dtype"] = name
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer.model.v3")


class MemberLoadError(UserError):
    """A member's model directory cannot be loaded (names the member, the directory and what is wrong)."""


def model_source(cfg: MemberConfig, path: str | Path) -> tuple[str, Path | None]:
    """(the whole model's directory, the adapter directory or None) behind `path`: a LoRA member's checkpoint
    holds only its adapter, applied to members[i].model when the member trains one, else to the base the
    adapter names (evaluating or exporting a checkpoint)."""
    if not is_adapter_dir(path):
        return str(path), None
    base = cfg.model if cfg.lora is not None else base_model_dir(path)
    return str(base), Path(path)


def member_family(cfg: MemberConfig, path: str | Path) -> Family:
    """The member's family: `family` if set (it must agree with config.json; `generic` serves any architecture
    the Auto classes load), else from config.json (of the base model, for an adapter directory): its registered
    family, else the generic one where it can serve the checkpoint (MemberLoadError naming what is missing)."""
    path = model_source(cfg, path)[0] if Path(path).is_dir() else path
    where = f"member {cfg.id!r} ({path})"
    if not Path(path).is_dir():
        raise MemberLoadError(f"{where}: the model directory does not exist (corl zoo builds tiny ones)")
    try:
        detected = detect_family(path, cfg.family, cfg.trust_remote_code)
    except (OSError, KeyError, json.JSONDecodeError) as err:
        raise MemberLoadError(
            f"{where}: cannot read the model type from config.json ({brief(err)}); it must be a "
            "Hugging Face model directory (corl zoo builds tiny ones)"
        ) from err
    except ValueError as err:  # no registered family, and the generic one cannot serve it
        raise MemberLoadError(f"{where}: {err}") from err
    if cfg.family and cfg.family != GENERIC and FAMILIES.get(cfg.family) is not detected:
        raise MemberLoadError(
            f"{where}: family {cfg.family!r} contradicts its config.json, whose model_type is a "
            f"{detected.name!r} model; remove members[*].family or fix it"
        )
    return detected


def check_modality(family: Family, examples: Iterable[Example], who: str) -> None:
    """A text-only family given examples with images is a user mistake: raise before any model is loaded."""
    with_images = next((ex for ex in examples if ex.images), None)
    if with_images is not None and family.modality != "vision":
        raise MemberLoadError(
            f"{who} is a text-only {family.name} model but the data has images (e.g. example "
            f"{with_images.id!r}): give text models text data, or use a vision-language model"
        )


def load_member(
    cfg: MemberConfig,
    model_dir: str | Path | None = None,
    device: torch.device | None = None,
    rollout: str = "auto",
    stage_on_cpu: bool = False,
) -> Member:
    """Load member `cfg` from `model_dir` (default: cfg.model; a checkpoint directory when resuming) onto `device`
    (default: `cuda:LOCAL_RANK` where CUDA is, else the CPU), its rollouts in the `rollout` dtype (`rollout.dtype`).

    The weights load straight onto the device. With `stage_on_cpu` they stay on the host (the member's device is
    still `device`): a ZeRO-3 member is partitioned onto its device from there, never whole on one GPU.
    A directory that cannot be loaded (missing or corrupt weights, tokenizer files, config) raises
    MemberLoadError naming the member and the directory.

    A LoRA member (`cfg.lora`, trainable) gets adapters injected into the base, which stays frozen in its loaded
    dtype (a checkpoint's adapter when `model_dir` holds one); an adapter directory loaded without `cfg.lora`
    (evaluation, a frozen peer) is merged into its base: a plain model."""
    path = str(model_dir or cfg.model)
    family = member_family(cfg, path)
    if family.name == GENERIC:
        log.info(
            "member %s: %s model served by the generic family (its own processor and chat template); switched off: %s",
            cfg.id,
            family.model_types[0],
            "; ".join(SWITCHED_OFF),
        )
    base, adapter = model_source(cfg, path)
    device = device or default_device()
    model, processor, tokenizer = _load_files(cfg, family, path, base, torch.device("cpu") if stage_on_cpu else device)
    check_finite_weights(model, f"member {cfg.id!r} ({base})")
    checkpoint_dtype = model.dtype
    model, peft_model = _apply_adapter(cfg, model, base, adapter)
    if cfg.trainable and peft_model is None:
        # fp32 master weights whatever the checkpoint's dtype: a bf16 weight updated at lr 1e-6 loses almost
        # every update to rounding. Compute runs in bf16 under autocast (vlm_corl.members.precision).
        model.float()
    serving = rollout_dtype(rollout, device, checkpoint_dtype)
    if not cfg.trainable:
        model.requires_grad_(False)
        if serves_lower(serving, model.dtype):  # a frozen peer of fp32 weights: one copy, in bf16
            cast_parameters(model, serving)
    member = Member(cfg, family, LoadedModel(model, processor, tokenizer), device, checkpoint_dtype, serving)
    if peft_model is not None:
        member.peft, member.lora_scaling = peft_model, scalings(model)
        if adapter is not None:  # the adapter read back when resuming
            check_finite_weights(model, f"member {cfg.id!r} ({path})")
    return member


def _load_files(cfg: MemberConfig, family: Family, path: str, base: str, target: torch.device) -> tuple:
    """(model, processor, tokenizer) of a member's directory, the model read straight onto `target`; a pad token
    where the tokenizer lacks one. A directory that cannot be loaded is a MemberLoadError naming it."""
    if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
        # transformers would quietly build a tokenizer without the model's special (image) tokens
        raise MemberLoadError(
            f"member {cfg.id!r}: {path} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)});"
            " save the tokenizer/processor beside the weights (save_pretrained)"
        )
    try:
        model = family.model_class.from_pretrained(
            base,
            dtype=DTYPES[cfg.dtype],
            attn_implementation=cfg.attn_implementation,
            trust_remote_code=cfg.trust_remote_code,
            # read straight into the device's memory, not through one host copy per rank
            **({"device_map": {"": target}} if target.type != "cpu" else {}),
        )
        tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
        processor = tokenizer
        if family.modality == "vision":
            processor = AutoProcessor.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except Exception as err:  # noqa: BLE001 - third-party loaders raise many types for a bad directory
        if isinstance(err, (torch.cuda.OutOfMemoryError, MemoryError)):
            raise
        raise MemberLoadError(
            f"member {cfg.id!r}: cannot load {path} ({brief(err)}); it needs config.json, the "
            "weights (model.safetensors) and the tokenizer/processor files, as save_pretrained "
            "writes them"
        ) from err
    if tokenizer.pad_token_id is None:
        # Batches are padded (and pad positions masked out of every loss): eos is the usual stand-in.
        if tokenizer.eos_token is None:
            raise MemberLoadError(
                f"member {cfg.id!r}: the tokenizer in {path} has neither a pad nor an eos token;"
                " set pad_token in its tokenizer_config.json"
            )
        tokenizer.pad_token = tokenizer.eos_token
        if processor is not tokenizer and getattr(processor, "tokenizer", None) is not None:
            processor.tokenizer.pad_token = tokenizer.eos_token
    return model, processor, tokenizer


def _apply_adapter(cfg: MemberConfig, model, base: str, adapter: Path | None) -> tuple:
    """(model, PEFT wrapper or None): a trained LoRA member's adapters injected (fresh, or read from `adapter`
    when resuming); an adapter directory loaded without `cfg.lora` merged into its base."""
    try:
        if cfg.lora is not None and cfg.trainable:
            model.name_or_path = str(Path(base).resolve())  # what the adapter's config names as its base
            try:
                return model, inject(model, cfg.lora, adapter)
            except UserError as err:  # which member's lora settings
                raise UserError(f"member {cfg.id!r}: {err}") from err
        if adapter is not None:
            return load_merged(model, adapter), None
        return model, None
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError) as err:  # a truncated adapter file too
        if adapter is None:
            raise
        raise MemberLoadError(
            f"member {cfg.id!r}: cannot apply the adapter in {adapter} to {base} ({brief(err)}); it needs "
            "adapter_config.json and adapter_model.safetensors as PeftModel.save_pretrained writes them, for "
            "this base model"
        ) from err
