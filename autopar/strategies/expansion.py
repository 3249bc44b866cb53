"""Single-dim sharding rules expanded over the mesh with plain tuples.

Most of DTensor's rules are written for one mesh axis (``single_dim_strategy``): a list of
strategies, each a placement per output and per tensor input. DTensor's
``expand_to_full_mesh_op_strategy`` builds every combination of them over the mesh's axes as
``DTensorSpec`` objects, drops the ones whose inputs cannot be split (and, on torch 2.13, the
ones that mix partial kinds), and autopar then drops every combination that splits a tensor
unevenly (:func:`is_even`). On a three-axis mesh that is the cube of the list, and building the
specs was half of the strategy space's time (a 5-layer DeepSeek-V3 on a (16, 8, 8) mesh: 20 of
39 s under the profiler).

:func:`expand` walks the same combinations in the same order (axis 0 slowest, as
``itertools.product``), cutting a prefix as soon as a tensor is split unevenly on the axes
chosen so far, and asks DTensor's input check (``is_tensor_shardable``) only of what is left:
the strategies autopar would have kept from DTensor's expansion, in the same order. Where the
two could differ it declines (returns ``None``) and the caller asks DTensor: strided shards
(their spec checks), partial kinds that could mix on a release whose rule for them is not
read (:data:`~autopar._torch_private.MIXED_PARTIALS_DROPPED`), a position that is a
tensor in some strategies and not in others, inputs the expansion does not count as DTensor
does, and ops with no output. ``tests/unit/test_expansion.py`` compares both on every op of a
GPT's and a DeepSeek-V3's graphs on a three-axis mesh.
"""

from __future__ import annotations

from typing import Iterable, Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar._torch_private import MIXED_PARTIALS_DROPPED, MeshExpansion, _StridedShard
from autopar.errors import AutoparError
from autopar.placements import is_kind

__all__ = ["ExpansionError", "even_split", "expand", "is_even", "mixes_partials"]


class ExpansionError(AutoparError):
    """:func:`expand` failed: a bug of autopar's, raised as such (not taken for a sharding
    rule's refusal, which the strategy space works around)."""


def even_split(sizes: tuple[int, ...], p: Placement, axis_size: int,
               strided_ok: frozenset[int] = frozenset()) -> tuple[int, ...] | None:
    """``sizes`` after placement ``p`` on a mesh axis of ``axis_size`` devices, or ``None``
    when ``p`` splits unevenly (or is a strided shard of a factor not in ``strided_ok``, or a
    placement autopar does not plan over)."""
    if type(p) in (Replicate, Partial):
        return sizes
    if not is_kind(p, (Shard, _StridedShard)):
        return None  # other exotic placements are not planned over
    d = p.dim + len(sizes) if p.dim < 0 else p.dim
    factor = 1
    if is_kind(p, _StridedShard):
        if p.split_factor not in strided_ok:
            return None  # strided layouts from views (e.g. flattening a sharded seq dim)
        factor = p.split_factor
    if not 0 <= d < len(sizes) or sizes[d] % (axis_size * factor):
        return None
    return (*sizes[:d], sizes[d] // axis_size, *sizes[d + 1:])


def is_even(shape: Sequence[int], placements: Sequence[Placement], mesh_shape: Sequence[int],
            strided_ok: frozenset[int] = frozenset()) -> bool:
    """Whether ``placements`` shard ``shape`` evenly; strided shards only with a fused factor."""
    sizes: tuple[int, ...] | None = tuple(shape)
    for axis, p in enumerate(placements):
        sizes = even_split(sizes, p, mesh_shape[axis], strided_ok)
        if sizes is None:
            return False
    return True


def expand(exp: MeshExpansion, out_shapes: Sequence[tuple[int, ...] | None],
           in_shapes: Sequence[tuple[int, ...]], mesh_shape: Sequence[int],
           strided_ok: frozenset[int] = frozenset()) -> list[tuple[tuple, tuple]] | None:
    """The even strategies of ``exp`` over ``mesh_shape`` as ``(outputs, inputs)`` placements,
    in DTensor's order without repeats (an output that is not a tensor there: replicated when
    the op returns a tensor, ``None`` otherwise), or ``None`` where this walk could differ from
    DTensor's expansion (module docstring). ``out_shapes``: each output's shape (``None``: not
    a tensor); ``in_shapes``: each tensor input's."""
    rows = exp.single_dim
    width = len(rows[0]) if rows else 0
    k = exp.num_outputs
    if not rows or k < 1 or k != len(out_shapes) or any(len(r) != width for r in rows) \
            or len(mesh_shape) != exp.mesh.ndim or tuple(map(tuple, in_shapes)) != exp.input_shapes:
        return None
    present = [r is not None for r in rows[0]]
    if any((p is not None) != present[i] for r in rows for i, p in enumerate(r)) \
            or any(isinstance(p, _StridedShard) for r in rows for p in r) \
            or sum(present[k:]) != len(in_shapes) or (k == 1 and not present[0]):
        return None
    mixing = [i for i in range(width) if mixes_partials(r[i] for r in rows)] \
        if MIXED_PARTIALS_DROPPED else []
    if MIXED_PARTIALS_DROPPED is None and any(mixes_partials(r[i] for r in rows) for i in range(width)):
        return None
    inputs = [i for i in range(k, width) if present[i]]
    shapes = [tuple(out_shapes[i]) if present[i] and out_shapes[i] is not None else None
              for i in range(k)] + [tuple(in_shapes[j]) for j in range(len(inputs))]
    positions = [i for i in range(k) if shapes[i] is not None] + inputs
    sizes = [shapes[i] if i < k else shapes[k + inputs.index(i)] for i in positions]
    rep = (Replicate(),) * len(mesh_shape)
    # a tensor of static, non-zero sizes split evenly has at least one element per shard:
    # DTensor's input check (at least one per shard) holds without asking
    ask = not all(type(d) is int and d > 0 for shape in in_shapes for d in shape)
    seen: dict[tuple, None] = {}
    for chosen in _walk(rows, positions, sizes, mesh_shape, strided_ok):
        if any(mixes_partials(r[i] for r in chosen) for i in mixing):
            continue
        placed = [tuple(r[i] for r in chosen) if present[i] else None for i in range(width)]
        ins = tuple(placed[i] for i in inputs)
        if ask and not all(exp.shardable(j, p) for j, p in enumerate(ins)):
            continue
        outs = tuple(placed[i] if present[i] else rep if out_shapes[i] is not None else None
                     for i in range(k))
        seen.setdefault((outs, ins), None)
    return list(seen)


def _walk(rows: Sequence[tuple], positions: list[int], sizes: list[tuple[int, ...]],
          mesh_shape: Sequence[int], strided_ok: frozenset[int]) -> list[tuple[tuple, ...]]:
    """Every choice of one row per mesh axis (axis 0 slowest) under which each tensor at
    ``positions`` (of ``sizes``) is split evenly."""
    out: list[tuple[tuple, ...]] = []

    def step(axis: int, sizes: list[tuple[int, ...]], chosen: tuple[tuple, ...]) -> None:
        if axis == len(mesh_shape):
            out.append(chosen)
            return
        for r in rows:
            after = []
            for pos, size in zip(positions, sizes):
                size = even_split(size, r[pos], mesh_shape[axis], strided_ok)
                if size is None:
                    break
                after.append(size)
            else:
                step(axis + 1, after, (*chosen, r))

    step(0, sizes, ())
    return out


def mixes_partials(placements: Iterable[Placement | None]) -> bool:
    """Whether these placements of one tensor (over the strategies, or over the axes of one
    combination) hold more than one partial kind, sum with avg of one type excepted: torch
    2.13's expansion drops such a combination, 2.11's keeps it."""
    kinds = {(type(p), p.reduce_op) for p in placements if is_kind(p, Partial)}
    return len(kinds) > 1 and not (len({t for t, _ in kinds}) == 1
                                   and {op for _, op in kinds} == {"sum", "avg"})
