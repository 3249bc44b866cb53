"""Step time with communication overlapping compute, as the lowered program runs it.

The per-rank program (``autopar.passes.overlap``) issues each collective as soon as its input
exists and waits for it only where its result is first used; the gradient buckets are issued
when their last gradient exists and waited for at the end of the step. One rank computes one
node at a time while its collectives run one after another in issue order (one communication
channel per rank, as gloo's and NCCL's per-group queues serialise them), so a collective hides
behind the compute between its issue and its first use: the overlap of data-parallel gradient
buckets with the backward (Li et al., "PyTorch Distributed", VLDB 2020, sec. 3.2.3) and of a
column-parallel layer's input-gradient all-reduce with its weight-gradient GEMM (Narayanan et
al., SC'21, sec. 4.2). Contention between the two for memory bandwidth or cores is not modelled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["Comm", "overlapped_step_time"]


@dataclass(frozen=True)
class Comm:
    """One collective: issued once node ``start_after`` is computed (``None``: at the start),
    needed before node ``needed_by`` runs (``None``: by the end of the step), taking
    ``seconds`` on the channel."""

    start_after: str | None
    needed_by: str | None
    seconds: float


def overlapped_step_time(order: Sequence[str], compute_s: Mapping[str, float],
                         comms: Sequence[Comm]) -> float:
    """Seconds of one step: the nodes of ``order`` computed one after another (``compute_s``,
    0 for nodes not in it), each waiting for the collectives it needs; the collectives run one
    at a time in the order of ``comms``, each from the later of its issue and the end of the
    one before. Equals ``sum(compute) + sum(comm)`` when every collective is needed right where
    it is issued, and ``max`` of the two sums at best."""
    issued_after: dict[str | None, list[int]] = {}
    needed: dict[str | None, list[int]] = {}
    for k, c in enumerate(comms):
        issued_after.setdefault(c.start_after, []).append(k)
        needed.setdefault(c.needed_by, []).append(k)
    channel = _Channel(comms)
    t = 0.0
    channel.issue(issued_after.get(None, []), t)
    for name in order:
        for k in needed.get(name, []):
            t = max(t, channel.finish(k, t))
        t += compute_s.get(name, 0.0)
        channel.issue(issued_after.get(name, []), t)
    for k in range(len(comms)):
        t = max(t, channel.finish(k, t))
    return t


class _Channel:
    """The collectives of one rank, run one at a time in list order."""

    def __init__(self, comms: Sequence[Comm]) -> None:
        self.comms, self.free, self.done = comms, 0.0, {}
        self.ready: dict[int, float] = {}  # issued: when

    def issue(self, ks: Sequence[int], now: float) -> None:
        for k in ks:
            self.ready[k] = now
        self._run()

    def _run(self) -> None:
        k = len(self.done)
        while k in self.ready:
            self.free = max(self.free, self.ready[k]) + self.comms[k].seconds
            self.done[k] = self.free
            k += 1

    def finish(self, k: int, now: float) -> float:
        """When collective ``k`` ends; one needed before the model saw it issued (its place
        is approximate) is issued now, with those before it."""
        if k not in self.done:
            for j in range(len(self.done), k + 1):
                self.ready.setdefault(j, now)
            self._run()
        return self.done[k]
