"""Custom cost passes: adjust priced costs before the solver runs (DESIGN §5).

A cost pass is a callable ``(costs, space, topology) -> costs``. Register one globally with
``@autopar.cost_pass`` or pass it per call (``autopar.plan(..., cost_passes=[fn])``); registered
passes run first, in registration order, then per-call ones.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

__all__ = ["cost_pass", "registered_cost_passes", "clear_cost_passes", "run_cost_passes"]

CostPass = Callable[[Any, Any, Any], Any]
_PASSES: list[CostPass] = []


def cost_pass(fn: CostPass) -> CostPass:
    """Decorator: register ``fn`` to run on every plan made in this process."""
    _PASSES.append(fn)
    return fn


def registered_cost_passes() -> tuple[CostPass, ...]:
    """The globally registered cost passes, in order."""
    return tuple(_PASSES)


def clear_cost_passes() -> None:
    """Forget every registered cost pass (for tests and notebooks)."""
    _PASSES.clear()


def run_cost_passes(costs: Any, space: Any, topology: Any, extra: Sequence[CostPass] = ()) -> Any:
    """Apply registered then ``extra`` passes; each must return a costs object."""
    for fn in (*_PASSES, *extra):
        new = fn(costs, space, topology)
        if new is None:
            raise TypeError(
                f"cost pass {getattr(fn, '__name__', fn)!r} returned None; a cost pass must "
                f"return the (possibly modified) costs object it was given")
        costs = new
    return costs
