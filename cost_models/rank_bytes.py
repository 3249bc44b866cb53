"""Bytes of a rank's training step beside the buffers the liveness walk follows.

Owns what :func:`autopar.cost_models.liveness.step_memory` adds to the walk of the lowered
program: what lives across steps (:func:`persistent_bytes`: each parameter's local shard with its
gradient and optimizer states, the other program inputs' local shards, a pipeline stage's receive
buffers, the graph's constants, and a ZeRO-1 stage's gathered copies) and what a split backward
(zero-bubble) passes from its input-gradient step to its weight step (:func:`weight_stash_bytes`).
Both read the traced joint graph and the plan's placements only, not the walk.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx

from autopar.capture.layers import is_backward
from autopar.capture.remat import gather_dtype
from autopar.cost_models.sharding import state_bytes_per_element, zero_once_placement
from autopar.placements import from_str
from autopar.strategies.reshard import local_shape

__all__ = ["persistent_bytes", "weight_stash_bytes"]


def persistent_bytes(traced: Any, nodes: dict, mesh_shape: tuple, optimizer: str,
                     microbatches: int, zero_axes: tuple[int, ...] = ()) -> tuple[float, float]:
    """What lives across steps, per rank: each parameter's local shard with its gradient and
    optimizer states (``state_bytes_per_element``; a tied parameter once), the local shards of
    the other program inputs, and the graph's constants. A pipeline stage's boundary
    activations and their gradients arrive in receive buffers that ``torch.distributed.
    pipelining`` makes once per microbatch and keeps (``_RecvInfo.buffer``): ``microbatches``
    of each. ``zero_axes``: :class:`~autopar.cost_models.liveness.StageRun`'s; then each
    parameter's state is its stored shard's, and its gathered copy is counted too. Returns the
    bytes, and of those the gathered copies'."""
    params = {p.node: p for p in traced.params}
    per_microbatch = {*traced.boundary_inputs, *traced.boundary_tangents}
    total = gathered = 0.0
    for n in traced.gm.graph.nodes:
        val = n.meta.get("val")
        if n.op == "get_attr":
            attr = getattr(traced.gm, n.target, None)
            total += attr.numel() * attr.element_size() if isinstance(attr, torch.Tensor) else 0
        if n.op != "placeholder" or not isinstance(val, torch.Tensor):
            continue
        shape = local_shape(tuple(val.shape), tuple(map(from_str, nodes[n.name].outputs[0])),
                            mesh_shape)
        local = float(np.prod(shape, dtype=np.float64))
        p = params.get(n.name)
        if p is None:
            total += local * val.element_size() * (microbatches if n.name in per_microbatch else 1)
        elif p.tied_to is None:
            program = tuple(map(from_str, nodes[n.name].outputs[0]))
            stored = zero_once_placement(program, tuple(val.shape), mesh_shape, zero_axes)
            shard = float(np.prod(local_shape(tuple(val.shape), stored, mesh_shape), dtype=np.float64))
            total += shard * state_bytes_per_element(optimizer, val.element_size())
            if stored != program:  # (gathered cast when read only cast: bf16 autocast)
                gathered += local * gather_dtype(n).itemsize
    return total + gathered, gathered


def weight_stash_bytes(traced: Any, mesh_shape: Sequence[int], nodes: dict) -> float:
    """Bytes per rank a split backward passes from its input-gradient step to its weight step:
    the backward values both need, computed by the first and read by a node only the second
    runs (the cut of ``runtime.autograd.split_weight_backward``, on the joint graph)."""
    out = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
    roots_in = [out[i] for i in traced.boundary_grad_outputs if isinstance(out[i], fx.Node)]
    roots_w = [out[p.grad_output_index] for p in traced.params
               if p.grad_output_index is not None and isinstance(out[p.grad_output_index], fx.Node)]
    first, second = _backward_ancestors(roots_in), _backward_ancestors(roots_w)
    total = 0.0
    for n in first & second:
        val = n.meta.get("val")
        if not isinstance(val, torch.Tensor) or n.name not in nodes:
            continue
        if any(u in second and u not in first for u in n.users) or n in roots_w:
            pl = nodes[n.name].outputs[0]
            shape = tuple(val.shape) if pl is None else local_shape(
                tuple(val.shape), tuple(map(from_str, pl)), tuple(mesh_shape))
            total += float(np.prod(shape, dtype=np.float64)) * val.element_size()
    return total


def _backward_ancestors(roots: Sequence[fx.Node]) -> set:
    """The backward call nodes ``roots`` depend on (themselves included)."""
    seen: set = set()
    todo = [r for r in roots if r.op == "call_function" and is_backward(r)]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        todo += [a for a in n.all_input_nodes if a.op == "call_function" and is_backward(a)]
    return seen
