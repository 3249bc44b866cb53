"""The experts of an MoE layer with their experts split over a mesh axis, run locally.

Requires: a node of ``autopar::experts`` or ``autopar::experts_backward``
(``autopar.capture.moe``) whose planned strategy (``autopar.strategies.rules``) splits the expert
weights on dim 0 over some mesh axes: over at most one of them the tokens are split too (the
dispatching axis: each (token, choice) pair goes to the rank of that axis holding its expert and
comes back, all-to-all); over the others the tokens are whole (each rank adds its own experts'
share, a partial sum). Guarantees: the planned outputs, run by the op on the rank's local
blocks with ``owner`` (which rank of the dispatching axis holds each expert, ``-1`` for experts
held by other ranks of the whole-token axes) and the dispatching axis's process group.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor

from autopar.cost_models.experts import expert_weight_params
from autopar.strategies.rules import EXPERT_OPS, dispatch_axes, expert_owners, splits_experts

_BACKWARD = torch.ops.autopar.experts_backward.default

__all__ = ["needs_local", "run_local", "weight_values"]

# experts_backward's outputs: the hidden states' gradient, the routing weights', then the two
# expert weights' (autopar.capture.moe)
_WEIGHT_GRADS = (2, 3)


def weight_values(nodes: Sequence[Any]) -> frozenset[str]:
    """The FX ``nodes`` (their names) that hold MoE expert weights or their gradients: the
    experts ops' weight placeholders and ``experts_backward``'s weight-gradient items. Their
    dim 0 counts experts: split over the cp axis (the ep ranks taken from cp), it is no
    sequence, and a balanced cp layout must not reorder it."""
    out = set(expert_weight_params(nodes))
    for n in nodes:
        if n.op == "call_function" and n.target is operator.getitem and \
                getattr(n.args[0], "target", None) is _BACKWARD and n.args[1] in _WEIGHT_GRADS:
            out.add(n.name)
    return frozenset(out)


def needs_local(target: Any, in_placements: Sequence[tuple]) -> bool:
    """Whether a node is an experts op with its experts split over some axis."""
    if target not in EXPERT_OPS:
        return False
    return any(splits_experts(p) for p in in_placements[EXPERT_OPS[target][1]])


def run_local(n: Any, args: tuple, out_placements: Sequence[tuple], mesh: Any) -> Any:
    """Run the node on local blocks with this rank's owners and dispatching group."""
    tok, wt = EXPERT_OPS[n.target]
    tensors = [a for a in args if isinstance(a, DTensor)]
    axes = dispatch_axes(tensors[tok].placements, tensors[wt].placements)
    if len(axes) > 1:
        raise ValueError(f"{n.name}: the plan dispatches tokens to experts over mesh axes {axes}; "
                         f"one at most is supported (the planner pins dispatching to the ep axis).")
    axis = axes[0] if axes else None
    num_experts = tensors[wt].shape[0]
    owner = expert_owners(num_experts, tensors[wt].placements, tuple(mesh.shape),
                          mesh.get_coordinate(), axis)
    group = mesh.get_group(axis).group_name if axis is not None else ""
    local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
    form = local[len(tensors)]
    outs = n.target(*local[:len(tensors)], form, owner, group)
    vals = n.meta["val"]
    if isinstance(outs, torch.Tensor):
        return DTensor.from_local(outs, mesh, out_placements[0], run_check=False,
                                  shape=vals.shape, stride=vals.stride())
    return tuple(DTensor.from_local(o, mesh, p, run_check=False, shape=v.shape, stride=v.stride())
                 for o, p, v in zip(outs, out_placements, vals))
