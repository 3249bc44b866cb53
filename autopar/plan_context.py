"""What the intra-operator ILP saw for a plan made in this process, kept in memory beside it.

The strategy space and its prices are not saved with a plan (JSON holds what runs); a plan made
in this process keeps them here for :func:`autopar.report.explain.explain`: the planner
:func:`attach` es them, the report finds them with :func:`context_of`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable

__all__ = ["ExplainContext", "attach", "carry", "context_of"]


@dataclass(frozen=True)
class ExplainContext:
    """What the ILP saw: the graph, strategy space, prices, chosen index per node, the memory
    budget and the ILP group of every node (linked nodes share one choice)."""

    traced: Any
    space: Any
    costs: Any
    choice: dict[str, int]
    budget: float | None
    group_of: dict[str, int]



class _Deferred:
    """A context made on first use, once (a pipeline stage placed in a worker process,
    autopar.planning.stage_workers: its strategy space is made again only if it is explained)."""

    def __init__(self, make: Callable[[], ExplainContext]) -> None:
        self._make: Callable[[], ExplainContext] | None = make
        self._ctx: ExplainContext | None = None

    def get(self) -> ExplainContext:
        if self._make is not None:
            self._ctx, self._make = self._make(), None
        return self._ctx


_CONTEXTS: dict[int, ExplainContext | _Deferred] = {}


def attach(plan: Any, ctx: ExplainContext | Callable[[], ExplainContext] | None) -> Any:
    """Keep ``ctx`` with ``plan`` (until the plan is garbage collected); returns ``plan``.
    ``ctx`` may be a function making it, called the first time :func:`context_of` asks."""
    if ctx is not None and id(plan) not in _CONTEXTS:
        _CONTEXTS[id(plan)] = ctx if isinstance(ctx, (ExplainContext, _Deferred)) else _Deferred(ctx)
        weakref.finalize(plan, _CONTEXTS.pop, id(plan), None)
    return plan


def context_of(plan: Any) -> ExplainContext | None:
    """The context :func:`attach` kept with ``plan``, or ``None``."""
    ctx = _CONTEXTS.get(id(plan))
    return ctx.get() if isinstance(ctx, _Deferred) else ctx


def carry(src: Any, dst: Any,
          change: Callable[[ExplainContext], ExplainContext] | None = None) -> Any:
    """Keep with ``dst`` (a plan made from ``src``) ``src``'s context, ``change``d, without
    making a deferred one; returns ``dst``."""
    ctx = _CONTEXTS.get(id(src))
    if ctx is None or change is None:
        return attach(dst, ctx)
    if isinstance(ctx, ExplainContext):
        return attach(dst, change(ctx))
    return attach(dst, lambda: change(ctx.get()))
