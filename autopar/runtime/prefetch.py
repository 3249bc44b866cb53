"""ZeRO-3 in a pipeline: each gather of a stage's parameters issued one action ahead.

A ZeRO-3 pipeline stage gathers its parameters for every microbatch's forward and again for
its backward (``runtime.pipeline``). The order in which a rank runs its actions is fixed by the
schedule (``autopar.cost_models.pipeline.action_order``, the orders torch's schedule classes
run), so the gather an action will need is known before it starts: :class:`GatherAhead` issues
it when the action before it on the rank takes its own gather, and it travels while that
action computes (FSDP2 prefetches the next ``fully_shard`` unit the same way). A rank then
holds two stages' parameters at most: the computing action's copy and the next one's buffer
in flight, as the plan's memory counts them (``cost_models.liveness.step_memory``,
``planning.pipeline``). The plan prices the overlap with the same order
(``cost_models.pipeline.simulate``'s ``gather_s``).
"""

from __future__ import annotations

import warnings
from typing import Callable, Mapping, Sequence

import torch

__all__ = ["GatherAhead", "Issue", "gathering_stages"]

# a stage's gather: issues its collectives and returns the callable that waits for them and
# gives the parameters (local tensors by model name)
Issue = Callable[[], Callable[[], dict[str, torch.Tensor]]]


def gathering_stages(order: Sequence[tuple[str, int, int]], stages: set[int]) -> tuple[int, ...]:
    """The stage of each action of one rank's ``order`` (``cost_models.pipeline.
    action_order``) that gathers parameters: every forward and every backward that computes
    input gradients (``"F"``, ``"BW"``, ``"B"``; a split backward's weight step ``"W"`` reads
    what its input step kept), of the ``stages`` that gather."""
    return tuple(stage for kind, stage, _ in order if kind in ("F", "BW", "B") and stage in stages)


class GatherAhead:
    """One rank's ZeRO-3 stage gathers, each issued while the action before it computes.

    ``order``: the stage of every gathering action of a step, in the order the rank runs them
    (:func:`gathering_stages`); ``issue``: each such stage's :data:`Issue`. :meth:`take` is
    called by an action for its stage's parameters: it waits for the gather issued for it one
    action earlier (the step's first is issued then and waited at once) and issues the next
    action's. Should the schedule run another stage than ``order`` says, that action gathers at
    once (a warning says so: the plan counted one gather per action, not the dropped one), and
    the step's later gathers are no longer issued ahead.
    """

    def __init__(self, order: Sequence[int], issue: Mapping[int, Issue]) -> None:
        missing = sorted(set(order) - set(issue))
        if missing:
            raise ValueError(f"GatherAhead: the order gathers stages {missing}, which have no "
                             f"gather (stages with one: {sorted(issue)}).")
        self.order = tuple(order)
        self._issue = dict(issue)
        self._next = 0
        self._ahead = True
        self._pending: tuple[int, Callable[[], dict[str, torch.Tensor]]] | None = None
        self.issued = 0  # gathers issued, over all steps (each is one collective per bucket)

    def start_step(self) -> None:
        """Start a step: a gather left in flight by a step that failed is waited for and
        dropped (every rank of the group issued it)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending[1]()
        self._next, self._ahead = 0, True

    def _start(self, stage: int) -> Callable[[], dict[str, torch.Tensor]]:
        self.issued += 1
        return self._issue[stage]()

    def take(self, stage: int) -> dict[str, torch.Tensor]:
        """``stage``'s parameters for the action now starting; issues the next action's gather."""
        k, self._next = self._next, self._next + 1
        pending, self._pending = self._pending, None
        expected = self._ahead and k < len(self.order) and self.order[k] == stage
        if pending is not None and expected and pending[0] == stage:
            out = pending[1]()
        else:
            if pending is not None:
                pending[1]()  # (issued for another action: waited for, dropped)
            if self._ahead and not expected:
                self._ahead = False
                planned = self.order[k] if k < len(self.order) else None
                warnings.warn(
                    f"ZeRO-3 pipeline: action {k} of this rank's step gathered stage {stage}'s "
                    f"parameters where the schedule's order (cost_models.pipeline.action_order) "
                    f"has {'stage %d' % planned if planned is not None else 'no gather'}; the "
                    f"step's later gathers are made at once, and the run's all-gathers differ "
                    f"from the plan's. Please report it with the schedule and its sizes.",
                    RuntimeWarning, stacklevel=2)
            out = self._start(stage)()
        if self._ahead and k + 1 < len(self.order):
            nxt = self.order[k + 1]
            self._pending = (nxt, self._start(nxt))
        return out
