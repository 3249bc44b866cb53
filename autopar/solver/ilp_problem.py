"""The intra-operator sharding problem as data (:class:`ILPProblem`, its edges and its
solution), its validation, exact evaluation and memory floor, and the error a budget below that
floor raises; :mod:`autopar.solver.ilp` solves it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from autopar.errors import PlanError

__all__ = ["evaluate_choice", "format_bytes", "group_name", "ILPEdge", "ILPProblem", "ILPSolution",
           "infeasible_error", "InfeasibleMemoryError", "min_memory_bytes", "validate_problem"]


@dataclass(frozen=True)
class ILPEdge:
    """Resharding cost between two variable groups.

    ``cost[s, t]`` (seconds, >= 0, already multiplied by multiplicity) is paid when
    ``src`` uses strategy ``s`` and ``dst`` uses ``t``.  ``src == dst`` is allowed.
    """

    src: int
    dst: int
    cost: np.ndarray


@dataclass(frozen=True)
class ILPProblem:
    """One intra-operator sharding problem; the math is in :mod:`autopar.solver.ilp`'s docstring."""

    node_costs: tuple[np.ndarray, ...]
    node_memory: tuple[np.ndarray, ...]
    edges: tuple[ILPEdge, ...]
    memory_budget: float | None
    memory_constant: float = 0.0
    time_limit_s: float = 30.0
    names: tuple[str, ...] | None = None


@dataclass(frozen=True)
class ILPSolution:
    """Result of :func:`solve_ilp` (or :func:`brute_force`).

    ``status`` is ``"optimal"`` (proven, or within the 1e-4 relative MIP gap) or
    ``"feasible"`` (time limit hit with a larger gap; the caller should warn).
    ``gap`` is 0.0 for the LP relaxation, presolve and brute force.
    ``objective`` and ``memory_bytes`` are evaluated exactly on the original
    problem for ``choice``.
    """

    choice: tuple[int, ...]
    objective: float
    status: str
    gap: float
    solve_time_s: float
    backend: str
    num_variables: int
    num_constraints: int
    memory_bytes: float


class InfeasibleMemoryError(PlanError, ValueError):
    """No choice of strategies fits the per-device memory budget."""

    def __init__(self, message: str, required_bytes: float, budget_bytes: float) -> None:
        super().__init__(message)
        self.required_bytes = required_bytes
        self.budget_bytes = budget_bytes


def group_name(problem: ILPProblem, g: int) -> str:
    """``group g``, with its name when the problem names its groups (for messages)."""
    if problem.names is not None and g < len(problem.names):
        return f"group {g} ({problem.names[g]!r})"
    return f"group {g}"


def validate_problem(problem: ILPProblem) -> None:
    """Raise ValueError (what was given, what is required) for a malformed problem."""
    n = len(problem.node_costs)
    if len(problem.node_memory) != n or (problem.names is not None and len(problem.names) != n):
        names = "None" if problem.names is None else len(problem.names)
        raise ValueError(f"ILPProblem has {n} node_costs, {len(problem.node_memory)} node_memory and {names} "
                         "names; required: one cost vector, one memory vector (and one name, or names=None) per group.")
    for g, (c, m) in enumerate(zip(problem.node_costs, problem.node_memory)):
        c, m = np.asarray(c), np.asarray(m)
        if c.ndim != 1 or c.size == 0 or c.shape != m.shape:
            raise ValueError(f"{group_name(problem, g)}: node cost shape {c.shape}, memory shape {m.shape}; "
                             "required: the same non-empty 1-D shape (one entry per strategy).")
        if not (np.all(np.isfinite(c)) and np.all(c >= 0) and np.all(np.isfinite(m)) and np.all(m >= 0)):
            raise ValueError(f"{group_name(problem, g)}: costs {c}, memory {m}; required: finite and >= 0.")
    for i, e in enumerate(problem.edges):
        if not (0 <= e.src < n and 0 <= e.dst < n):
            raise ValueError(f"edge {i} is {e.src} -> {e.dst}; required: group indices in 0..{n - 1}.")
        want, r = (len(problem.node_costs[e.src]), len(problem.node_costs[e.dst])), np.asarray(e.cost)
        if r.shape != want:
            raise ValueError(f"edge {i} ({group_name(problem, e.src)} -> {group_name(problem, e.dst)}) has cost "
                             f"shape {r.shape}; required (n_strategies[src], n_strategies[dst]) = {want}.")
        if not (np.all(np.isfinite(r)) and np.all(r >= 0)):
            raise ValueError(f"edge {i} ({e.src} -> {e.dst}) has costs {r}; required: finite and >= 0.")
    budget, const = problem.memory_budget, problem.memory_constant
    bad_budget = budget is not None and not (math.isfinite(budget) and budget >= 0)
    if bad_budget or not (math.isfinite(const) and const >= 0):
        raise ValueError(f"memory_budget={budget!r}, memory_constant={const!r}; required: finite bytes >= 0 "
                         "(memory_budget may be None for no limit).")
    if not problem.time_limit_s > 0:
        raise ValueError(f"time_limit_s={problem.time_limit_s!r}; required: a positive number of seconds "
                         "(raise Config.solver_time_limit_s).")


def evaluate_choice(problem: ILPProblem, choice: tuple[int, ...]) -> tuple[float, float]:
    """Return ``(cost_seconds, memory_bytes)`` of one strategy per group (memory includes the constant)."""
    if len(choice) != len(problem.node_costs):
        raise ValueError(f"choice has {len(choice)} entries; required one per group ({len(problem.node_costs)}).")
    cost = math.fsum(float(np.asarray(c)[s]) for c, s in zip(problem.node_costs, choice))
    cost += math.fsum(float(np.asarray(e.cost)[choice[e.src], choice[e.dst]]) for e in problem.edges)
    mem = math.fsum(float(np.asarray(m)[s]) for m, s in zip(problem.node_memory, choice))
    return cost, problem.memory_constant + mem


def format_bytes(x: float) -> str:
    """``x`` bytes in the largest binary unit that keeps it >= 1 (``3.2 MiB``)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(x) >= size:
            return f"{x / size:.3g} {unit}" if abs(x) < 1000 * size else f"{x / size:.0f} {unit}"
    return f"{x:.0f} B"


def min_memory_bytes(problem: ILPProblem) -> float:
    """Minimum per-device memory over all choices (exact: memory has no edge terms)."""
    return problem.memory_constant + math.fsum(float(np.min(m)) for m in problem.node_memory)


def infeasible_error(problem: ILPProblem) -> InfeasibleMemoryError:
    """The error for a budget below the problem's memory floor: the floor, the excess, the
    largest groups and how to fix it."""
    required = min_memory_bytes(problem)
    budget = float(problem.memory_budget if problem.memory_budget is not None else math.inf)
    mins = sorted(((float(np.min(m)), g) for g, m in enumerate(problem.node_memory)), reverse=True)[:3]
    top = ", ".join(f"{group_name(problem, g)}: {format_bytes(v)}" for v, g in mins)
    msg = (
        f"no sharding plan fits the per-device memory budget: given {budget:.0f} bytes "
        f"({format_bytes(budget)}), required at least {required:.0f} bytes ({format_bytes(required)}, "
        f"{format_bytes(required - budget)} over) "
        f"with every group on its smallest-memory strategy (constant part {problem.memory_constant:.0f} bytes; "
        f"largest groups {top}). Fix: raise Config.memory_bytes, use more devices, or allow more "
        "tensor/pipeline parallelism so parameters and activations are split further."
    )
    return InfeasibleMemoryError(msg, required_bytes=required, budget_bytes=budget)
