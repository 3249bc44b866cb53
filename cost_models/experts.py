"""What the MoE experts op (``autopar.capture.moe``) costs under one strategy: its FLOPs at the
rows its rank's experts receive, and its all-to-alls over the dispatching axis.

Routing is assumed uniform: each of a rank's (token, choice) pairs goes to any expert with
equal chance, so a rank's experts receive ``pairs * group * local / experts`` rows (``group``:
the ranks of the dispatching axis, ``local``: the rank's experts), times ``skew``, the busiest
rank's load over the mean where the experts are split over ranks (``Config.expert_load_skew``:
1.0, uniform, by default; ``benchmarks/moe_ep.py`` reports measured skews), on its experts'
compute and token traffic and on the all-to-alls' time. The all-to-alls run inside the op, serial with its compute, so
their time is priced as part of the node's (``cost_models.sharding``); the plan lists them
(``planning.collectives``) with these bytes, what a rank sends: exact for the dispatch of the
forward and the backward when the experts are split over the dispatching axis only (every pair
is sent), the uniform expectation for the rows sent back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from autopar.cost_models.comm import axis_collective_time, axis_strides
from autopar.cost_models.compute import FLOP_FORMULAS_BY_NAME, op_time
from autopar.cost_models.topology import Topology
from autopar.strategies.reshard import local_shape
from autopar.strategies.rules import EXPERT_OPS, dispatch_axes, expert_owners, splits_experts
from autopar.strategies.space import tensor_inputs

_FORWARD = torch.ops.autopar.experts.default

__all__ = ["ExpertsWork", "experts_flops", "experts_exchanges",
           "experts_owner_for", "experts_comm_time", "experts_node_work", "experts_work",
           "expert_weight_params"]

_COUNT_BYTES = 8  # the per-expert counts exchanged first (int64)


def _rows(tokens: int, k: int, owner: Sequence[int], local: int) -> float:
    """Rows a rank's experts receive: its group's pairs times its share of the experts."""
    group = max(owner) + 1
    return tokens * k * group * local / len(owner)


def experts_flops(hidden: Any, index: Any, weights: Any, w_in: Any, w_out: Any, form: str,
                  owner: Sequence[int], group: str = "", *, grad: bool = False,
                  rerun: bool = True) -> float:
    """FLOPs of one experts op from its (local) arguments; ``grad``: its backward, the two
    gradients (twice the forward's) and, with ``rerun``, the experts run again first (the op
    does: three times the forward's). A model's FLOPs (MFU) count the backward without the
    re-run, as they count no recomputation."""
    rows = _rows(hidden.shape[0], index.shape[-1], owner, w_in.shape[0])
    per_row = 2 * w_in.shape[1] * w_in.shape[2] + 2 * w_out.shape[1] * w_out.shape[2]
    return rows * per_row * ((3 if rerun else 2) if grad else 1)


@dataclass(frozen=True)
class ExpertsWork:
    """What one experts op computes and moves through device memory on a rank: its FLOPs, the
    bytes of its token-sized tensors (read and written) and of its expert weights (read; the
    backward also writes their gradients). The weights' bytes shrink with ep
    (``step_price``), the rest does not."""

    flops: float
    activation_bytes: float
    weight_bytes: float
    skew: float = 1.0  # the load skew the FLOPs and token bytes include (1: none)
    itemsize: int = 4  # of the expert weights: the dtype the experts compute in

    def __add__(self, other: "ExpertsWork") -> "ExpertsWork":
        return ExpertsWork(self.flops + other.flops, self.activation_bytes + other.activation_bytes,
                           self.weight_bytes + other.weight_bytes, max(self.skew, other.skew),
                           min(self.itemsize, other.itemsize))

    def skewed(self, skew: float) -> "ExpertsWork":
        """This work at load skew ``skew`` (the FLOPs and token bytes of the busiest rank)."""
        f = skew / self.skew
        return ExpertsWork(self.flops * f, self.activation_bytes * f, self.weight_bytes, skew,
                           self.itemsize)

    def seconds(self, topology: Topology, weight_share: float = 1.0) -> float:
        """Roofline seconds (``compute.op_time``) in the experts' dtype, the weights' bytes
        times ``weight_share``."""
        return op_time(self.flops, self.activation_bytes + self.weight_bytes * weight_share,
                       topology, "bf16" if self.itemsize == 2 else "fp32", is_matmul=True)


def experts_work(target: Any, local: Sequence[Any], form: str, owner: Sequence[int]) -> ExpertsWork:
    """:class:`ExpertsWork` of one experts op from its local tensor inputs (meta tensors)."""
    grad = target is not _FORWARD
    nbytes = lambda ts: sum(t.numel() * t.element_size() for t in ts)  # noqa: E731
    return ExpertsWork(experts_flops(*local[-5:], form, owner, grad=grad),
                       2.0 * nbytes(local[:-2]), (2.0 if grad else 1.0) * nbytes(local[-2:]),
                       itemsize=local[-2].element_size())


def expert_weight_params(nodes: Sequence[Any]) -> set[str]:
    """The placeholders (of FX ``nodes``) the MoE experts ops read as their expert weights."""
    out = set()
    for n in nodes:
        if n.target in EXPERT_OPS:
            first = EXPERT_OPS[n.target][1]
            out |= {a.name for a in tensor_inputs(n)[first:first + 2] if a.op == "placeholder"}
    return out


def experts_node_work(n: Any, s: Any, mesh_shape: Sequence[int], skew: float = 1.0
                      ) -> tuple[ExpertsWork, int]:
    """The :class:`ExpertsWork` of experts node ``n`` (an FX node) under strategy ``s`` on the
    busiest rank (load ``skew`` where the strategy splits the experts over ranks), and its
    tokens' itemsize."""
    inputs = tensor_inputs(n)
    shapes = [tuple(a.meta["val"].shape) for a in inputs]
    owner, _ = experts_owner_for(n.target, s.inputs, shapes, mesh_shape)
    local = [torch.empty(local_shape(a.meta["val"].shape, p, mesh_shape), dtype=a.meta["val"].dtype,
                         device="meta") for a, p in zip(inputs, s.inputs)]
    work = experts_work(n.target, local, n.args[len(inputs)], owner)
    split = local[-1].shape[0] < shapes[-1][0]
    return work.skewed(skew) if split else work, inputs[0].meta["val"].element_size()


def experts_owner_for(target: Any, placements: Sequence[tuple], shapes: Sequence[tuple],
                      mesh_shape: Sequence[int]) -> tuple[list[int], int | None]:
    """The ``owner`` argument rank 0 runs a strategy's experts op with (input ``placements``
    and global ``shapes`` of its tensor inputs), and the dispatching axis (None: none)."""
    tok, wt = EXPERT_OPS[target]
    axes = dispatch_axes(placements[tok], placements[wt])
    axis = axes[0] if axes else None
    return expert_owners(shapes[wt][0], placements[wt], mesh_shape, [0] * len(mesh_shape),
                         axis), axis


def experts_exchanges(target: Any, placements: Sequence[tuple], shapes: Sequence[tuple],
                      itemsize: int, mesh_shape: Sequence[int]) -> list[tuple[str, int, float]]:
    """The all-to-alls of one experts op as ``(kind, axis, bytes a rank sends)``, in order:
    the counts, the rows out, the rows back; none without a dispatching axis."""
    owner, axis = experts_owner_for(target, placements, shapes, mesh_shape)
    if axis is None:
        return []
    tok, wt = EXPERT_OPS[target]
    tokens, k = shapes[tok][0], shapes[tok + 1][-1]
    tokens //= _split_count(placements[tok], mesh_shape)
    local = shapes[wt][0] // _split_count(placements[wt], mesh_shape)
    group = mesh_shape[axis]
    pairs = tokens * k * sum(o >= 0 for o in owner) / len(owner)
    d = shapes[tok][-1]
    out_width, back_width = (2 * d + 1, d + 1) if target is not _FORWARD else (d, d)
    return [("all_to_all", axis, group * local * _COUNT_BYTES),
            ("all_to_all", axis, pairs * out_width * itemsize),
            ("all_to_all", axis, pairs * back_width * itemsize)]


def experts_comm_time(target: Any, placements: Sequence[tuple], shapes: Sequence[tuple],
                      itemsize: int, mesh_shape: Sequence[int], topology: Topology,
                      skew: float = 1.0) -> float:
    """Seconds of :func:`experts_exchanges` on ``topology``, the rows' at load ``skew`` (the
    busiest rank receives that many times the mean and the exchange waits for it)."""
    strides = axis_strides(mesh_shape)
    exchanges = experts_exchanges(target, placements, shapes, itemsize, mesh_shape)
    return sum(axis_collective_time(kind, nbytes * (skew if i else 1.0), mesh_shape[axis],
                                    strides[axis], topology)
               for i, (kind, axis, nbytes) in enumerate(exchanges))  # (0: the counts)


def _split_count(placements: Sequence[Any], mesh_shape: Sequence[int]) -> int:
    n = 1
    for a, p in enumerate(placements):
        if splits_experts(p):
            n *= mesh_shape[a]
    return n


FLOP_FORMULAS_BY_NAME["autopar::experts"] = experts_flops
FLOP_FORMULAS_BY_NAME["autopar::experts_backward"] = \
    lambda grad, *args, **kw: experts_flops(*args, grad=True, rerun=False)
