"""Views that merge or split two dims each split on its own mesh axis, one block per rank on
the outer one: ``[B, s, h] -> [B * s, h]`` with the batch split over dp (``B`` = the dp
degree: one sequence a rank) and the sequence over cp, and back.

DTensor's view rule keeps only the first split of a flattened group (the sequence's split is
given up: ``propagate_shape_and_sharding`` asks the input replicated on cp), so a plan with
dp > 1 and cp > 1 computed every linear layer of a traced model (which flattens batch and
sequence before its matmul) whole on each cp rank. When the outer dim holds one block per rank
of its axis, the rank's block of the merged dim is the rank's block of the inner dim, and the
two splits nest as DTensor nests two ``Shard`` of one dim (the earlier mesh axis outermost):
``(Shard(d) on a, Shard(d + 1) on b)`` on the input is ``(Shard(d), Shard(d))`` on the output,
a local view on every rank.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch.distributed.tensor import Shard

__all__ = ["VIEW_OPS", "nested_view_strategies"]

VIEW_OPS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default,
                      torch.ops.aten.reshape.default})

Placements = tuple  # (one placement per mesh axis)


def nested_view_strategies(in_shape: Sequence[int], out_shape: Sequence[int],
                           candidates: Sequence[Placements], mesh_shape: Sequence[int]
                           ) -> list[tuple[Placements, Placements]]:
    """``(input placements, output placements)`` of the view ``in_shape -> out_shape`` for the
    input ``candidates`` that split two neighbouring dims, merged (or split) by the view, over
    two mesh axes, the outer dim one block per rank of the earlier axis. Every other axis must
    split no dim the view changes. Empty when the view merges or splits no such pair."""
    merge = _merged_dim(in_shape, out_shape)
    split = _merged_dim(out_shape, in_shape)
    out = []
    for pl in candidates:
        if merge is not None:
            mapped = _merge(pl, merge, in_shape, mesh_shape)
        elif split is not None:
            mapped = _split(pl, split, out_shape, mesh_shape)
        else:
            return []
        if mapped is not None:
            out.append((tuple(pl), mapped))
    return out


def _merged_dim(wide: Sequence[int], narrow: Sequence[int]) -> int | None:
    """The dim ``d`` where ``wide``'s dims ``d`` and ``d + 1`` are ``narrow``'s dim ``d``, all
    others equal; None if the view is not that."""
    if len(wide) != len(narrow) + 1:
        return None
    for d in range(len(narrow)):
        if (tuple(wide[:d]) == tuple(narrow[:d]) and wide[d] * wide[d + 1] == narrow[d]
                and tuple(wide[d + 2:]) == tuple(narrow[d + 1:])):
            return d
    return None


def _pair(pl: Placements, outer: int, inner: int, outer_size: int,
          mesh_shape: Sequence[int]) -> tuple[int, int] | None:
    """The mesh axes (a, b), a < b, splitting dims ``outer`` and ``inner``, the outer dim one
    block per rank of a; None if ``pl`` does not split them so."""
    on = {}
    for axis, p in enumerate(pl):
        if type(p) is Shard and p.dim in (outer, inner):
            if p.dim in on:
                return None
            on[p.dim] = axis
    if set(on) != {outer, inner} or on[outer] > on[inner] or outer_size != mesh_shape[on[outer]]:
        return None
    return on[outer], on[inner]


def _merge(pl: Placements, d: int, in_shape: Sequence[int], mesh_shape: Sequence[int]
           ) -> Placements | None:
    axes = _pair(pl, d, d + 1, in_shape[d], mesh_shape)
    if axes is None:
        return None
    out = []
    for axis, p in enumerate(pl):
        if axis in axes:
            out.append(Shard(d))
        elif type(p) is Shard:
            out.append(Shard(p.dim - 1) if p.dim > d + 1 else p)
        elif hasattr(p, "dim"):  # (a strided shard: not handled)
            return None
        else:
            out.append(p)
    return tuple(out)


def _split(pl: Placements, d: int, out_shape: Sequence[int], mesh_shape: Sequence[int]
           ) -> Placements | None:
    on = [axis for axis, p in enumerate(pl) if type(p) is Shard and p.dim == d]
    if len(on) != 2 or out_shape[d] != mesh_shape[on[0]]:
        return None
    out = []
    for axis, p in enumerate(pl):
        if axis in on:
            out.append(Shard(d if axis == on[0] else d + 1))
        elif type(p) is Shard:
            out.append(Shard(p.dim + 1) if p.dim > d else p)
        elif hasattr(p, "dim"):
            return None
        else:
            out.append(p)
    return tuple(out)
