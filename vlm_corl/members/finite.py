"""Non-finite values where a member's numbers enter: a model directory's weights (refused at load, naming the
tensor) and the logits its forward pass gives while sampling (a named error, not an index error inside the
sampler). The update's own guard is `Member.step`; the run's is `vlm_corl.training.run.numerics`."""

from __future__ import annotations

import torch

from vlm_corl.errors import UserError


class NonFiniteWeights(UserError, ValueError):
    """A model directory's weights hold a NaN or an infinity (a user error: names the member and the tensor)."""


class NonFiniteLogits(RuntimeError):
    """A member's forward pass gave non-finite logits while sampling (its weights or inputs hold NaN/inf)."""


def check_finite_weights(model: torch.nn.Module, who: str) -> None:
    """Raise NonFiniteWeights naming the first parameter or buffer of `model` that holds a NaN or an infinity."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise NonFiniteWeights(
                f"{who}: weight {name!r} holds {bad} non-finite value(s) (NaN or infinity): the checkpoint is "
                "damaged or was saved from a diverged run; use another checkpoint of the model"
            )
