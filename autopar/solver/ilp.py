"""Intra-operator sharding ILP (Alpa, OSDI'22 section 4.2) as a standalone solver.

Every *variable group* ``g`` (one graph node, or several nodes forced to share a
choice) picks exactly one of its ``k_g`` sharding strategies.  With node costs
``c[g, s]`` (compute + communication seconds), per-device memory ``m[g, s]``
(bytes), resharding costs ``R[e, s, t]`` on each edge ``e = (u, v)``, a constant
memory ``M0`` and an optional per-device budget ``B`` the problem is::

    variables    x[g, s] in {0, 1}        group g uses strategy s
                 y[e, s, t] >= 0          edge e = (u, v): u uses s and v uses t
    constraints  sum_s x[g, s] = 1                       every group g
                 sum_t y[e, s, t] = x[u, s]              every edge e = (u, v), every s
                 sum_s y[e, s, t] = x[v, t]              every edge e = (u, v), every t
                 M0 + sum_g sum_s m[g, s] x[g, s] <= B   only when B is given
    objective    min  sum_g sum_s c[g, s] x[g, s] + sum_e sum_{s,t} R[e, s, t] y[e, s, t]

Alpa writes the edge term as the quadratic ``x_u^T R_uv x_v`` and linearises it
with ``y``.  The two marginal constraints force ``y[e] = x_u x_v^T`` whenever the
``x`` are integral, so ``y`` can stay continuous.  This linearisation is tight
(the local polytope): for tree-shaped graphs its LP relaxation is integral.

Edge normalisation: several edges between the same pair of groups (in either
direction) are merged by adding their cost matrices (transposing the reversed
ones) before variables are built.  A self edge ``(g, g)``, which appears when
identical layers are linked, can only pay its diagonal (``y[s, s] = x[s]``), so
``diag(R)`` is added to the node cost of ``g``.

Presolve (every step exact, repeated until nothing changes):

1. Memory: a strategy whose memory above its group's minimum exceeds the slack
   ``B - M0 - sum_g min_s m[g, s]`` can never be chosen and is dropped.
2. Dominance: strategy ``s`` is dropped when another strategy ``t`` of the same
   group has node cost, memory and every incident edge row elementwise no worse
   (ties keep the lowest index).  Replacing ``s`` by ``t`` in any solution never
   raises cost or memory.
3. A group left with one strategy is fixed; its edges fold into the neighbours'
   node costs.

Solve: the LP relaxation (HiGHS's LP solver, GLOP where OR-Tools lacks it) first; if every
``x`` is within 1e-6 of 0/1 it is optimal (backend ``"lp-relaxation"``). Otherwise its solution
is rounded, greedily memory-repaired, improved by local search (each group its best option
with its neighbours held) and then by a MIP over the groups where the LP is fractional or the
rounding departs from it (the others held: RINS), to the MIP's gap in two thirds of the time
left; within the MIP's gap of the LP bound that is optimal (backend ``"lp-rounding"``).
HiGHS over GLOP: the relaxation of the bf16 Llama of the setup-kind tests (4 layers, dp=2 x tp=2: 605k
variables, 51k constraints) took 6.4 s in HiGHS against 31 s in GLOP (and 121 s in CLP,
unfinished), the same objective; GLOP missed the 30 s limit on a loaded machine.  Otherwise the MIP runs with a relative
gap of 1e-4: HiGHS first (on 300-group x 8-strategy instances with a binding
memory budget it proved optimality in 5-17 s where CBC alone stopped at a 30 s
limit with gaps of 2e-4 to 3e-3).  OR-Tools' HiGHS interface exposes no
incumbent at the time limit, so HiGHS gets 2/3 of the remaining time and CBC
(or SCIP) the rest; if that also ends without proof, the better of its
incumbent and that rounding (backend ``"lp-rounding"``) is returned as ``"feasible"`` with its gap.  The limit is
approximate: CBC can overrun it by a few seconds.  Model construction is
ordered (written as one model: :mod:`autopar.solver.formulation`) and the backends are
deterministic, so a problem always gives the same choice when no time limit is reached
(whether a neighbourhood's MIP ends in its time decides whether the whole MIP runs).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from ortools.linear_solver import linear_solver_pb2, pywraplp

from autopar.errors import AutoparError
from autopar.solver.formulation import Formulation, formulate, load
from autopar.solver.ilp_problem import (
    ILPEdge, ILPProblem, ILPSolution, InfeasibleMemoryError, evaluate_choice, format_bytes,
    infeasible_error, min_memory_bytes, validate_problem,
)
from autopar.solver.mip import (
    INTRA_OP_SETTINGS, UNKNOWN_STATUS, SolverError, SolverTimeoutError, run_mip,
)

__all__ = ["brute_force", "evaluate_choice", "format_bytes", "ILPEdge", "ILPProblem", "ILPSolution",
           "InfeasibleMemoryError", "min_memory_bytes", "solve_ilp"]

_INTEGRALITY_TOL = 1e-6
_MIP_RELATIVE_GAP = INTRA_OP_SETTINGS.relative_gap
_BRUTE_FORCE_MAX = 10_000_000


@dataclass
class _Reduced:
    """Mutable presolve state; arrays of group g are aligned with ``opts[g]`` (original strategy indices)."""

    opts: list[np.ndarray]
    cost: list[np.ndarray]
    mem: list[np.ndarray]
    edges: dict[tuple[int, int], np.ndarray]  # key (u, v) with u < v
    incident: list[set[tuple[int, int]]]
    fixed: list[bool]


def _normalise(problem: ILPProblem) -> _Reduced:
    """Fold self edges into node costs and merge parallel edges (u, v) / (v, u)."""
    n = len(problem.node_costs)
    cost = [np.asarray(c, dtype=np.float64).copy() for c in problem.node_costs]
    mem = [np.asarray(m, dtype=np.float64).copy() for m in problem.node_memory]
    edges: dict[tuple[int, int], np.ndarray] = {}
    for e in problem.edges:
        r = np.asarray(e.cost, dtype=np.float64)
        if e.src == e.dst:
            cost[e.src] = cost[e.src] + np.diag(r)
            continue
        key, mat = ((e.src, e.dst), r) if e.src < e.dst else ((e.dst, e.src), r.T)
        edges[key] = edges[key] + mat if key in edges else mat.copy()
    incident: list[set[tuple[int, int]]] = [set() for _ in range(n)]
    for u, v in edges:
        incident[u].add((u, v))
        incident[v].add((u, v))
    opts = [np.arange(len(c)) for c in cost]
    return _Reduced(opts, cost, mem, edges, incident, [False] * n)


def _rows(red: _Reduced, g: int) -> list[np.ndarray]:
    """Incident edge matrices oriented with group g on the rows, in sorted key order."""
    return [red.edges[k] if k[0] == g else red.edges[k].T for k in sorted(red.incident[g])]


def _keep_mask(red: _Reduced, g: int, slack: float | None) -> np.ndarray:
    """Strategies of g that survive the memory and dominance tests."""
    extra = red.mem[g] - red.mem[g].min()
    keep = np.ones(len(red.opts[g]), dtype=bool) if slack is None else extra <= slack
    feats = np.column_stack([red.cost[g], red.mem[g], *_rows(red, g)])
    le = np.all(feats[:, None, :] <= feats[None, :, :], axis=2)  # le[t, s]: t no worse than s
    k = len(keep)
    for s in range(k):  # t removes s if t is kept, no worse, and strictly better or equal with a lower index
        keep[s] &= not any(keep[t] and le[t, s] and (t < s or not le[s, t]) for t in range(k) if t != s)
    return keep


def _restrict(red: _Reduced, g: int, keep: np.ndarray) -> None:
    red.opts[g], red.cost[g], red.mem[g] = red.opts[g][keep], red.cost[g][keep], red.mem[g][keep]
    for key in red.incident[g]:
        red.edges[key] = red.edges[key][keep, :] if key[0] == g else red.edges[key][:, keep]


def _fix(red: _Reduced, g: int) -> None:
    """Group g has one strategy left: fold its edges into the neighbours' node costs."""
    red.fixed[g] = True
    for key in sorted(red.incident[g]):
        mat = red.edges.pop(key)
        other = key[1] if key[0] == g else key[0]
        red.cost[other] = red.cost[other] + (mat[0, :] if key[0] == g else mat[:, 0])
        red.incident[other].discard(key)
    red.incident[g].clear()


def _slack_tolerance(budget: float) -> float:
    """What the memory slack is widened by, for rounding in the sums."""
    return 1e-9 * max(budget, 1.0)


def _presolve(problem: ILPProblem) -> tuple[_Reduced, float | None]:
    """Run the exact presolve; return the state and the memory slack (None when unconstrained)."""
    red = _normalise(problem)
    slack = None
    if problem.memory_budget is not None:
        slack = problem.memory_budget - min_memory_bytes(problem)
        slack += _slack_tolerance(problem.memory_budget)
    changed = True
    while changed:
        changed = False
        for g in range(len(red.opts)):
            if red.fixed[g]:
                continue
            keep = _keep_mask(red, g, slack)
            if not keep.all():
                _restrict(red, g, keep)
                changed = True
            if len(red.opts[g]) == 1:
                _fix(red, g)
                changed = True
    return red, slack


@dataclass(frozen=True)
class _Model:
    solver: pywraplp.Solver
    groups: tuple[int, ...]  # groups the presolve left open
    x: tuple[tuple[pywraplp.Variable, ...], ...]
    scale: float  # objective coefficients are costs / scale


@dataclass(frozen=True)
class _Written:
    """The presolved problem's model (:func:`autopar.solver.formulation.formulate`), to load
    into each backend that tries it."""

    form: Formulation
    groups: tuple[int, ...]
    scale: float

    def load(self, solver: pywraplp.Solver) -> _Model:
        """The model loaded into ``solver``, its ``x`` by open group."""
        loaded = load(solver, self.form)
        return _Model(solver, self.groups, loaded.x, self.scale)


def _write(red: _Reduced, slack: float | None, integer: bool) -> _Written:
    """Alpa's formulation over the groups the presolve left open, objective scaled to O(1)."""
    groups = tuple(g for g in range(len(red.opts)) if not red.fixed[g])
    idx = {g: i for i, g in enumerate(groups)}
    scale = max([float(red.cost[g].max()) for g in groups] + [float(m.max()) for m in red.edges.values()] + [0.0])
    scale = scale if scale > 0 else 1.0
    edges = [(idx[u], idx[v], mat / scale) for (u, v), mat in sorted(red.edges.items())]
    extra, bound = _memory_row(red, groups, slack)
    form = formulate([red.cost[g] / scale for g in groups], edges, extra, bound, integer)
    return _Written(form, groups, scale)


def _memory_row(red: _Reduced, groups: tuple[int, ...], slack: float | None
                ) -> tuple[list[np.ndarray] | None, float]:
    """sum_g sum_s (m[g,s] - min_s m[g,s]) x[g,s] <= slack, scaled to O(1): its coefficients
    and bound, or ``None`` when it cannot bind."""
    if slack is None:
        return None, 0.0
    extra = [red.mem[g] - red.mem[g].min() for g in groups]
    if math.fsum(float(e.max()) for e in extra) <= slack:
        return None, 0.0
    mscale = max(float(e.max()) for e in extra)
    return [e / mscale for e in extra], slack / mscale


def _values(model: _Model) -> tuple[np.ndarray, ...]:
    """The solved ``model``'s x, per open group."""
    return tuple(np.array([var.solution_value() for var in row]) for row in model.x)


def _positions(groups: tuple[int, ...], values: Sequence[np.ndarray]) -> tuple[dict[int, int], bool]:
    """Largest x per open group (index into ``red.opts[g]``) and whether every x is integral
    (``values``: the x of each of ``groups``)."""
    pos, integral = {}, True
    for g, vals in zip(groups, values):
        integral &= _integral(vals)
        pos[g] = int(np.argmax(vals))
    return pos, integral


def _integral(vals: np.ndarray) -> bool:
    """Whether every value is within :data:`_INTEGRALITY_TOL` of 0 or 1."""
    return bool(np.all(np.minimum(np.abs(vals), np.abs(vals - 1.0)) <= _INTEGRALITY_TOL))


def _full_choice(red: _Reduced, pos: dict[int, int]) -> tuple[int, ...]:
    return tuple(int(red.opts[g][pos.get(g, 0)]) for g in range(len(red.opts)))


def _local_costs(red: _Reduced, g: int, pos: dict[int, int]) -> np.ndarray:
    """Cost of every option of g with the neighbours' current options held fixed."""
    out = red.cost[g].copy()
    for u, v in red.incident[g]:
        out += red.edges[(u, v)][:, pos[v]] if u == g else red.edges[(u, v)][pos[u], :]
    return out


def _best_move(red: _Reduced, g: int, pos: dict[int, int], extra: dict[int, np.ndarray]) -> tuple[float, int]:
    """Cheapest memory-saving switch of g: (extra seconds per byte saved, option)."""
    save = extra[g][pos[g]] - extra[g]
    if not np.any(save > 0):
        return math.inf, -1
    local = _local_costs(red, g, pos)
    ratio = np.where(save > 0, (local - local[pos[g]]) / np.where(save > 0, save, 1.0), np.inf)
    s = int(np.argmin(ratio))
    return float(ratio[s]), s


def _repair(red: _Reduced, pos: dict[int, int], slack: float | None) -> dict[int, int]:
    """Greedy memory repair of a rounded LP choice (always terminates: memory strictly falls)."""
    if slack is None:
        return pos
    extra = {g: red.mem[g] - red.mem[g].min() for g in pos}
    used = math.fsum(float(extra[g][pos[g]]) for g in pos)
    moves = {g: _best_move(red, g, pos, extra) for g in pos}
    while used > slack:
        g = min(moves, key=lambda h: (moves[h][0], h))
        if moves[g][1] < 0:
            break
        s = moves[g][1]
        used -= float(extra[g][pos[g]] - extra[g][s])
        pos[g] = s
        for h in {g, *(u if v == g else v for u, v in red.incident[g])}:
            moves[h] = _best_move(red, h, pos, extra)
    return pos


_IMPROVE_PASSES = 50  # (each pass that changes a group lowers the objective; a bound all the same)


def _improve(red: _Reduced, pos: dict[int, int], slack: float | None) -> dict[int, int]:
    """Local search on a repaired choice: each open group in turn takes its cheapest option
    with its neighbours held, among those that keep the memory within ``slack``, until a pass
    changes nothing. Measured on DeepSeek-V3's stage-1 ILP (2,048 GPUs; 503 groups, 433k
    variables): the rounded LP choice was 8.5% above the optimum, 2.1% after 2 passes (12 ms);
    the MIP, at its 30 s limit, had nothing better (HiGHS proves the optimum given 46.7 s)."""
    extra = {g: red.mem[g] - red.mem[g].min() for g in pos}
    used = math.fsum(float(extra[g][pos[g]]) for g in pos)
    limit = math.inf if slack is None else slack
    for _ in range(_IMPROVE_PASSES):
        changed = False
        for g in sorted(pos):
            local = _local_costs(red, g, pos)
            options = np.where(extra[g] <= limit - used + extra[g][pos[g]], local, np.inf)
            s = int(np.argmin(options))
            if options[s] < local[pos[g]]:
                used += float(extra[g][s] - extra[g][pos[g]])
                pos[g], changed = s, True
        if not changed:
            break
    return pos


def _reduced_value(red: _Reduced, pos: dict[int, int]) -> float:
    """Objective of ``pos`` in the presolved problem (no constants of fixed groups)."""
    nodes = math.fsum(float(red.cost[g][s]) for g, s in pos.items())
    return nodes + math.fsum(float(m[pos[u], pos[v]]) for (u, v), m in red.edges.items())


@dataclass(frozen=True)
class _LPResult:
    groups: tuple[int, ...]  # the open groups
    values: tuple[np.ndarray, ...]  # their x (empty when the LP did not finish)
    pos: dict[int, int] | None  # rounded positions; None when the LP did not finish
    integral: bool
    bound: float  # lower bound in presolved units (seconds)
    size: tuple[int, int]  # the model's variables and constraints


def _size(solver: pywraplp.Solver) -> tuple[int, int]:
    return solver.NumVariables(), solver.NumConstraints()


def _solution(problem: ILPProblem, choice: tuple[int, ...], status: str, gap: float, t0: float,
              backend: str, size: tuple[int, int] = (0, 0)) -> ILPSolution:
    cost, mem = evaluate_choice(problem, choice)
    return ILPSolution(choice, cost, status, gap, time.perf_counter() - t0, backend, *size, mem)


@functools.lru_cache(maxsize=1)
def _lp_backend() -> str:
    """The LP solver of the relaxation: HiGHS's, or GLOP where this OR-Tools build lacks it."""
    return next(n for n in ("HIGHS_LP", "GLOP") if pywraplp.Solver.CreateSolver(n) is not None)


def _solve_lp(red: _Reduced, slack: float | None, time_limit_s: float) -> _LPResult:
    """Solve the LP relaxation with :func:`_lp_backend`, the model handed to it as written
    (``Solver.SolveWithProto``): loaded into a ``pywraplp.Solver`` first, the solver copies it
    back into a message of its own for HiGHS. DeepSeek-V3's stage-1 LP (2,048 GPUs: 433k
    variables) solved in 2.9 s this way against 4.7 s loaded (0.2 s to load, 4.5 s to solve),
    the same optimum (docs/validation.md). Unlike ``Solver.Solve`` this call holds Python's
    GIL while it solves: a worker's thread sending its last result waits for it (seconds at
    most; measured: the whole plan faster all the same). Raises :class:`AutoparError` with
    OR-Tools' words when the model or its parameters are refused (a bug of autopar's)."""
    written = _write(red, slack, integer=False)
    form = written.form
    size = (len(form.proto.variable), len(form.proto.constraint))
    request = linear_solver_pb2.MPModelRequest(
        model=form.proto, solver_time_limit_seconds=max(time_limit_s, 1e-3),
        solver_type=getattr(linear_solver_pb2.MPModelRequest, _LP_REQUEST[_lp_backend()]))
    if _lp_backend() == "HIGHS_LP":  # (its banner is printed unless this is set)
        request.solver_specific_parameters = "output_flag=false"
    response = linear_solver_pb2.MPSolutionResponse()
    pywraplp.Solver.SolveWithProto(request, response)
    groups = written.groups
    if response.status in _REFUSED:
        raise AutoparError(
            f"{_lp_backend()} refused the intra-operator LP ({linear_solver_pb2.MPSolverResponseStatus.Name(response.status)}: "
            f"{response.status_str or 'no message'}); required: a valid model and parameters. This is a "
            f"bug of autopar.solver, please report the problem instance.")
    if response.status != linear_solver_pb2.MPSOLVER_OPTIMAL:
        return _LPResult(groups, (), None, False, -math.inf, size)
    x = np.array(response.variable_value)
    values = tuple(x[a:b] for a, b in zip(form.starts, form.starts[1:]))
    pos, integral = _positions(groups, values)
    return _LPResult(groups, values, pos, integral, response.objective_value * written.scale, size)


# the request's solver type of each :func:`_lp_backend`
_LP_REQUEST = {"HIGHS_LP": "HIGHS_LINEAR_PROGRAMMING", "GLOP": "GLOP_LINEAR_PROGRAMMING"}
# statuses of a request refused before solving (any other but OPTIMAL: the LP did not finish)
_REFUSED = frozenset({
    linear_solver_pb2.MPSOLVER_MODEL_INVALID, linear_solver_pb2.MPSOLVER_MODEL_INVALID_SOLVER_PARAMETERS,
    linear_solver_pb2.MPSOLVER_SOLVER_TYPE_UNAVAILABLE, linear_solver_pb2.MPSOLVER_INCOMPATIBLE_OPTIONS})


# of the time left, for the MIP over a rounding's unsettled groups: DeepSeek-V3's stage-1 ILP
# (2,048 GPUs) solves its neighbourhood in 8 s alone; given a third of the time left (about
# 8 s), it ran past it when another ILP ran beside it (the whole MIP then hit the limit: 2% above the
# optimum, a plan that depends on the machine's load); with two thirds, optimal beside one or
# two others (docs/validation.md). The whole MIP, which follows when the neighbourhood does not
# prove its rounding, has the rest (on that stage it found nothing better than the rounding
# within the 30 s limit: session 55, docs/validation.md).
_NEIGHBOURHOOD_SHARE = 2 / 3
# at most this share of the open groups free: a larger neighbourhood is nearly the whole MIP, which
# would then start again with less time
_NEIGHBOURHOOD_MAX_FREE = 1 / 2


def _settled(lp: _LPResult) -> dict[int, int]:
    """The open groups whose ``x`` the LP set integral, and their options."""
    return {g: int(np.argmax(vals)) for g, vals in zip(lp.groups, lp.values) if _integral(vals)}


def _neighbourhood(problem: ILPProblem, red: _Reduced, lp: _LPResult, pos: dict[int, int],
                   slack: float | None, t0: float) -> dict[int, int]:
    """``pos`` improved by a MIP over its neighbourhood (RINS: Danna, Rothberg and Le Pape,
    Math. Programming 102, 2005): the groups the LP set integral, where ``pos`` agrees, keep
    their option; the others are solved by a MIP (to its gap) in :data:`_NEIGHBOURHOOD_SHARE`
    of the time left, their edges to the kept groups folded into their costs, the memory the
    kept groups use taken from the slack. ``pos`` as it was when no group, or more than
    :data:`_NEIGHBOURHOOD_MAX_FREE` of them, is free, or when that MIP finds nothing better in
    its time. Measured on DeepSeek-V3's stage-1 ILP (2,048
    GPUs: 460 open groups, 132 free): HiGHS solved the free part in 8.1 s, 7.8e-5 above the LP
    bound, where the local search had stopped 2.1% above it."""
    settled = _settled(lp)
    free = [g for g in sorted(pos) if settled.get(g) != pos[g]]
    left = problem.time_limit_s - (time.perf_counter() - t0)
    if not free or len(free) > _NEIGHBOURHOOD_MAX_FREE * len(pos) or left <= 0:
        return pos
    at = {g: i for i, g in enumerate(free)}
    costs = [red.cost[g].copy() for g in free]
    edges = []
    for (u, v), mat in sorted(red.edges.items()):
        if u in at and v in at:
            edges.append(ILPEdge(at[u], at[v], mat))
        elif u in at:  # (v is kept: its option's column)
            costs[at[u]] += mat[:, pos[v]]
        elif v in at:
            costs[at[v]] += mat[pos[u], :]
    extra = tuple(red.mem[g] - red.mem[g].min() for g in free)
    budget = None if slack is None else slack - _slack_tolerance(problem.memory_budget) - math.fsum(
        float(red.mem[g][pos[g]] - red.mem[g].min()) for g in pos if g not in at)  # (its own added again)
    if budget is not None and budget < 0:
        return pos  # (pos is over the budget: nothing within it to improve on)
    sub = ILPProblem(tuple(costs), extra, tuple(edges), budget,
                     time_limit_s=left * _NEIGHBOURHOOD_SHARE)
    try:
        found = _solve(sub, neighbourhood=False)
    except (SolverError, InfeasibleMemoryError):
        # nothing found in its time (or a backend's wrong infeasible: pos fits): the rounding
        # stands, and the whole MIP follows, which reports a failing backend itself
        return pos
    better = {**pos, **{g: s for g, s in zip(free, found.choice)}}
    return better if _reduced_value(red, better) < _reduced_value(red, pos) else pos


def _rounding_solution(
    problem: ILPProblem, red: _Reduced, lp: _LPResult, slack: float | None, t0: float,
    neighbourhood: bool = True,
) -> ILPSolution:
    """Rounded, memory-repaired and locally improved LP solution (then its neighbourhood
    solved by a MIP, with ``neighbourhood``), with its gap to the LP bound (of the whole
    objective). It is ``"optimal"`` when within the MIP's relative gap of the bound on the
    presolved objective, the one the MIP's gap is measured on (the fixed groups' constant left
    out, which would loosen it)."""
    assert lp.pos is not None
    pos = _improve(red, _repair(red, dict(lp.pos), slack), slack)
    if neighbourhood:
        pos = _neighbourhood(problem, red, lp, pos, slack, t0)
    choice = _full_choice(red, pos)
    value, reduced = evaluate_choice(problem, choice)[0], _reduced_value(red, pos)
    bound = lp.bound + (value - reduced)  # add back the fixed groups' constant
    gap = max(value - bound, 0.0) / max(abs(value), 1e-300)
    close = reduced - lp.bound <= _MIP_RELATIVE_GAP * max(abs(reduced), 1e-300)
    status = "optimal" if close else "feasible"
    return _solution(problem, choice, status, gap, t0, "lp-rounding", lp.size)


def _no_solution_error(code: int, tried: list[str], limit_s: float) -> SolverError:
    """Error for a solve that ended without any feasible solution."""
    if code in (pywraplp.Solver.NOT_SOLVED, UNKNOWN_STATUS):
        return SolverTimeoutError(
            f"{' and '.join(tried)} found no feasible sharding within the time limit of {limit_s:.1f} s "
            "(required: at least one feasible solution). Fix: raise Config.solver_time_limit_s, "
            "or shrink the problem (fewer strategies per op, more layer merging)."
        )
    return SolverError(
        f"{' and '.join(tried)} ended with status code {code} (required: OPTIMAL or FEASIBLE); "
        "this is a solver failure, please report the problem instance."
    )


def _solve_mip(
    problem: ILPProblem, red: _Reduced, slack: float | None, t0: float
) -> tuple[ILPSolution | None, int, list[str]]:
    """Run the MIP; HiGHS exposes no incumbent at its time limit, so CBC then gets the remaining time.

    Returns the solution (None when no backend found one), the last status code and the backends tried.
    """
    run = run_mip(_write(red, slack, integer=True).load, INTRA_OP_SETTINGS,
                  problem.time_limit_s, t0)
    if run.code == pywraplp.Solver.INFEASIBLE:
        raise infeasible_error(problem)
    if run.model is None:
        return None, run.code, list(run.tried)
    return _mip_solution(problem, red, run.model, run.code, run.backend, t0), run.code, list(run.tried)


def _mip_solution(
    problem: ILPProblem, red: _Reduced, model: _Model, code: int, backend: str, t0: float
) -> ILPSolution:
    """Read a MIP result; the gap is relative to the full objective (fixed groups included)."""
    objective = model.solver.Objective()
    pos, _ = _positions(model.groups, _values(model))
    choice = _full_choice(red, pos)
    full = evaluate_choice(problem, choice)[0]
    slack = max(objective.Value() - objective.BestBound(), 0.0) * model.scale  # seconds above the bound
    gap = slack / max(abs(full), 1e-300) if math.isfinite(slack) else math.inf
    gap = 0.0 if gap < 1e-12 else gap
    status = "optimal" if code == pywraplp.Solver.OPTIMAL or gap <= _MIP_RELATIVE_GAP else "feasible"
    return _solution(problem, choice, status, gap, t0, backend, _size(model.solver))


def solve_ilp(problem: ILPProblem) -> ILPSolution:
    """Solve the intra-operator sharding ILP (exactly, within a 1e-4 relative gap, unless time runs out).

    Presolves, tries the LP relaxation (returned as ``"lp-relaxation"`` when
    integral); otherwise the LP solution rounded, memory-repaired, improved by local
    search and by a MIP over the groups where the LP is fractional or the rounding departs
    from it (backend ``"lp-rounding"``) when that is within the gap of the LP bound, else the
    MIP.  When the MIP ends at the time limit, the better of its incumbent and the rounding is
    returned with status ``"feasible"``.
    Raises :class:`InfeasibleMemoryError` when no choice fits ``memory_budget``,
    :class:`SolverTimeoutError` when nothing feasible is known at the time limit
    and ``ValueError`` for a malformed problem.
    """
    return _solve(problem, neighbourhood=True)


def _solve(problem: ILPProblem, neighbourhood: bool) -> ILPSolution:
    """:func:`solve_ilp`; ``neighbourhood`` False: a rounding's neighbourhood is not solved
    (the solve of a neighbourhood itself)."""
    t0 = time.perf_counter()
    validate_problem(problem)
    if problem.memory_budget is not None and min_memory_bytes(problem) > problem.memory_budget * (1 + 1e-12):
        raise infeasible_error(problem)
    red, slack = _presolve(problem)
    if all(red.fixed):
        return _solution(problem, _full_choice(red, {}), "optimal", 0.0, t0, "presolve")
    lp = _solve_lp(red, slack, problem.time_limit_s)
    if lp.pos is not None and lp.integral:
        return _solution(problem, _full_choice(red, lp.pos), "optimal", 0.0, t0, "lp-relaxation", lp.size)
    rounded = (_rounding_solution(problem, red, lp, slack, t0, neighbourhood)
               if lp.pos is not None else None)
    if rounded is not None and rounded.status == "optimal":  # (certified to the MIP's gap)
        return rounded
    mip, code, tried = _solve_mip(problem, red, slack, t0)
    if mip is not None and mip.status == "optimal":
        return mip
    if rounded is None:
        if mip is None:
            raise _no_solution_error(code, [_lp_backend(), *tried], problem.time_limit_s)
        return mip
    return mip if mip is not None and mip.objective <= rounded.objective else rounded


def _spread(a: np.ndarray, axes: tuple[int, ...], n: int) -> np.ndarray:
    """View of ``a`` (its axes are ``axes``, ascending) that broadcasts over ``n`` axes."""
    return np.expand_dims(a, tuple(i for i in range(n) if i not in axes))


def brute_force(problem: ILPProblem) -> ILPSolution:
    """Enumerate every choice (for small problems and tests); ties pick the lexicographically smallest choice."""
    t0 = time.perf_counter()
    validate_problem(problem)
    shape = tuple(len(c) for c in problem.node_costs)
    if math.prod(shape) > _BRUTE_FORCE_MAX:
        raise ValueError(f"brute_force over {math.prod(shape)} choices; at most {_BRUTE_FORCE_MAX} are allowed. "
                         "Use solve_ilp.")
    n, f64 = len(shape), np.float64
    cost = sum((_spread(np.asarray(c, f64), (g,), n) for g, c in enumerate(problem.node_costs)), np.zeros(shape))
    mem = sum((_spread(np.asarray(m, f64), (g,), n) for g, m in enumerate(problem.node_memory)), np.zeros(shape))
    mem = mem + problem.memory_constant
    for e in problem.edges:
        r = np.asarray(e.cost, dtype=f64)
        if e.src == e.dst:
            cost = cost + _spread(np.diag(r), (e.src,), n)
        else:
            cost = cost + _spread(r if e.src < e.dst else r.T, (min(e.src, e.dst), max(e.src, e.dst)), n)
    if problem.memory_budget is not None:
        cost = np.where(mem <= problem.memory_budget * (1 + 1e-12), cost, np.inf)
    flat = int(np.argmin(cost))
    if not math.isfinite(float(cost.flat[flat])):
        raise infeasible_error(problem)
    choice = tuple(int(i) for i in np.unravel_index(flat, shape))
    return _solution(problem, choice, "optimal", 0.0, t0, "brute-force")

