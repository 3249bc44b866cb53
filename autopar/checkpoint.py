"""Sharded checkpoints of a parallel model and its optimizer with ``torch.distributed.checkpoint``.

Every rank writes its own shards (a replicated tensor once); a checkpoint written under one plan
loads under another (other tp, dp, pp, ZeRO): DCP reads, for each tensor, the part that this
rank's placement needs. Parameters and optimizer states are keyed by the model's parameter names
(the optimizer's with ``flatten_optimizer_state_dict``, one key per state per parameter, so that
pipeline ranks holding different parameters write and read only their own)::

    autopar.save_checkpoint("ckpt/step100", pmodel, optimizer, extra={"step": 100})
    ...
    extra = autopar.load_checkpoint("ckpt/step100", pmodel, optimizer)  # same or another plan

Both are collectives: call them on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from torch.distributed.tensor import DTensor, Replicate

from autopar._torch_private import _StridedShard
from autopar.errors import PlanError
from autopar.passes.lower import reshard

__all__ = ["save_checkpoint", "load_checkpoint"]

_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


def _portable(state: dict[str, Any]) -> dict[str, DTensor]:
    """Replace, in place, each DTensor of ``state`` that has a ``_StridedShard`` placement (a
    fused QKV projection's rows, see :mod:`autopar.strategies.fused`) by a copy replicated on
    those axes; return the originals by key.

    DCP describes a rank's shard as one contiguous chunk (an offset and a size per dim); a
    strided shard is ``split_factor`` chunks, which DCP 2.13 writes as one overlapping chunk
    (its save then fails validation). The copy costs an all-gather of those tensors on their
    strided axes and their memory until the save or load ends.
    """
    originals = {}
    for key, value in state.items():
        if isinstance(value, DTensor) and any(isinstance(p, _StridedShard) for p in value.placements):
            originals[key] = value
            dst = tuple(Replicate() if isinstance(p, _StridedShard) else p for p in value.placements)
            state[key] = reshard(value.detach(), dst, value.device_mesh)
    return originals


def _restore(state: dict[str, Any], originals: dict[str, DTensor], into: bool) -> None:
    """Undo :func:`_portable` after a load: each loaded copy goes back to its original's
    placements, copied into the original (``into``: a module's parameter) or put in ``state``."""
    for key, original in originals.items():
        value = reshard(state[key], tuple(original.placements), original.device_mesh)
        if into:
            with torch.no_grad():
                original.to_local().copy_(value.to_local())
            state[key] = original
        else:
            state[key] = value


def _check_module(pmodel: Any) -> None:
    if not hasattr(pmodel, "sharded_state_dict"):
        raise TypeError(f"expected the module returned by autopar.parallelize, got "
                        f"{type(pmodel).__name__}; for a plain module use "
                        f"torch.distributed.checkpoint directly.")


def _optimizer_state(pmodel: Any, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state keyed by parameter name, with its states created if the optimizer
    has not stepped yet (so that a fresh optimizer has tensors to load into). torch creates
    them only while no parameter has a gradient, so gradients are set aside meanwhile."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grads = [p.grad for p in params]
    if not optimizer.state:
        for p in params:
            p.grad = None
    try:
        return get_optimizer_state_dict(pmodel, optimizer, options=_OPTIONS)
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def save_checkpoint(path: str | Path, pmodel: Any, optimizer: torch.optim.Optimizer | None = None,
                    *, extra: dict[str, Any] | None = None) -> None:
    """Save ``pmodel``'s parameters and buffers (and ``optimizer``'s state) to the directory
    ``path``, each rank writing its shards. ``extra``: picklable values (step, data position,
    ...) returned by :func:`load_checkpoint`; they must be the same on every rank."""
    _check_module(pmodel)
    state: dict[str, Any] = {"model": pmodel.sharded_state_dict(), "extra": dict(extra or {})}
    _portable(state["model"])
    if optimizer is not None:
        state["optimizer"] = _optimizer_state(pmodel, optimizer)
        _portable(state["optimizer"])
    dcp.save(state, checkpoint_id=str(path))


def load_checkpoint(path: str | Path, pmodel: Any,
                    optimizer: torch.optim.Optimizer | None = None) -> dict[str, Any]:
    """Load a checkpoint written by :func:`save_checkpoint` under this plan or any other plan
    of the same model, in place; returns its ``extra``. Every tensor the module (and
    ``optimizer``) holds must be in the checkpoint: a checkpoint without optimizer state
    cannot restore an optimizer."""
    _check_module(pmodel)
    keys = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    model_state = pmodel.sharded_state_dict()
    mine = sorted(k for k in model_state if f"model.{k}" not in keys)
    # every rank must take the same branch (pipeline ranks hold different parameters), or the
    # ranks that found nothing missing would wait in dcp.load for the others
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    missing = sorted(set().union(*every))
    if missing:
        raise PlanError(f"the checkpoint at {path} has no {missing[:5]} (of {len(missing)} "
                        f"missing): it was saved from another model.")
    state: dict[str, Any] = {"model": model_state, "extra": {}}
    strided = {"model": _portable(model_state)}
    if optimizer is not None:
        if not any(k.startswith("optimizer.") for k in keys):
            raise PlanError(f"the checkpoint at {path} has no optimizer state: it was saved "
                            f"without an optimizer; load it with load_checkpoint(path, pmodel).")
        state["optimizer"] = _optimizer_state(pmodel, optimizer)
        strided["optimizer"] = _portable(state["optimizer"])
    state["extra"] = {k.split(".", 1)[1]: None for k in keys if k.startswith("extra.")}
    dcp.load(state, checkpoint_id=str(path))
    for part, originals in strided.items():
        _restore(state[part], originals, into=part == "model")
    if optimizer is not None:
        set_optimizer_state_dict(pmodel, optimizer, state["optimizer"], options=_OPTIONS)
    return state["extra"]
