"""Stage cuts: bounds, a starting cut and the MIP model of :func:`autopar.solver.stage_cuts.solve_cuts`
(see :mod:`autopar.solver.stage_cuts` for the formulation)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from autopar.solver.mip import (
    CUT_SETTINGS, UNKNOWN_STATUS, SolverError, SolverTimeoutError, relative_gap, run_mip,
)

from autopar.solver.cut_core import (
    CUT_MIP_RELATIVE_GAP, MEM_RTOL, CutProblem, CutTables, bottleneck_dp, check_starts, fits_budget,
)



__all__ = [
    "CutBounds", "build_cut_model", "build_memory_model", "cut_bounds", "find_incumbent",
    "local_search", "memory_exclusions", "min_memory_cut", "read_starts", "relaxed_bottleneck",
    "run_cut_mip",
]

@dataclass(frozen=True)
class CutBounds:
    """Valid bounds for the MIP (seconds / bytes; inf when absent) and interval exclusions.

    ``exclusions`` holds ``(j, k, e)``: no solution that can still improve on the
    incumbent (nor any that fits the budget) has stage ``j`` containing all of
    layers ``[k, e)``; as a row, ``z[e - 1, j] <= z[k, j - 1]``.
    """

    t_lb: float = 0.0
    r_lb: float = 0.0
    t_ub: float = math.inf
    r_ub: float = math.inf
    exclusions: tuple[tuple[int, int, int], ...] = ()

def _stage_memory_mask(prob: CutProblem, tab: CutTables, budget: float | None) -> list[np.ndarray] | None:
    if budget is None:
        return None
    return [tab.memory_matrix(j) <= budget * (1.0 + MEM_RTOL) for j in range(prob.n_stages)]


def relaxed_bottleneck(prob: CutProblem, tab: CutTables, budget: float | None) -> tuple[float, tuple[int, ...]] | None:
    """min over cuts of max_j t_j with every *stage* (not rank) within the budget.

    Exact for v = 1; a relaxation for v > 1 (a rank's memory is at least each of
    its stages' memory).  None when no cut passes, i.e. no cut fits at all.
    """
    return bottleneck_dp(prob, [tab.time_matrix(j) for j in range(prob.n_stages)],
                          _stage_memory_mask(prob, tab, budget))


def _moves(prob: CutProblem, cur: tuple[int, ...]):
    """Neighbouring cuts: one boundary moved by 1 or 2 layers, or one stage shifted by one layer."""
    n, s = prob.n_layers, prob.n_stages

    def valid(c: tuple[int, ...]) -> bool:
        return c[0] == 0 and all(x < y for x, y in zip(c, c[1:])) and c[-1] < n

    for i in range(1, s):
        for delta in (-1, 1, -2, 2):
            cand = (*cur[:i], cur[i] + delta, *cur[i + 1:])
            if valid(cand):
                yield cand
        if i + 1 < s:
            for delta in (-1, 1):  # stage i keeps its size and slides
                cand = (*cur[:i], cur[i] + delta, cur[i + 1] + delta, *cur[i + 2:])
                if valid(cand):
                    yield cand


def local_search(prob: CutProblem, starts: tuple[int, ...], key) -> tuple[tuple, tuple[int, ...]]:
    """First-improvement descent over :func:`_moves` (deterministic).

    ``key(starts)`` is a tuple to minimise (the objective first, then tie-breakers
    that steer the search across plateaus of the max), or None for an infeasible cut.
    """
    best, cur = key(starts), tuple(starts)
    assert best is not None
    improved = True
    while improved:
        improved = False
        for cand in _moves(prob, cur):
            value = key(cand)
            if value is not None and value < best:
                best, cur, improved = value, cand, True
                break
    return best, cur


def _sum_of_squares_dp(prob: CutProblem, tab: CutTables, budget: float | None) -> tuple[int, ...] | None:
    """The cut minimising sum_j t_j^2 with every stage within the budget (balanced chunks)."""
    n, s = prob.n_layers, prob.n_stages
    mask = _stage_memory_mask(prob, tab, budget)
    best = np.full(n + 1, math.inf)
    choice: list[np.ndarray] = [np.zeros(n + 1, dtype=int)] * s
    costs = []
    for j in range(s):
        c = tab.time_matrix(j) ** 2
        c = np.where(np.isnan(c), math.inf, c)
        if mask is not None:
            c = np.where(mask[j], c, math.inf)
        costs.append(c)
    best[:n] = costs[s - 1][:n, n]
    for j in range(s - 2, -1, -1):
        cand = costs[j] + best[None, :]
        choice[j] = np.argmin(cand, axis=1)
        best = cand.min(axis=1)
    if not math.isfinite(float(best[0])):
        return None
    starts, k = [0], 0
    for j in range(s - 1):
        k = int(choice[j][k])
        starts.append(k)
    return tuple(starts)


def find_incumbent(prob: CutProblem, tab: CutTables, budget: float | None, start: tuple[int, ...]
               ) -> tuple[float, tuple[int, ...]] | None:
    """A good cut to start from.

    v = 1: the relaxed bottleneck cut ``start`` (optimal).  v > 1: local search
    on the objective (ties broken by sum R_r^2, then sum t_j^2) from ``start``,
    from the sum-of-squares cut and, with a budget, from the local-search
    minimum-memory cut; the best result, or None when no start fits the budget.
    """

    def key(starts: tuple[int, ...]) -> tuple[float, float, float] | None:
        times, mems, objective = tab.evaluate(starts)
        if not fits_budget(max(mems), budget):
            return None
        ranks = [math.fsum(times[r::prob.p]) for r in range(prob.p)]
        return objective, math.fsum(x * x for x in ranks), math.fsum(x * x for x in times)

    if prob.v == 1:
        return (tab.evaluate(start)[2], start) if key(start) is not None else None
    found = []
    starts = [start, _sum_of_squares_dp(prob, tab, budget)]
    if budget is not None:
        starts.append(min_memory_cut(prob, tab, 0.0, exact=False).starts)
    for cut in starts:
        if cut is not None and key(cut) is not None:
            value, cut = local_search(prob, cut, key)
            found.append((value, cut))
    if not found:
        return None
    value, cut = min(found)
    return value[0], cut


def _min_sends(prob: CutProblem) -> float:
    """Smallest possible total send time: the S - 1 cheapest layers among 0 .. L - 2."""
    return math.fsum(sorted(prob.send[:-1])[: prob.n_stages - 1])


def memory_exclusions(prob: CutProblem, tab: CutTables, budget: float | None, tau: float) -> tuple[tuple[int, int, int], ...]:
    """For each stage j and layer k, the shortest [k, e) that stage j cannot contain.

    Stage j containing [k, e) costs at least ``work[k, e)`` plus, for j < S - 1, the
    cheapest send of a layer it could end on (``>= e - 1``), and at least the
    stage memory of [k, e); both grow with e, so one row per (j, k) suffices.
    """
    n, s = prob.n_layers, prob.n_stages
    send = np.array(prob.send[:-1] + (math.inf,))  # the last layer never sends
    min_send_from = np.minimum.accumulate(send[::-1])[::-1]  # min over layers >= l
    out = []
    for j in range(s):
        time_lb = tab.work.copy()
        if j < s - 1:
            time_lb[:, 1:] = time_lb[:, 1:] + min_send_from[None, :]
        bad = time_lb > tau
        if budget is not None:
            bad |= tab.memory_matrix(j) > budget * (1.0 + MEM_RTOL)
        for k in range(n):
            if k < j:
                continue  # z[k, j - 1] = 1: layer k is always before stage j
            hits = np.flatnonzero(bad[k, k + 1:])
            if hits.size:
                out.append((j, k, k + 1 + int(hits[0])))
    return tuple(out)


def cut_bounds(prob: CutProblem, tab: CutTables, budget: float | None, t_lb: float, upper: float) -> CutBounds:
    """Bounds implied by the relaxed bottleneck ``t_lb`` and an incumbent objective ``upper``."""
    m, w = prob.m, prob.w
    r_lb = t_lb if prob.v == 1 else max(t_lb, (math.fsum(prob.work) + _min_sends(prob)) / prob.p)
    tau, r_ub = math.inf, math.inf
    if math.isfinite(upper):
        slack = 1.0 + 1e-9  # keep cuts tied with the incumbent
        tau = upper / (m + w)  # Rmax >= T, so objective >= (m + w) T
        if w > 0:
            tau = min(tau, (upper - m * r_lb) / w)
        r_ub = (upper - w * t_lb) / m
        tau, r_ub = tau * slack, r_ub * slack
        tau = min(tau, r_ub)  # T <= Rmax
    return CutBounds(t_lb, r_lb, tau, r_ub, memory_exclusions(prob, tab, budget, tau))


@dataclass
class _Model:
    solver: pywraplp.Solver
    z: list[list[object]]  # z[l][j + 1] for j = -1 .. S - 1: a Variable or the constant 0 / 1


def _z_grid(solver: pywraplp.Solver, prob: CutProblem) -> list[list[object]]:
    """Cumulative variables with the fixings of the module docstring (column 0 is j = -1)."""
    n, s = prob.n_layers, prob.n_stages
    grid: list[list[object]] = []
    for layer in range(n):
        row: list[object] = [0]
        for j in range(s - 1):
            if layer <= j:
                row.append(1)
            elif layer >= n - s + 1 + j:
                row.append(0)
            else:
                row.append(solver.BoolVar(f"z_{layer}_{j}"))
        row.append(1)
        grid.append(row)
    return grid


class _Row:
    """Linear expression over variables (keyed by index) plus a constant."""

    def __init__(self) -> None:
        self.coef: dict[int, tuple[pywraplp.Variable, float]] = {}
        self.const = 0.0

    def add(self, term: object, c: float) -> None:
        if c == 0.0:
            return
        if isinstance(term, int):
            self.const += c * term
            return
        key = term.index()  # type: ignore[attr-defined]
        old = self.coef.get(key, (term, 0.0))[1]
        self.coef[key] = (term, old + c)  # type: ignore[assignment]

    def add_row(self, other: _Row) -> None:
        for var, c in other.coef.values():
            self.add(var, c)
        self.const += other.const

    def add_membership(self, z: list[list[object]], layer: int, j: int, c: float) -> None:
        """c * x[layer, j] = c * (z[layer, j] - z[layer, j - 1])."""
        self.add(z[layer][j + 1], c)
        self.add(z[layer][j], -c)

    def constrain(self, solver: pywraplp.Solver, lo: float, hi: float) -> None:
        if not self.coef:
            if not lo - 1e-12 <= self.const <= hi + 1e-12:  # a constant row that fails: make the model infeasible
                solver.Constraint(1.0, 1.0)
            return
        ct = solver.Constraint(lo - self.const, hi - self.const)
        for key in sorted(self.coef):
            var, c = self.coef[key]
            if c != 0.0:
                ct.SetCoefficient(var, c)


def _le(solver: pywraplp.Solver, small: object, large: object) -> None:
    """small <= large for two z entries (skipped when both are constants that satisfy it)."""
    row = _Row()
    row.add(small, 1.0)
    row.add(large, -1.0)
    row.constrain(solver, -solver.infinity(), 0.0)


def _time_row(prob: CutProblem, z: list[list[object]], j: int, scale: float) -> _Row:
    row = _Row()
    for layer in range(prob.n_layers):
        row.add_membership(z, layer, j, prob.work[layer] / scale)
    if j < prob.n_stages - 1:
        for layer in range(prob.n_layers - 1):  # c[l, j] = z[l, j] - z[l + 1, j]
            row.add(z[layer][j + 1], prob.send[layer] / scale)
            row.add(z[layer + 1][j + 1], -prob.send[layer] / scale)
    return row


def _memory_row(prob: CutProblem, z: list[list[object]], r: int, scale: float) -> _Row:
    row = _Row()
    for j in range(r, prob.n_stages, prob.p):
        for layer in range(prob.n_layers):
            row.add_membership(z, layer, j, (prob.state[layer] + prob.in_flight[j] * prob.act[layer]) / scale)
    return row


def _order_constraints(solver: pywraplp.Solver, prob: CutProblem, z: list[list[object]]) -> None:
    n, s = prob.n_layers, prob.n_stages
    for j in range(s - 1):
        for layer in range(n - 1):
            _le(solver, z[layer + 1][j + 1], z[layer][j + 1])  # contiguous
            if j + 1 < s - 1:
                _le(solver, z[layer][j + 1], z[layer + 1][j + 2])  # no stage skipped


def _add_exclusions(solver: pywraplp.Solver, z: list[list[object]], exclusions) -> None:
    for j, k, e in exclusions:
        _le(solver, z[e - 1][j + 1], z[k][j])  # stage j does not contain [k, e)


def build_cut_model(solver: pywraplp.Solver, prob: CutProblem, budget: float | None, tighten: float,
               bounds: CutBounds) -> _Model:
    """The stage-cut MIP of the module docstring, with ``bounds`` (seconds) as variable bounds."""
    z = _z_grid(solver, prob)
    _order_constraints(solver, prob, z)
    _add_exclusions(solver, z, bounds.exclusions)
    inf = solver.infinity()
    scale = max([a + c for a, c in zip(prob.work, prob.send)] + [0.0]) or 1.0
    total = math.fsum(prob.work) / scale
    t_lb = max(max(prob.work) / scale, total / prob.n_stages, bounds.t_lb / scale)
    t_ub = bounds.t_ub / scale if math.isfinite(bounds.t_ub) else inf
    big_t = solver.NumVar(t_lb, max(t_ub, t_lb), "T")
    if prob.v == 1:
        rmax = big_t
    else:
        r_lb = max(t_lb, total / prob.p, bounds.r_lb / scale)
        r_ub = bounds.r_ub / scale if math.isfinite(bounds.r_ub) else inf
        rmax = solver.NumVar(r_lb, max(r_ub, r_lb), "Rmax")
    rows = [_time_row(prob, z, j, scale) for j in range(prob.n_stages)]
    for row in rows:
        stage = _Row()
        stage.add_row(row)
        stage.add(big_t, -1.0)
        stage.constrain(solver, -inf, 0.0)
    if prob.v > 1:
        for r in range(prob.p):
            rank = _Row()
            for j in range(r, prob.n_stages, prob.p):
                rank.add_row(rows[j])
            rank.add(rmax, -1.0)
            rank.constrain(solver, -inf, 0.0)
        _le(solver, big_t, rmax)
    if budget is not None:
        mscale = budget if budget > 0 else 1.0
        for r in range(prob.p):
            _memory_row(prob, z, r, mscale).constrain(solver, -inf, budget / mscale * (1.0 - tighten))
    obj = solver.Objective()
    if prob.v == 1:
        obj.SetCoefficient(big_t, prob.m + prob.w)
    else:
        obj.SetCoefficient(rmax, float(prob.m))
        obj.SetCoefficient(big_t, prob.w)
    obj.SetMinimization()
    return _Model(solver, z)


def build_memory_model(solver: pywraplp.Solver, prob: CutProblem, lower: float, upper: float,
                  exclusions: tuple[tuple[int, int, int], ...]) -> _Model:
    """min M subject to every rank's memory <= M, with lower <= M <= upper (bytes)."""
    z = _z_grid(solver, prob)
    _order_constraints(solver, prob, z)
    _add_exclusions(solver, z, exclusions)
    inf = solver.infinity()
    scale = max(upper, 1.0) if math.isfinite(upper) else 1.0
    big_m = solver.NumVar(lower / scale, upper / scale * (1.0 + 1e-9) if math.isfinite(upper) else inf, "M")
    for r in range(prob.p):
        row = _memory_row(prob, z, r, scale)
        row.add(big_m, -1.0)
        row.constrain(solver, -inf, 0.0)
    obj = solver.Objective()
    obj.SetCoefficient(big_m, 1.0)
    obj.SetMinimization()
    return _Model(solver, z)


def read_starts(model: _Model, prob: CutProblem) -> tuple[int, ...]:
    counts = []
    for j in range(prob.n_stages - 1):
        total = 0
        for layer in range(prob.n_layers):
            term = model.z[layer][j + 1]
            total += term if isinstance(term, int) else int(round(term.solution_value()))  # type: ignore[attr-defined]
        counts.append(total)
    return (0, *counts)


def run_cut_mip(build, prob: CutProblem, time_limit_s: float, t0: float) -> tuple[_Model, str, str] | None:
    """Solve with HiGHS, then CBC with the remaining time if HiGHS found nothing.

    Returns ``(model, status, backend)``, or None when the model is infeasible.
    Raises SolverTimeoutError / SolverError when no backend produced a solution.
    """
    run = run_mip(build, CUT_SETTINGS, time_limit_s, t0)
    code, tried = run.code, run.tried
    if code == pywraplp.Solver.INFEASIBLE:
        return None
    if run.model is not None:
        status = "optimal"
        if code != pywraplp.Solver.OPTIMAL:
            status = "optimal" if relative_gap(run.model.solver) <= CUT_MIP_RELATIVE_GAP else "feasible"
        return run.model, status, run.backend
    if code in (pywraplp.Solver.NOT_SOLVED, UNKNOWN_STATUS):
        raise SolverTimeoutError(
            f"{' and '.join(tried)} found no stage cut within the time limit of {time_limit_s:.1f} s for "
            f"{prob.n_layers} layers and {prob.n_stages} stages (required: at least one feasible cut). Fix: raise "
            "time_limit_s, or merge layers so the chain is shorter."
        )
    raise SolverError(f"{' and '.join(tried)} ended with status code {code} (required: OPTIMAL or FEASIBLE); "
                      "this is a solver failure, please report the problem instance.")



@dataclass(frozen=True)
class _MinMemory:
    value: float  # the smallest peak rank memory found
    starts: tuple[int, ...]
    proven: bool  # value is the exact minimum
    backend: str


def min_memory_cut(prob: CutProblem, tab: CutTables, time_limit_s: float, exact: bool = True) -> _MinMemory:
    """The smallest peak rank memory over all cuts and a cut attaining it.

    v = 1: DP.  v > 1: the relaxed DP (max stage memory) is a lower bound, local
    search from its cut an upper bound, and the min-max-memory MIP closes the gap
    (skipped when ``exact`` is False: then the local-search cut is returned).
    """
    t0 = time.perf_counter()
    found = bottleneck_dp(prob, [tab.memory_matrix(j) for j in range(prob.n_stages)], None)
    assert found is not None
    lower, start = found  # the largest *stage* memory: exact for v = 1, a lower bound for v > 1
    if prob.v == 1:
        return _MinMemory(max(tab.evaluate(start)[1]), start, True, "dp")

    def key(starts: tuple[int, ...]) -> tuple[float, float]:
        mems = tab.evaluate(starts)[1]
        return max(mems), math.fsum(x * x for x in mems)

    (upper, _), best = local_search(prob, start, key)
    if upper <= lower * (1.0 + CUT_MIP_RELATIVE_GAP):
        return _MinMemory(upper, best, True, "dp")
    if not exact:
        return _MinMemory(upper, best, False, "heuristic")
    excl = memory_exclusions(prob, tab, upper, math.inf)
    try:
        found = run_cut_mip(lambda s: build_memory_model(s, prob, lower, upper, excl), prob, time_limit_s, t0)
    except SolverTimeoutError:
        return _MinMemory(upper, best, False, "heuristic")
    if found is None:  # only through tolerances: the incumbent itself satisfies the model
        return _MinMemory(upper, best, False, "heuristic")
    model, status, backend = found
    starts = check_starts(prob, read_starts(model, prob))
    value = max(tab.evaluate(starts)[1])
    if value > upper:
        return _MinMemory(upper, best, status == "optimal", backend)
    return _MinMemory(value, starts, status == "optimal", backend)
