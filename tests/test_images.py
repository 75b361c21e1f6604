"""Image decoding: RGB conversion of every common mode, EXIF orientation, the pixel cap, bad files."""

import io
import random

import pytest
from PIL import Image

from vlm_corl.data.images import BadImage, load_image


def encode(image: Image.Image, fmt: str = "PNG", **params) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **params)
    return buf.getvalue()


def noise_png(size=(64, 64), seed=0) -> bytes:
    """An incompressible PNG, so that cutting the file short cuts into pixel data."""
    return encode(Image.frombytes("RGB", size, random.Random(seed).randbytes(size[0] * size[1] * 3)))


def test_greyscale_becomes_grey_rgb():
    out = load_image(encode(Image.new("L", (3, 2), 77)))
    assert (out.mode, out.size, out.getpixel((0, 0))) == ("RGB", (3, 2), (77, 77, 77))


def test_palette_uses_its_colours():
    img = Image.new("P", (2, 2))
    img.putpalette([0, 0, 0, 10, 200, 30] + [0] * 762)
    img.putpixel((1, 1), 1)
    out = load_image(encode(img))
    assert out.getpixel((0, 0)) == (0, 0, 0) and out.getpixel((1, 1)) == (10, 200, 30)


def test_palette_transparency_is_white():
    img = Image.new("P", (2, 1))
    img.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    img.putpixel((1, 0), 1)
    out = load_image(encode(img, transparency=0))
    assert out.mode == "RGB" and out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (0, 0, 255)


@pytest.mark.parametrize(
    "mode, colour, expected",
    [
        ("RGBA", (255, 0, 0, 0), (255, 255, 255)),  # fully transparent -> the white background
        ("RGBA", (255, 0, 0, 255), (255, 0, 0)),
        ("RGBA", (0, 0, 0, 128), (127, 127, 127)),  # half-transparent black over white
        ("LA", (0, 128), (127, 127, 127)),
    ],
)
def test_alpha_is_composited_on_white(mode, colour, expected):
    out = load_image(encode(Image.new(mode, (1, 1), colour)))
    assert out.mode == "RGB"
    assert all(abs(a - b) <= 1 for a, b in zip(out.getpixel((0, 0)), expected))


def test_cmyk_jpeg_becomes_rgb():
    out = load_image(encode(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG", quality=95))  # pure red ink
    r, g, b = out.getpixel((4, 4))
    assert out.mode == "RGB" and r > 240 and g < 15 and b < 15


def test_16_bit_greyscale_is_scaled_not_clipped():
    img = Image.new("I;16", (2, 1))
    img.putpixel((0, 0), 65535)
    img.putpixel((1, 0), 32768)
    out = load_image(encode(img))
    assert out.getpixel((0, 0)) == (255, 255, 255) and out.getpixel((1, 0)) == (128, 128, 128)


def test_exif_orientation_is_applied():
    img = Image.new("RGB", (40, 20), (255, 0, 0))
    img.paste((0, 0, 255), (20, 0, 40, 20))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    out = load_image(encode(img, "JPEG", exif=exif, quality=95))
    assert out.size == (20, 40)
    top, bottom = out.getpixel((10, 5)), out.getpixel((10, 35))
    assert top[0] > 200 > top[2] and bottom[2] > 200 > bottom[0]


def test_pixel_cap_shrinks_keeping_aspect_ratio(tmp_path):
    path = tmp_path / "wide.png"
    Image.new("RGB", (400, 100), (1, 2, 3)).save(path)
    assert load_image(str(path), max_pixels=10_000).size == (200, 50)
    assert load_image(path, max_pixels=9_999).size == (199, 49)
    assert load_image(path, max_pixels=40_000).size == (400, 100)
    assert load_image(path, max_pixels=None).size == (400, 100)
    assert load_image(path).size == (400, 100)  # the default cap is far above this


def test_bad_images_raise_their_reason(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "junk.png").write_bytes(b"this is not an image at all")
    png = noise_png()
    (tmp_path / "cut.png").write_bytes(png[: len(png) // 2])
    (tmp_path / "adir.png").mkdir()
    cases = {
        str(tmp_path / "absent.png"): "missing_image",
        str(tmp_path / "empty.png"): "zero_size_image",
        b"": "zero_size_image",
        str(tmp_path / "junk.png"): "corrupt_image",
        b"\x89PNG\r\n\x1a\n" + b"\x00" * 40: "corrupt_image",
        str(tmp_path / "cut.png"): "corrupt_image",
        str(tmp_path / "adir.png"): "unreadable_image",
    }
    for src, reason in cases.items():
        with pytest.raises(BadImage) as info:
            load_image(src)
        assert info.value.reason == reason, src
    assert load_image(png).size == (64, 64)  # the uncut file is fine


def test_truncation_is_detected_by_decoding_not_by_the_header(tmp_path):
    png = noise_png()
    cut = png[: len(png) - 200]
    assert Image.open(io.BytesIO(cut)).size == (64, 64)  # PIL opens it happily: only load() fails
    with pytest.raises(BadImage, match="truncated"):
        load_image(cut)


def test_decompression_bombs_are_refused(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    with pytest.raises(BadImage) as info:
        load_image(encode(Image.new("RGB", (30, 30))))
    assert info.value.reason == "oversized_image"
