"""The balanced layout of the sequence over the cp axis (causal attention's work evened out).

Under a causal mask, the queries late in the sequence attend to more keys than the early ones,
so a contiguous split of the sequence over ``n`` cp ranks leaves the last rank about twice the
average attention work. Megatron-LM and torchtitan cut the sequence into ``2n`` chunks and give
rank ``r`` chunks ``r`` and ``2n - 1 - r``: every rank then holds one early and one late chunk,
and each does the same work (Megatron-LM's ``get_batch_on_this_cp_rank``; torchtitan's
``_HeadTailLoadBalancer``).

How autopar holds it: a value split on the cp axis holds, as its DTensor, that dim in
*arranged* order, the chunks ``0, 2n-1, 1, 2n-2, ...``, so that DTensor's contiguous split of
it gives rank ``r`` its pair (every dim split there, not only the sequence's: see
:class:`SequenceLayout`). Every op that DTensor's rules keep split on that dim computes each position independently of where it sits (pointwise, matmul
rows, norms over another dim, the loss's sum), so it gives the same values in any order
(random ops aside: a dropout mask drawn for arranged positions is another draw); the
moves in and out of a split on the cp axis (:func:`autopar.passes.lower.reshard`) arrange a
value before it is split and restore the natural order after it is gathered, and the ops that
depend on where a position is (attention's causal mask: ``passes.seq_attention`` and
``passes.ring_attention``) ask :meth:`SequenceLayout.positions`. The program's inputs are
arranged by the runtime before they are split (:meth:`SequenceLayout.arrange_input`).

Requires: every dim split on the cp axis divisible by ``2n`` (per part of a strided split); a
dim the layout reorders split on no other axis at that move (both checked, with clear errors).
Guarantees: every rank holds the same number of positions, its pair of chunks in ascending
order, and a value gathered over cp is in the natural order again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.tensor import DTensor, Shard

from autopar._torch_private import _StridedShard

__all__ = ["SequenceLayout", "layout_of_plan", "query_runs"]


@dataclass(frozen=True)
class SequenceLayout:
    """The balanced layout on mesh axis ``axis`` of ``ranks`` ranks (the cp degree).

    Every value split on that axis is held arranged: a ``Shard(d)`` dim cut into ``2 * ranks``
    chunks in the order of :meth:`order`, each of the ``k`` parts of a ``_StridedShard(d, k)``
    likewise (DTensor's strided split: a concatenation of values split on ``d``). Arranging
    every split dim, not only the sequence's, keeps two dims that an op relates (a view's
    merged dims, a matmul's contracted ones, a concatenation's parts) in the same order;
    parameters are never split on the cp axis (``planning.solve``), so nothing arranged is
    stored."""

    axis: int
    ranks: int

    def order(self) -> list[int]:
        """The natural chunks in arranged order: rank r's pair at places 2r and 2r + 1."""
        n = self.ranks
        return [c for r in range(n) for c in (r, 2 * n - 1 - r)]

    def divides(self, placement: Any, shape: Sequence[int]) -> bool:
        """Whether a value of ``shape`` placed ``placement`` on the cp axis can be held
        arranged: not split there, or its dim (each part of a strided split) cut into the
        ``2 * ranks`` chunks."""
        if not isinstance(placement, (Shard, _StridedShard)):
            return True
        parts = _parts(placement)
        return shape[placement.dim] % (parts * 2 * self.ranks) == 0

    def follows(self, placement: Any, shape: Sequence[int]) -> bool:
        """Whether a value of ``shape`` placed ``placement`` on the cp axis is held arranged
        (split there); an error if it cannot be (:meth:`divides`)."""
        if not isinstance(placement, (Shard, _StridedShard)):
            return False
        if not self.divides(placement, shape):
            raise NotImplementedError(
                f"the balanced cp layout cuts a dim split over cp into 2 x cp = "
                f"{2 * self.ranks} chunks; dim {placement.dim} of a value of shape "
                f"{tuple(shape)} planned {placement} there does not divide. Use "
                f"Config(cp_layout='contiguous') for this model.")
        return True

    def positions(self, length: int, start: int, count: int, device: Any = None) -> torch.Tensor:
        """The natural positions of the arranged positions ``[start, start + count)`` of a
        dim of ``length``."""
        chunk = length // (2 * self.ranks)
        natural = torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                             for c in self.order()])
        return natural[start:start + count]

    def arrange_input(self, x: torch.Tensor, placements: Sequence[Any]) -> torch.Tensor:
        """A whole input in the order its split on the cp axis needs (``x`` if it is not split
        there)."""
        p = placements[self.axis]
        if not self.follows(p, x.shape):
            return x
        return self._permute(x, p, self.order())

    def restore_input(self, x: torch.Tensor, placements: Sequence[Any]) -> torch.Tensor:
        """The inverse of :meth:`arrange_input`: a whole tensor held arranged back in natural
        order."""
        p = placements[self.axis]
        if not self.follows(p, x.shape):
            return x
        order = self.order()
        return self._permute(x, p, [order.index(c) for c in range(len(order))])

    def arrange(self, x: DTensor, placement: Any) -> DTensor:
        """``x`` (its ``placement.dim`` split on no axis) in the order ``placement`` on the cp
        axis needs."""
        return self._local(x, placement, self.order())

    def restore(self, x: DTensor, placement: Any) -> DTensor:
        """``x`` gathered from ``placement`` on the cp axis (its dim split on no axis), back in
        natural order."""
        order = self.order()
        return self._local(x, placement, [order.index(c) for c in range(len(order))])

    def _local(self, x: DTensor, placement: Any, order: list[int]) -> DTensor:
        dim = placement.dim
        # (an earlier axis's plain split holds whole sequences a block: each rank's block is
        # arranged as one, nested_views)
        split = [a for a, p in enumerate(x.placements)
                 if isinstance(p, (Shard, _StridedShard)) and p.dim == dim
                 and not (a < self.axis and type(p) is Shard and type(placement) is Shard)]
        if split:
            raise NotImplementedError(
                f"the balanced cp layout reorders dim {dim} of a value of shape "
                f"{tuple(x.shape)} placed {tuple(x.placements)}, which mesh axes {split} split "
                f"too: autopar reorders a whole dim only. Use Config(cp_layout='contiguous') "
                f"(or sequence_parallel=False) for this model.")
        local = self._permute(x.to_local(), placement, order)
        return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False,
                                  shape=x.shape, stride=x.stride())

    def _permute(self, x: torch.Tensor, placement: Any, order: list[int]) -> torch.Tensor:
        dim, n = placement.dim, 2 * self.ranks
        parts = x.chunk(_parts(placement), dim)
        if any(part.shape[dim] % n for part in parts):  # (a block of a nested split too short)
            raise NotImplementedError(
                f"the balanced cp layout cuts each sequence into {n} chunks, but dim {dim} of a "
                f"block of shape {tuple(x.shape)} ({_parts(placement)} part(s)) does not "
                f"divide into them. Use Config(cp_layout='contiguous') for this model.")
        return torch.cat([part.chunk(n, dim)[c] for part in parts for c in order], dim)


def _parts(placement: Any) -> int:
    """How many parts a split has: a ``_StridedShard``'s split factor, 1 for ``Shard``."""
    return getattr(placement, "split_factor", 1)


def layout_of_plan(plan: Any) -> SequenceLayout | None:
    """The plan's balanced layout, or ``None`` (no cp axis, or the contiguous split). A
    pipelined plan's stages must all hold the sequence as the plan does (their programs pass
    it on to each other): checked."""
    pipeline = getattr(plan, "pipeline", None)
    if pipeline is not None:
        layouts = {s.techniques.get("cp_layout", "contiguous") for s in pipeline.stages}
        if layouts - {plan.techniques.get("cp_layout", "contiguous")}:
            raise ValueError(f"internal: the plan's pipeline stages hold the sequence over cp "
                             f"as {sorted(layouts)}, the plan as "
                             f"{plan.techniques.get('cp_layout')!r}. Please report this with "
                             f"the model.")
    if plan.techniques.get("cp_layout", "contiguous") != "balanced" or "cp" not in plan.axis_names:
        return None
    axis = plan.axis_names.index("cp")
    return SequenceLayout(axis, plan.mesh_shape[axis])


def query_runs(length: int, start: int, count: int, layout: SequenceLayout | None = None
               ) -> list[tuple[int, int, int]]:
    """A rank's rows ``[start, start + count)`` of a dim of ``length`` as runs of consecutive
    natural positions ``(first row, its position, count)``: one run, or with a balanced
    ``layout`` (the dim held arranged) one per chunk the rows hold, neighbours joined."""
    if layout is None:
        return [(0, start, count)]
    chunk = length // (2 * layout.ranks)
    order = layout.order()
    runs: list[tuple[int, int, int]] = []
    row, end = 0, start + count
    for i in range(start // chunk, -(-end // chunk)):
        lo, hi = max(start, i * chunk), min(end, (i + 1) * chunk)
        pos = order[i] * chunk + lo - i * chunk
        if runs and runs[-1][1] + runs[-1][2] == pos:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + hi - lo)
        else:
            runs.append((row, pos, hi - lo))
        row += hi - lo
    return runs
