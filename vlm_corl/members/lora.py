"""LoRA members through PEFT: which layers get adapters, injecting them, the merged weights a LoRA member serves,
and reading an adapter directory (a LoRA member's checkpoint) back.

A LoRA member keeps its base weights frozen in their loaded dtype and trains only the adapters (fp32). The
adapters are injected in place into the transformers model (`Member.model` stays the model every other part of
the trainer calls; `Member.peft` is PEFT's wrapper, used to save the adapter in PEFT's format). Whatever reads a
member's full weights (a vLLM engine's sync, an EMA teacher, an export) reads them merged, under the base model's
own names: W + (alpha / r) * B @ A, one layer at a time, so no second full copy is ever kept.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vlm_corl.errors import UserError
from vlm_corl.members.adapter_files import ADAPTER_CONFIG, base_model_dir, is_adapter_dir  # noqa: F401

if TYPE_CHECKING:
    from vlm_corl.config.schema import LoraConfig

ADAPTER_NAME = "default"
# Where a vision-language model keeps its vision tower (Qwen-VL, Gemma-3 and InternVL, Llama-3.2-Vision).
VISION_TOWERS = ("visual", "vision_tower", "vision_model")
# The language model's attention and MLP projections, in every supported family.
LM_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def in_vision_tower(name: str) -> bool:
    """Whether module `name` lies inside a vision tower."""
    return any(part in VISION_TOWERS for part in name.split("."))


def target_modules(model: torch.nn.Module, lora: LoraConfig) -> list[str]:
    """The full names of the linear layers that get adapters: those whose last name part is one of
    `lora.target_modules` (default: the language model's projections) outside the vision tower, and with
    `lora.vision` every linear layer of the vision tower (`target_modules: []` with it: the tower alone). Raises
    UserError when an entry the user gave matches no linear layer of the language model (a typo would otherwise
    adapt only the entries that match; a vision-tower layer's name says how the tower is adapted), or when
    nothing matches at all."""
    wanted = set(LM_PROJECTIONS if lora.target_modules is None else lora.target_modules)
    names, available, in_tower = [], set(), set()
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        tower, last = in_vision_tower(name), name.rsplit(".", 1)[-1]
        (in_tower if tower else available).add(last)
        if (tower and lora.vision) or (not tower and last in wanted):
            names.append(name)
    unmatched = sorted(wanted - available) if lora.target_modules else []
    if unmatched or not names:
        tower_names = sorted(set(unmatched) & in_tower)
        raise UserError(
            f"lora.target_modules: {', '.join(map(repr, unmatched or sorted(wanted)))} "
            f"match{'es' if len(unmatched) == 1 else ''} no linear layer of the language model, whose layers "
            f"are named {', '.join(sorted(available))}; name the last part of its projections, or leave "
            "target_modules null for the language model's attention and MLP"
            + (
                f" ({', '.join(map(repr, tower_names))}: the vision tower's; its layers are adapted all together "
                "by lora.vision: true, and target_modules: [] with it adapts the vision tower alone)"
                if tower_names
                else ""
            )
        )
    return names


def adapter_parameters(model: torch.nn.Module, lora: LoraConfig) -> int:
    """How many parameters the adapters add: r * (in + out) per adapted layer (works on the `meta` device)."""
    layers = dict(model.named_modules())
    return sum(lora.r * (layers[n].in_features + layers[n].out_features) for n in target_modules(model, lora))


def inject(model: torch.nn.Module, lora: LoraConfig, adapter_dir: Path | None = None):
    """PEFT's wrapper around `model` with adapters injected in place: fresh ones per `lora`, or (resuming) the
    ones saved in `adapter_dir`. Only the adapters require gradients; they are fp32 whatever the base's dtype."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import PeftModel, get_peft_model

    if adapter_dir is not None:
        peft_model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=True)
    else:
        config = PeftLoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=target_modules(model, lora),
            bias="none",
        )
        peft_model = get_peft_model(model, config)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return peft_model


def scalings(model: torch.nn.Module) -> dict[str, float]:
    """{adapted layer's name: alpha / r} of a model with injected adapters."""
    return {
        name: float(module.scaling[ADAPTER_NAME])
        for name, module in model.named_modules()
        if hasattr(module, "lora_A") and ADAPTER_NAME in getattr(module, "scaling", {})
    }


def merged_weights(
    named: Iterable[tuple[str, torch.Tensor]], scaling: dict[str, float], copy: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's (name, tensor) with every adapter merged in: a stream of a LoRA model's tensors
    (`<layer>.base_layer.weight`, `<layer>.lora_A.default.weight`, `<layer>.lora_B.default.weight`, ...) becomes
    `<layer>.weight` = W + scaling * B @ A (fp32), the other tensors renamed or passed through. A layer's parts
    are held only until all three arrived; with `copy` as copies (a streamed ZeRO-3 tensor may be released once
    the stream moves on), else as the references the stream gave (the live module's)."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        layer, part = _lora_part(name, scaling)
        if layer is None:
            yield name.replace(".base_layer.", "."), tensor
            continue
        parts = pending.setdefault(layer, {})
        parts[part] = tensor.detach().clone() if copy else tensor.detach()
        if len(parts) == 3:
            del pending[layer]
            weight = parts["weight"].float() + scaling[layer] * (parts["B"].float() @ parts["A"].float())
            yield f"{layer}.weight", weight
    if pending:
        raise RuntimeError(f"adapted layers with missing parts in the weight stream: {sorted(pending)}")


def _lora_part(name: str, scaling: dict[str, float]) -> tuple[str | None, str]:
    """(adapted layer, "weight" | "A" | "B") of a tensor name, or (None, "") for any other tensor."""
    for suffix, part in (
        (".base_layer.weight", "weight"),
        (f".lora_A.{ADAPTER_NAME}.weight", "A"),
        (f".lora_B.{ADAPTER_NAME}.weight", "B"),
    ):
        if name.endswith(suffix) and name[: -len(suffix)] in scaling:
            return name[: -len(suffix)], part
    return None, ""


def adapter_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Host copies of a stream's adapter tensors, under the names PEFT's wrapper gives them (what
    `PeftModel.save_pretrained(state_dict=...)` takes)."""
    return {
        f"base_model.model.{name}": t.detach().to("cpu", copy=True)
        for name, t in named
        if ".lora_A." in name or ".lora_B." in name
    }


def load_merged(model: torch.nn.Module, adapter_dir: str | Path) -> torch.nn.Module:
    """`model` (the base) with the adapter in `adapter_dir` merged into its weights: a plain model again."""
    from peft import PeftModel

    return PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
