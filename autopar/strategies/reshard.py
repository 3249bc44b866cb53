"""Resharding: the collectives that move a tensor from one placement to another.

One function, :func:`reshard_steps`, decides the sequence of single-axis moves; the cost model
prices exactly these steps and the runtime executes exactly these steps (one
``DTensor.redistribute`` per step), so predicted and executed collectives are the same by
construction. Order: first undo shardings and partial sums from the last mesh axis to the first
(so nested shards of one dim unwind in the right order), then shard locally from the first axis
to the last.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._torch_private import _StridedShard
from autopar.placements import is_kind

__all__ = ["Step", "reshard_steps", "local_shape", "COMM_KINDS"]

_SHARDS = (Shard, _StridedShard)

Placements = tuple[Placement, ...]
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter")


@dataclass(frozen=True)
class Step:
    """One single-axis move: ``kind`` is a collective in ``COMM_KINDS`` or ``"local"``.

    ``after`` is the full placement tuple once the step is done; ``nbytes`` is the size of the
    unsharded-on-this-axis buffer per rank (the all-reduced tensor, the all-gather's output,
    the reduce-scatter's input).
    """

    axis: int
    kind: str
    after: Placements
    nbytes: int


def local_shape(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int]) -> tuple[int, ...]:
    """Per-rank shape of a tensor of global ``shape`` under ``placements`` (even shards)."""
    out = list(shape)
    for axis, p in enumerate(placements):
        if is_kind(p, _SHARDS):
            out[p.dim] //= mesh_shape[axis]
    return tuple(out)


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _shard_dim(p: Placement) -> int | None:
    return p.dim if is_kind(p, _SHARDS) else None


def _axes_to_undo(cur: list[Placement], dst: Sequence[Placement]) -> set[int]:
    ndim = len(cur)
    undo = {a for a in range(ndim) if cur[a] != dst[a] and not is_kind(cur[a], Replicate)}
    # a later axis sharding the same dim as one we change (before or after) must unwind first
    changed = True
    while changed:
        changed = False
        for a in range(ndim):
            if cur[a] == dst[a] and a not in undo:
                continue
            dims = {_shard_dim(cur[a]), _shard_dim(dst[a])} - {None}
            for b in range(a + 1, ndim):
                if b not in undo and _shard_dim(cur[b]) in dims:
                    undo.add(b)
                    changed = True
    return undo


def _can_reduce_scatter(cur: list[Placement], dst: Sequence[Placement], a: int, undo: set[int]) -> bool:
    """Whether axis ``a``'s ``Partial -> Shard(d)`` can be one reduce-scatter.

    Shards of one dim nest outer axis first. The new ``Shard(d)`` on axis ``a`` would be wrongly
    nested if an inner axis already shards d, if an outer axis is still to be sharded on d, or if
    an outer axis shards d now and is about to be gathered; then the partial sum is all-reduced
    and both axes are sharded locally, outer first.
    """
    d = _shard_dim(dst[a])
    if type(dst[a]) is not Shard:
        return False
    inner = any(_shard_dim(cur[b]) == d for b in range(a + 1, len(cur)))
    outer_pending = any(_shard_dim(dst[b]) == d and cur[b] != dst[b] for b in range(a))
    outer_undone = any(b in undo and _shard_dim(cur[b]) == d for b in range(a))
    return not (inner or outer_pending or outer_undone)


def reshard_steps(
    src: Placements, dst: Placements, shape: Sequence[int], itemsize: int, mesh_shape: Sequence[int]
) -> list[Step]:
    """The single-axis moves from ``src`` to ``dst`` placements of a tensor of global ``shape``."""
    if src == dst:
        return []
    steps = []
    for a, kind, before, after in _moves(tuple(src), tuple(dst), tuple(mesh_shape)):
        size = 0 if kind == "local" else _numel(local_shape(shape, before, mesh_shape)) * itemsize
        steps.append(Step(a, kind, after, size * mesh_shape[a] if kind == "all_gather" else size))
    return steps


@functools.lru_cache(maxsize=1 << 18)
def _moves(src: Placements, dst: Placements, mesh_shape: tuple[int, ...]
           ) -> tuple[tuple[int, str, Placements, Placements], ...]:
    """:func:`reshard_steps` without sizes, which the moves do not depend on: ``(axis, kind,
    placements before, placements after)`` per move (kept for the process: a space prices
    the same pair of placements for many tensors)."""
    cur = list(src)
    moves = []
    undo = _axes_to_undo(cur, dst)
    for a in sorted(undo, reverse=True):
        before = tuple(cur)
        if is_kind(cur[a], Partial):
            if _can_reduce_scatter(cur, dst, a, undo):
                cur[a] = dst[a]
                moves.append((a, "reduce_scatter", before, tuple(cur)))
            else:
                cur[a] = Replicate()
                moves.append((a, "all_reduce", before, tuple(cur)))
        else:  # Shard -> Replicate (also on the way to another Shard)
            cur[a] = Replicate()
            moves.append((a, "all_gather", before, tuple(cur)))
    for a in range(len(cur)):
        if cur[a] != dst[a]:
            before = tuple(cur)
            cur[a] = dst[a]
            moves.append((a, "local", before, tuple(cur)))
    return tuple(moves)
