"""Resharding prices: the seconds of the collectives that move a tensor between two placements
on a mesh (:func:`autopar.strategies.reshard.reshard_steps`, each priced per mesh axis with the
alpha-beta model, :func:`~autopar.cost_models.comm.axis_collective_time`), kept for the process
per mesh and topology, and the [producer strategy, consumer strategy] matrices of a space's
edges (:func:`autopar.cost_models.sharding.price_space`).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from autopar.cost_models.comm import axis_collective_time, axis_strides
from autopar.cost_models.topology import Topology
from autopar.strategies.reshard import reshard_steps
from autopar.strategies.space import Placements, Strategy

__all__ = ["edge_matrix", "pricer", "reshard_time"]


def reshard_time(src: Placements, dst: Placements, shape: tuple[int, ...], itemsize: int,
                 mesh_shape: tuple[int, ...], topology: Topology) -> float:
    """Seconds to move a tensor from ``src`` to ``dst`` placements (sum of its collectives)."""
    return pricer(mesh_shape, topology)(src, dst, shape, itemsize)


def _reshard_time(src: Placements, dst: Placements, shape: tuple[int, ...], itemsize: int,
                  mesh_shape: tuple[int, ...], topology: Topology) -> float:
    strides = axis_strides(mesh_shape)
    total = 0.0
    for step in reshard_steps(src, dst, shape, itemsize, mesh_shape):
        if step.kind != "local":
            total += axis_collective_time(step.kind, step.nbytes, mesh_shape[step.axis],
                                          strides[step.axis], topology)
    return total


_PRICERS: dict[tuple[tuple[int, ...], int], Any] = {}


def pricer(mesh_shape: tuple[int, ...], topo: Topology) -> Any:
    """A memoised ``(src, dst, shape, itemsize) -> seconds`` for one mesh and topology."""
    key = (mesh_shape, id(topo))
    hit = _PRICERS.get(key)
    if hit is None or hit[0] is not topo:
        cache: dict[tuple, float] = {}

        def price(src: Placements, dst: Placements, shape: tuple[int, ...], item: int) -> float:
            k = (src, dst, shape, item)
            v = cache.get(k)
            if v is None:
                v = cache[k] = _reshard_time(src, dst, shape, item, mesh_shape, topo)
            return v

        hit = _PRICERS[key] = (topo, price)
    return hit[1]


def edge_matrix(src: Sequence[Strategy], idx: int, dst: Sequence[Strategy], k: int,
                 val: torch.Tensor, mesh_shape: tuple[int, ...], topo: Topology) -> np.ndarray:
    """[producer strategy, consumer strategy] resharding seconds; priced once per distinct pair
    of placements (many strategies share an output or input placement)."""
    shape, item = tuple(val.shape), val.element_size()
    src_u: dict[Any, int] = {}  # distinct placements, in order of first use
    dst_u: dict[Any, int] = {}
    si = [src_u.setdefault(s.outputs[idx], len(src_u)) for s in src]
    di = [dst_u.setdefault(t.inputs[k], len(dst_u)) for t in dst]
    return _distinct_matrix(tuple(src_u), tuple(dst_u), shape, item, mesh_shape, topo)[np.ix_(si, di)]


_MATRICES: dict[tuple, tuple[Topology, np.ndarray]] = {}
_MATRICES_BYTES = 1 << 27  # (what the kept matrices may hold; the oldest go first)
_matrices_held = 0


def _distinct_matrix(src: tuple[Placements, ...], dst: tuple[Placements, ...], shape: tuple[int, ...],
                     item: int, mesh_shape: tuple[int, ...], topo: Topology) -> np.ndarray:
    """[src placements, dst placements] resharding seconds, kept for the process by the two
    lists (many edges list the same placements: DeepSeek-V3's first pipeline stage prices 593k
    pairs over 966 edges, each pair's key hashing six placements). Shared: never change it.
    A matrix over ``_MATRICES_BYTES`` alone empties the memo and is kept by itself."""
    global _matrices_held
    key = (src, dst, shape, item, mesh_shape, id(topo))  # (kept with it: its id is not reused)
    hit = _MATRICES.get(key)
    if hit is not None:
        return hit[1]
    price = pricer(mesh_shape, topo)
    small = np.array([[price(a, b, shape, item) for b in dst] for a in src]).reshape(len(src), len(dst))
    while _MATRICES and _matrices_held + small.nbytes > _MATRICES_BYTES:
        _matrices_held -= _MATRICES.pop(next(iter(_MATRICES)))[1].nbytes
    _MATRICES[key] = (topo, small)
    _matrices_held += small.nbytes
    return small
