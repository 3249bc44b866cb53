"""What the intra-operator ILP saw for a plan made in this process, kept in memory beside it.

The strategy space and its prices are not saved with a plan (JSON holds what runs); a plan made
in this process keeps them here for :func:`autopar.report.explain.explain`: the planner
:func:`attach` es them, the report finds them with :func:`context_of`.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

__all__ = ["ExplainContext", "attach", "context_of"]


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



_CONTEXTS: dict[int, ExplainContext] = {}


def attach(plan: Any, ctx: ExplainContext | None) -> Any:
    """Keep ``ctx`` with ``plan`` (until the plan is garbage collected); returns ``plan``."""
    if ctx is not None and id(plan) not in _CONTEXTS:
        _CONTEXTS[id(plan)] = ctx
        weakref.finalize(plan, _CONTEXTS.pop, id(plan), None)
    return plan


def context_of(plan: Any) -> ExplainContext | None:
    """The context :func:`attach` kept with ``plan``, or ``None``."""
    return _CONTEXTS.get(id(plan))
