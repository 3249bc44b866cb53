"""Full and sharded state dicts of autopar's parallel modules.

A parallel module holds each parameter as a DTensor laid out as its plan says (and a pipelined
module only the parameters of its own stages). :class:`StateDictMixin` gives it

- ``state_dict()``: the single-device model's state dict, every parameter and persistent buffer
  as a full (unsharded) tensor under its original name, on every rank (a collective: every rank
  calls it);
- ``load_state_dict(sd)``: loads such a dict (from this job, another plan, or the single-device
  model), each rank keeping its shard;
- ``sharded_state_dict()``: the parameters themselves (DTensors) and the buffers, what
  ``torch.distributed.checkpoint`` saves shard by shard and loads in place, resharding when the
  checkpoint was written under another plan (see :mod:`autopar.checkpoint`).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping, NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["StateDictMixin", "ModelState", "model_state"]


class ModelState(NamedTuple):
    """What a parallel module keeps of the model it was built from, to rebuild its state dict.

    ``keys``: the model's state dict keys in order; ``alias``: state key -> the name its
    parameter is held under (tied parameters share one); ``meta``: held name -> (shape, dtype);
    ``buffers``: persistent buffers by state key; ``unheld``: parameters that no stage uses,
    kept as they were (they get no gradient).
    """

    keys: tuple[str, ...]
    alias: dict[str, str]
    meta: dict[str, tuple[tuple[int, ...], torch.dtype]]
    buffers: dict[str, torch.Tensor]
    unheld: dict[str, torch.Tensor]


def model_state(model: nn.Module, held_names: set[str]) -> ModelState:
    """Record ``model``'s state dict layout; ``held_names``: parameter names the job holds
    (on some rank). A tied parameter is held under the first of its names that is held."""
    names_of: dict[int, list[str]] = {}
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, p in params.items():
        names_of.setdefault(id(p), []).append(name)
    state = model.state_dict(keep_vars=True)
    alias, meta, buffers, unheld = {}, {}, {}, {}
    for key, value in state.items():
        if key in params:
            group = names_of[id(params[key])]
            held = next((n for n in group if n in held_names), None)
            if held is None:
                unheld[key] = value.detach().clone()
                continue
            alias[key] = held
            meta[held] = (tuple(value.shape), value.dtype)
        else:
            buffers[key] = value.detach()
    return ModelState(tuple(state), alias, meta, buffers, unheld)


class StateDictMixin:
    """State dict methods shared by ``ParallelModule`` and ``PipelineModule`` (module docstring).

    The module sets ``_state`` (a :class:`ModelState`), ``_held`` (held name -> Parameter on this
    rank), ``_owner`` (held name -> pipeline rank that holds it, 0 without a pipeline),
    ``_pp_group`` (the ``pp`` axis's process group, or ``None``) and ``device_mesh``.
    """

    _state: ModelState
    _held: dict[str, nn.Parameter]
    _owner: dict[str, int]
    _pp_group: Any
    device_mesh: Any

    def state_dict(self, *args: Any, destination: dict | None = None, prefix: str = "",
                   keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The single-device model's state dict with full tensors (a collective: call it on
        every rank; every rank gets the whole dict). ``keep_vars`` has no effect: the full
        tensors are new tensors, detached from the parameters."""
        if args:
            raise TypeError("state_dict() takes keyword arguments only (destination, prefix, "
                            "keep_vars), as nn.Module.state_dict.")
        out = OrderedDict() if destination is None else destination
        full = {name: self._full(name) for name in self._state.meta}
        for key in self._state.keys:
            if key in self._state.alias:
                value = full[self._state.alias[key]]
            elif key in self._state.buffers:
                value = self._state.buffers[key].clone()
            else:
                value = self._state.unheld[key].clone()
            out[prefix + key] = value
        return out

    def _full(self, name: str) -> torch.Tensor:
        """The full tensor of held parameter ``name`` on every rank."""
        param = self._held.get(name)
        # a replicated parameter's full_tensor() is its local tensor itself: copy it, so the
        # state dict does not change when training goes on
        local = param.full_tensor().detach().clone() if param is not None else None
        if self._pp_group is None:
            return local
        shape, dtype = self._state.meta[name]
        device = self.device_mesh.device_type  # NCCL broadcasts device tensors
        buf = local if local is not None else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, group=self._pp_group, group_src=self._owner[name])
        return buf

    @torch.no_grad()
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True,
                        assign: bool = False) -> Any:
        """Load full (unsharded) tensors under the model's names: a dict from ``state_dict()``
        of this job or of a job under another plan, or the single-device model's. Each rank
        keeps its shard; no communication. Returns ``(missing_keys, unexpected_keys)`` as
        ``nn.Module.load_state_dict``; with ``strict`` either being non-empty raises."""
        if assign:
            raise ValueError("load_state_dict(assign=True) is not supported: the parameters "
                             "are DTensors laid out by the plan; values are copied into them.")
        expected = set(self._state.keys)
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if strict and (missing or unexpected):
            raise RuntimeError(
                f"load_state_dict: missing keys {missing[:8]}, unexpected keys {unexpected[:8]} "
                f"(of {len(missing)} and {len(unexpected)}). The state dict must be the model's "
                f"own (same names); pass strict=False to load the keys that match.")
        for key in self._state.keys:
            if key in state_dict:
                self._load_one(key, state_dict[key])
        return nn.modules.module._IncompatibleKeys(missing, unexpected)

    def _load_one(self, key: str, value: Any) -> None:
        if isinstance(value, DTensor):
            raise TypeError(
                f"load_state_dict got a DTensor for {key!r}: it takes full tensors (from "
                f"state_dict()). To restore a sharded checkpoint use autopar.load_checkpoint.")
        target = self._expected(key)
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(target.shape):
            got = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise RuntimeError(f"load_state_dict: {key!r} is {got}, the model has "
                               f"{tuple(target.shape)}; load a state dict of this model.")
        if key not in self._state.alias:
            target.copy_(value)
            return
        param = self._held.get(self._state.alias[key])
        if param is not None:
            shard = distribute_tensor(value.detach().to(param.device, param.dtype), param.device_mesh,
                                      param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())

    def _expected(self, key: str) -> torch.Tensor:
        if key in self._state.alias:
            shape, dtype = self._state.meta[self._state.alias[key]]
            return torch.empty(shape, dtype=dtype, device="meta")
        return self._state.buffers.get(key, self._state.unheld.get(key))

    def sharded_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's state: each held parameter as the DTensor Parameter itself (under every
        name of a tied parameter) and every persistent buffer. Loading into these tensors in
        place (``torch.distributed.checkpoint.load``) restores the module."""
        out: dict[str, torch.Tensor] = {}
        for key in self._state.keys:
            if key in self._state.alias:
                param = self._held.get(self._state.alias[key])
                if param is not None:
                    out[key] = param
            elif key in self._state.buffers:
                out[key] = self._state.buffers[key]
            else:
                out[key] = self._state.unheld[key]
        return out
