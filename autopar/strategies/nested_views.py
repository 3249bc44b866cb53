"""Views that merge or split two dims each split on its own mesh axes, one block per rank on
the outer one's: ``[B, s, h] -> [B * s, h]`` with the batch split over dp (``B`` = the dp
degree: one sequence a rank) and the sequence over cp, and back.

DTensor's view rule keeps only the first split of a flattened group (the sequence's split is
given up: ``propagate_shape_and_sharding`` asks the input replicated on cp), so a plan with
dp > 1 and cp > 1 computed every linear layer of a traced model (which flattens batch and
sequence before its matmul) whole on each cp rank. When the outer dim holds one block per rank
of its axis, the rank's block of the merged dim is the rank's block of the inner dim, and the
two splits nest as DTensor nests two ``Shard`` of one dim (the earlier mesh axis outermost):
``(Shard(d) on a, Shard(d + 1) on b)`` on the input is ``(Shard(d), Shard(d))`` on the output,
a local view on every rank. The outer dim may be split over several axes (the batch over the
two axes of sharded data parallelism, or over dp and ep) and the inner over several, as long as
every outer axis comes before every inner one.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch.distributed.tensor import Shard

__all__ = ["VIEW_OPS", "nested_view_strategies"]

# the views the lowering runs on local tensors (passes.lower; a traced reshape decomposes to them)
VIEW_OPS = frozenset({torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default})


def nested_view_strategies(in_shape: Sequence[int], out_shape: Sequence[int],
                           candidates: Sequence[tuple], mesh_shape: Sequence[int]
                           ) -> list[tuple[tuple, tuple]]:
    """``(input placements, output placements)`` (one placement per mesh axis) of the view
    ``in_shape -> out_shape`` for the input ``candidates`` that split two neighbouring dims
    the view merges (or that it splits back) on disjoint mesh axes, the outer dim's axes all
    before the inner dim's and the outer dim one block per rank of its axes (its size the
    product of their sizes). Any strided split gives none. Empty when the view merges or
    splits no such pair."""
    merge = _merged_dim(in_shape, out_shape)
    split = _merged_dim(out_shape, in_shape)
    if merge is None and split is None:
        return []
    out = []
    for pl in candidates:
        mapped = _merge(pl, merge, in_shape, mesh_shape) if merge is not None \
            else _split(pl, split, out_shape, mesh_shape)
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


def _on(pl: tuple, dim: int) -> list[int]:
    """The mesh axes that split ``dim`` with a plain ``Shard``, in order."""
    return [axis for axis, p in enumerate(pl) if type(p) is Shard and p.dim == dim]


def _remap(pl: tuple, to: dict[int, int], shift: int, beyond: int) -> tuple | None:
    """``pl`` with the axes of ``to`` split on their dim there, and every other split of a dim
    past ``beyond`` moved by ``shift``; None if ``pl`` has a strided split."""
    out = []
    for axis, p in enumerate(pl):
        if axis in to:
            out.append(Shard(to[axis]))
        elif type(p) is Shard:
            out.append(Shard(p.dim + shift) if p.dim > beyond else p)
        elif hasattr(p, "dim"):  # (a strided split)
            return None
        else:
            out.append(p)
    return tuple(out)


def _merge(pl: tuple, d: int, in_shape: Sequence[int], mesh_shape: Sequence[int]
           ) -> tuple | None:
    """The placements of the merged view of ``pl`` (dims ``d``, ``d + 1`` into ``d``)."""
    outer, inner = _on(pl, d), _on(pl, d + 1)
    if not outer or not inner or max(outer) > min(inner) \
            or math.prod(mesh_shape[a] for a in outer) != in_shape[d]:
        return None
    return _remap(pl, {a: d for a in outer + inner}, -1, d + 1)


def _split(pl: tuple, d: int, out_shape: Sequence[int], mesh_shape: Sequence[int]
           ) -> tuple | None:
    """The placements of the view of ``pl`` splitting dim ``d`` into ``d``, ``d + 1`` (the
    reverse of :func:`_merge`)."""
    axes = _on(pl, d)
    for k in range(1, len(axes)):
        if math.prod(mesh_shape[a] for a in axes[:k]) == out_shape[d]:
            return _remap(pl, {a: d if i < k else d + 1 for i, a in enumerate(axes)}, 1, d)
    return None
