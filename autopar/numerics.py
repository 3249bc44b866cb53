"""How far a gradient is from a reference one: the rule every equivalence check uses.

A parameter's error is ``max |g - g_ref| / max(max |g_ref|, floor)``, ``floor`` being
:data:`FLOOR` of the model's largest reference gradient (:func:`gradient_floor`): relative to
the parameter's own scale, so that a wrong gradient on a parameter with small gradients is not
hidden by a large one elsewhere; the floor is for gradients that are zero in exact arithmetic
and rounding noise in both runs (an attention key bias: softmax ignores a shift shared by every
key), whose relative error means nothing.
"""

from __future__ import annotations

from typing import Iterable

import torch

__all__ = ["FLOOR", "gradient_error", "gradient_floor"]

FLOOR = 1e-3


def gradient_floor(reference_grads: Iterable[torch.Tensor | None]) -> float:
    """:data:`FLOOR` times the largest magnitude among ``reference_grads`` (``None`` skipped)."""
    return FLOOR * max(g.abs().max().item() for g in reference_grads if g is not None)


def gradient_error(grad: torch.Tensor, reference: torch.Tensor, floor: float) -> float:
    """``max |grad - reference| / max(max |reference|, floor)``, in fp32 (0 when empty)."""
    if not grad.numel():
        return 0.0
    scale = max(reference.float().abs().max().item(), floor)
    return (grad.float() - reference.float()).abs().max().item() / scale
