"""Compare a parallel step with one process on every rank, per parameter (used by ``worker.py``).

Each rank compares its own loss with the one-process loss, and each gradient it holds (its local
shard, as the optimizer sees it) with the matching slice of the one-process gradient. The slice is
cut by DTensor itself (``distribute_tensor(..., src_data_rank=None)`` splits locally, without
communication), so the check does not share code with the runtime it checks.

A parameter's error is ``max |local - slice| / max(max |one-process gradient of the parameter|,
1e-3 * the largest gradient of the model)`` (``autopar.numerics``, the rule's one owner, which
says why).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

from autopar.numerics import gradient_error, gradient_floor

__all__ = ["compare_on_every_rank"]


def _local_pair(grad: torch.Tensor, ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's gradient and the slice of ``ref`` it should equal."""
    if isinstance(grad, DTensor):
        expected = distribute_tensor(ref.detach(), grad.device_mesh, grad.placements, src_data_rank=None)
        return grad.to_local(), expected.to_local()
    return grad, ref


def _rank_errors(pm, ref_params: dict) -> tuple[dict[str, float], list[str]]:
    errors, missing = {}, []
    floor = gradient_floor(p.grad for p in ref_params.values())
    for name, p in pm.named_parameters():
        if p.grad is None:
            if ref_params[name].requires_grad:  # (frozen ones, e.g. sinusoidal tables, have none)
                missing.append(name)
            continue
        want = ref_params[name].grad
        local, expected = _local_pair(p.grad, want)
        assert local.shape == expected.shape, (name, tuple(local.shape), tuple(expected.shape))
        # (the scale: the whole reference gradient's, not the slice's)
        scale_floor = max(want.abs().max().item(), floor)
        errors[name] = gradient_error(local, expected, scale_floor)
    return errors, missing


def compare_on_every_rank(pm, ref, loss: torch.Tensor, ref_loss: torch.Tensor, prefix: str = "") -> dict:
    """Every rank's loss and per-parameter gradient errors against one process (collective).

    Returns, for rank 0's record: ``{prefix}loss_err`` (largest ``|loss - ref| / max(1, |ref|)``
    over ranks), ``{prefix}grad_rel`` (largest per-parameter error over parameters and ranks),
    ``{prefix}grad_worst`` (``name@rank`` of that error), ``{prefix}grad_checked`` (how many
    parameter names some rank checked; ``grad_expected``: how many the model trains) and ``{prefix}grad_missing`` (``name@rank`` of each
    parameter a rank holds without a gradient).
    """
    errors, missing = _rank_errors(pm, dict(ref.named_parameters()))
    mine = (abs(loss.item() - ref_loss.item()) / max(1.0, abs(ref_loss.item())), errors, missing)
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    worst, worst_at = 0.0, ""
    checked: set[str] = set()
    for rank, (_, errs, _) in enumerate(every):
        checked |= set(errs)
        for name, err in errs.items():
            if err >= worst:
                worst, worst_at = err, f"{name}@{rank}"
    missing_all = {f"{name}@{rank}" for rank, (_, _, m) in enumerate(every) for name in m}
    return {f"{prefix}loss_err": max(e[0] for e in every), f"{prefix}grad_rel": worst,
            f"{prefix}grad_worst": worst_at, f"{prefix}grad_checked": len(checked),
            "grad_expected": sum(1 for p in ref.parameters() if p.requires_grad),
            f"{prefix}grad_missing": sorted(missing_all)}
