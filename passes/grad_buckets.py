"""Gradient buckets at run time: executes ``Plan.grad_buckets`` (the policy is
:mod:`autopar.planning.buckets`).

The local gradients of a bucket are flattened into one buffer and reduced with one collective
when the last of them is computed. The collective is the raw functional op, not DTensor's
(whose traced form waits at once), and always a sum: a ``Partial("avg")`` gradient is divided
by the group size first (gloo has no average, and one bucket may hold both kinds).

- An all-reduce bucket is reduced in place and waited for at the end of the program (the
  outputs), so the reduction runs while the rest of the backward computes; the results are
  views of the reduced buffer (Li et al., VLDB 2020, sec. 3.2.3).
- A reduce-scatter bucket (ZeRO: a ``Partial`` gradient becoming its parameter's ``Shard``)
  packs rank ``r``'s part of every gradient into row ``r`` of a ``(g, N / g)`` buffer, so the
  reduce-scatter leaves each rank its shard of each gradient, in order; the results are views
  of the output. Its input holds every gradient of the bucket whole until the collective is
  waited for, so each reduce-scatter bucket is waited for where the next one is issued
  (FSDP2 keeps one reduce-scatter in flight the same way: Zhao et al., "PyTorch FSDP", VLDB
  2023, sec. 4.1), the last at the end; :func:`autopar.passes.overlap.sink_waits` leaves those
  waits where they are (:data:`WAIT_HERE`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.capture.remat import marked

__all__ = ["GradientBuckets", "WAIT_HERE"]

# the key, in a lowered node's ``meta["custom"]``, of a wait the overlap pass must not move
WAIT_HERE = "autopar_wait_here"
_F = torch.ops._c10d_functional


class GradientBuckets:
    """The plan's gradient buckets, issued as their last gradient is computed (module
    docstring)."""

    def __init__(self, buckets: Sequence[Sequence[int]], mesh: Any) -> None:
        self.mesh = mesh
        self.bucket_of = {i: tuple(b) for b in buckets for i in b}
        self.local: dict[int, torch.Tensor] = {}
        self.issued: dict[tuple[int, ...], torch.Tensor] = {}
        # per bucket: (shape, permutation) of each member's part of the reduced buffer
        self.shapes: dict[tuple[int, ...], list[tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        self.owned: dict[int, bool] = {}
        self.dims: dict[int, int | None] = {}  # the dim a reduce-scatter shards a gradient on
        self.results: dict[int, torch.Tensor] = {}
        self.scattering: tuple[int, ...] | None = None  # the reduce-scatter bucket in flight

    def __contains__(self, index: int) -> bool:
        return index in self.bucket_of

    def add(self, index: int, value: DTensor, dst: tuple, owned: bool = False) -> None:
        """Gradient ``index`` is computed (``value``, Partial on one axis, ``dst`` Replicate
        or an even Shard there); issue its bucket's collective if it is the bucket's last
        gradient. ``owned``: nothing else reads the gradient or what it views, so an
        all-reduce bucket of it alone is reduced in its own memory (no copy)."""
        axes = [a for a, (p, q) in enumerate(zip(value.placements, dst)) if p != q]
        if len(axes) != 1 or not isinstance(value.placements[axes[0]], Partial) \
                or type(dst[axes[0]]) not in (Replicate, Shard):
            raise RuntimeError(f"internal: gradient output {index} is bucketed but moves "
                               f"{tuple(value.placements)} -> {dst}, not one all-reduce or "
                               f"reduce-scatter. Please report this with the model.")
        axis = axes[0]
        op = value.placements[axis].reduce_op
        if op not in ("sum", "avg"):
            raise RuntimeError(f"internal: gradient output {index} is a Partial({op!r}); "
                               f"gradient buckets reduce sums and averages. Please report this "
                               f"with the model.")
        # an average is a sum of the ranks' parts divided by their number, divided first: one
        # bucket may hold both kinds, and the collective is always a sum (gloo has no
        # average: a bucket all-reduced with "avg" there came back summed, 2x the gradient)
        self.local[index] = value.to_local() / self.mesh.size(axis) if op == "avg" \
            else value.to_local()
        self.owned[index] = owned
        self.dims[index] = dst[axis].dim if isinstance(dst[axis], Shard) else None
        bucket = self.bucket_of[index]
        if index != bucket[-1]:
            return
        missing = [i for i in bucket if i not in self.local]
        if missing:
            raise RuntimeError(f"internal: gradient bucket {bucket} issued before gradients "
                               f"{missing} were computed. Please report this with the model.")
        group = self.mesh.get_group(axis).group_name
        op = "sum"
        if isinstance(dst[axis], Shard):
            self._reduce_scatter(bucket, op, self.mesh.size(axis), group)
        else:
            self._all_reduce(bucket, op, group)

    def _all_reduce(self, bucket: tuple[int, ...], op: str, group: str) -> None:
        # each gradient flattened in its memory order (a transposed one through its transpose:
        # no copy before the one into the bucket)
        parts = [_dense_permutation(self.local.pop(i)) for i in bucket]
        self.shapes[bucket] = [(tuple(x.shape), perm) for x, perm in parts]
        alone = parts[0][0] if len(bucket) == 1 and self.owned[bucket[0]] else None
        if alone is not None and alone.is_contiguous() and alone.storage_offset() == 0 \
                and alone.untyped_storage().nbytes() == alone.numel() * alone.element_size():
            flat = alone.reshape(-1)  # the gradient's own memory
        else:
            flat = torch.cat([x.reshape(-1) for x, _ in parts])
        # in place: the buffer is the bucket's own (the out-of-place op would copy it first)
        self.issued[bucket] = _F.all_reduce_.default(flat, op, group)

    def _reduce_scatter(self, bucket: tuple[int, ...], op: str, size: int, group: str) -> None:
        """Row ``r`` of the packed buffer: rank ``r``'s part (on its shard dim) of each
        gradient, in one copy (``_chunk_cat``, as FSDP2 packs its reduce-scatter); a gradient
        sharded on a dim > 0 is packed through a view with that dim first, and its shard is
        viewed back."""
        moved, self.shapes[bucket] = [], []
        for i in bucket:
            g, dim = self.local.pop(i), self.dims[i]
            perm = (dim, *(d for d in range(g.dim()) if d != dim))
            moved.append(g.permute(perm))
            self.shapes[bucket].append(((g.shape[dim] // size, *moved[-1].shape[1:]), perm))
        packed = torch.ops.aten._chunk_cat.default(moved, 0, size)
        if self.scattering is not None:  # one in flight: the one before frees its input now
            with marked(WAIT_HERE, True):
                self._wait(self.scattering)
        self.issued[bucket] = _F.reduce_scatter_tensor.default(packed.view(-1), op, size, group)
        self.scattering = bucket

    def _wait(self, bucket: tuple[int, ...]) -> None:
        reduced = _F.wait_tensor.default(self.issued.pop(bucket))
        shapes = self.shapes[bucket]
        parts = torch.split(reduced, [math.prod(s) for s, _ in shapes])
        for i, part, (shape, perm) in zip(bucket, parts, shapes):
            inverse = sorted(range(len(perm)), key=perm.__getitem__)
            self.results[i] = part.view(shape).permute(inverse)
        if bucket == self.scattering:
            self.scattering = None

    def result(self, index: int) -> torch.Tensor:
        """The reduced local gradient ``index`` (waits for its bucket the first time)."""
        if index not in self.results:
            self._wait(self.bucket_of[index])
        return self.results[index]


def _dense_permutation(x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``(x.permute(perm), perm)`` with ``x.permute(perm)`` contiguous when ``x`` is a
    permutation of a contiguous tensor (a transposed gradient); else ``(x, identity)``."""
    perm = tuple(sorted(range(x.dim()), key=lambda d: -x.stride(d)))
    y = x.permute(perm)
    if y.is_contiguous():
        return y, perm
    return x, tuple(range(x.dim()))
