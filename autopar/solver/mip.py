"""The MIP backend both optimisers share: OR-Tools' ``pywraplp`` with HiGHS first and CBC taking
the remaining time when HiGHS ends without a solution (HiGHS exposes no incumbent at its time
limit), each optimiser with its own gap and backends (:class:`MipSettings`).

Lead (platform notes, 2 cores): CBC or HiGHS solve the sharding ILP in 0.6-13 s where CP-SAT
with 2 workers stalls, so CP-SAT is not used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Sequence, TypeVar

from ortools.linear_solver import pywraplp

from autopar.errors import AutoparError

__all__ = ["CUT_SETTINGS", "INTRA_OP_SETTINGS", "MipRun", "MipSettings", "SolverError",
           "SolverTimeoutError", "UNKNOWN_STATUS", "mip_solvers", "relative_gap", "run_mip"]

UNKNOWN_STATUS = 99  # what OR-Tools' HiGHS interface returns at its time limit (no incumbent exposed)
FIRST_BACKEND_SHARE = 2 / 3  # of the remaining time, when a second backend can still take over
LAST_BACKEND_SHARE = 0.75  # CBC overruns its limit by up to a few seconds

M = TypeVar("M")


class SolverError(AutoparError, RuntimeError):
    """The MIP backend failed (no backend available, or an abnormal status)."""


class SolverTimeoutError(SolverError):
    """The time limit passed before any feasible solution was found."""


@dataclass(frozen=True)
class MipSettings:
    """One optimiser's use of the backend: ``backends`` ((OR-Tools id, reported name), in order),
    the relative gap at which a solution counts as optimal, and HiGHS's options."""

    backends: tuple[tuple[str, str], ...]
    relative_gap: float
    highs_options: str = "output_flag=false"


# the intra-operator ILP: 1e-4 (the MIP solvers' own default gap; its objective is seconds of a
# step, so 1e-4 of it is far below the cost model's accuracy)
INTRA_OP_SETTINGS = MipSettings((("HIGHS", "HiGHS"), ("CBC", "CBC"), ("SCIP", "SCIP")), 1e-4)
# the stage cuts: exact (1e-9), so that the MIP and the exact dynamic program agree in tests
CUT_SETTINGS = MipSettings((("HIGHS", "HiGHS"), ("CBC", "CBC")), 1e-9,
                           "output_flag=false\nmip_abs_gap=0\nprimal_feasibility_tolerance=1e-9")


@dataclass(frozen=True)
class MipRun:
    """What :func:`run_mip` ended with: the built model of the backend that answered (``None``
    when none did), the last status code and the backends tried."""

    model: object | None
    code: int
    backend: str
    tried: tuple[str, ...]


def mip_solvers(backends: Sequence[tuple[str, str]],
                highs_options: str = "output_flag=false") -> list[tuple[pywraplp.Solver, str]]:
    """Up to two MIP backends of ``backends`` ((OR-Tools id, reported name), in preference order;
    the second only runs if the first finds nothing). HiGHS gets ``highs_options``."""
    found = []
    for name, label in backends:
        solver = pywraplp.Solver.CreateSolver(name)
        if solver is not None:
            if name == "HIGHS":
                solver.SetSolverSpecificParametersAsString(highs_options)
            found.append((solver, label))
    if not found:
        raise SolverError(
            f"none of the MIP backends {', '.join(label for _, label in backends)} is available in this "
            "OR-Tools build (required: at least one); install an OR-Tools wheel that bundles them "
            "(pip install -U ortools)."
        )
    return found[:2]


def run_mip(build: Callable[[pywraplp.Solver], M], settings: MipSettings, time_limit_s: float,
            t0: float) -> MipRun:
    """Build the model on the first backend and solve it within the time left of ``time_limit_s``
    (counted from ``t0``); a backend that ends without a solution hands over to the next.
    Stops at an infeasible model (``code`` INFEASIBLE, ``model`` None)."""
    tried: list[str] = []
    code = pywraplp.Solver.NOT_SOLVED
    attempts = mip_solvers(settings.backends, settings.highs_options)
    for i, (solver, backend) in enumerate(attempts):
        model = build(solver)
        left = time_limit_s - (time.perf_counter() - t0)
        share = FIRST_BACKEND_SHARE if i + 1 < len(attempts) else LAST_BACKEND_SHARE
        solver.SetTimeLimit(max(1, int(max(left * share, 0.02 * time_limit_s) * 1000)))
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, settings.relative_gap)
        code = solver.Solve(params)
        tried.append(backend)
        if code == pywraplp.Solver.INFEASIBLE:
            return MipRun(None, code, backend, tuple(tried))
        if code in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            return MipRun(model, code, backend, tuple(tried))
    return MipRun(None, code, "", tuple(tried))


def relative_gap(solver: pywraplp.Solver) -> float:
    """The incumbent's gap to the best bound, relative to the incumbent."""
    objective = solver.Objective()
    return abs(objective.Value() - objective.BestBound()) / max(abs(objective.Value()), 1e-300)
