"""Images given to the Python API as numpy arrays or torch tensors (vlm_corl/data/python_data.py `_picture`,
loaders `_lost_image` / `_image`): a uint8 HxW, HxWx1, HxWx3 or HxWx4 array is a picture (PIL.Image.fromarray),
decoded to the very pixels; any other array (floats, channels first) skips its row, counted with a reason that
names its shape and dtype, where numpy's "truth value of an array is ambiguous" ended the load before."""

from __future__ import annotations

import numpy as np
import torch

from vlm_corl.data.images import load_image
from vlm_corl.data.loaders import load_examples
from vlm_corl.data.python_data import fingerprint, register_dataset


def _load(rows):
    return load_examples("python", None, **register_dataset(rows, None, "train_dataset"))


def test_uint8_arrays_and_tensors_are_pictures_and_other_arrays_are_skipped_with_their_shape():
    rgb = np.arange(6 * 5 * 3, dtype=np.uint8).reshape(6, 5, 3)
    grey = np.full((4, 7, 1), 200, dtype=np.uint8)
    rows = [
        {"id": "np", "question": "colour?", "image": rgb},
        {"id": "torch", "question": "colour?", "image": torch.from_numpy(rgb.copy())},
        {"id": "grey", "question": "colour?", "images": [grey]},
        {"id": "floats", "question": "colour?", "image": rgb.astype(np.float32) / 255},
        {"id": "chw", "question": "colour?", "image": torch.from_numpy(rgb.copy()).permute(2, 0, 1).contiguous()},
    ]
    data = _load(rows)
    kept = {ex.id: ex for ex in data.examples}
    assert sorted(kept) == ["grey", "np", "torch"]
    assert np.array_equal(np.asarray(load_image(kept["np"].images[0], max_pixels=None)), rgb)
    assert np.array_equal(np.asarray(load_image(kept["torch"].images[0], max_pixels=None)), rgb)
    assert np.asarray(load_image(kept["grey"].images[0], max_pixels=None)).shape == (4, 7, 3)
    assert data.report.skipped == {"bad_record": 2}
    said = " | ".join(data.report.samples["bad_record"])
    assert "floats: an image array must be uint8" in said and "(6, 5, 3) and dtype float32" in said
    assert "chw: " in said and "(3, 6, 5)" in said


def test_two_tensors_that_differ_inside_have_two_fingerprints():
    a = torch.zeros(64, 64, 3, dtype=torch.uint8)
    b = a.clone()
    b[32, 32, 1] = 1  # a tensor's repr elides its middle: only its bytes tell these apart
    assert fingerprint([{"image": a}]) != fingerprint([{"image": b}])
