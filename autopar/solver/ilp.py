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

Solve: the LP relaxation (GLOP) first; if every ``x`` is within 1e-6 of 0/1 it is
optimal (backend ``"lp-relaxation"``).  Otherwise the MIP is solved by HiGHS
(fallback CBC, then SCIP) with a relative gap of 1e-4 and the time limit.  On
300-group x 8-strategy instances with a binding memory budget HiGHS reached the
optimum 2-3x faster than CBC, which often stopped at the time limit (and
overran it by seconds) with a gap above 1e-4.
Model construction is ordered and the solvers run single-threaded, so the same
problem always gives the same choice.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from autopar.errors import AutoparError, PlanError

__all__ = [
    "ILPEdge",
    "ILPProblem",
    "ILPSolution",
    "InfeasibleMemoryError",
    "SolverError",
    "SolverTimeoutError",
    "solve_ilp",
    "brute_force",
    "evaluate_choice",
    "min_memory_bytes",
]

_INTEGRALITY_TOL = 1e-6
_MIP_RELATIVE_GAP = 1e-4
_MIP_BACKENDS = ("HIGHS", "CBC", "SCIP")
_BACKEND_NAMES = {"CBC": "CBC", "SCIP": "SCIP", "HIGHS": "HiGHS"}
_BRUTE_FORCE_MAX = 10_000_000
_UNKNOWN_STATUS = 99  # what OR-Tools' HiGHS interface returns at its time limit (no incumbent exposed)
_FIRST_BACKEND_SHARE = 2 / 3  # of the remaining time, when a second backend can still take over
_LAST_BACKEND_SHARE = 0.9  # CBC overshoots its limit by up to a few seconds


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
    """One intra-operator sharding problem; see the module docstring for the math."""

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


class SolverError(AutoparError, RuntimeError):
    """The MIP backend failed (no backend available, or an abnormal status)."""


class SolverTimeoutError(SolverError):
    """The time limit passed before any feasible solution was found."""


# ----------------------------------------------------------------------------- helpers


def _group_name(problem: ILPProblem, g: int) -> str:
    if problem.names is not None and g < len(problem.names):
        return f"group {g} ({problem.names[g]!r})"
    return f"group {g}"


def _validate(problem: ILPProblem) -> None:
    n = len(problem.node_costs)
    if len(problem.node_memory) != n:
        raise ValueError(
            f"ILPProblem has {n} node_costs but {len(problem.node_memory)} node_memory entries; "
            "give one cost vector and one memory vector per variable group."
        )
    if problem.names is not None and len(problem.names) != n:
        raise ValueError(f"ILPProblem.names has {len(problem.names)} entries for {n} groups; give one name per group or None.")
    for g, (c, m) in enumerate(zip(problem.node_costs, problem.node_memory)):
        c, m = np.asarray(c), np.asarray(m)
        if c.ndim != 1 or c.size == 0 or c.shape != m.shape:
            raise ValueError(
                f"{_group_name(problem, g)}: node cost shape {c.shape} and memory shape {m.shape}; "
                "both must be the same non-empty 1-D shape (one entry per strategy)."
            )
        if not (np.all(np.isfinite(c)) and np.all(c >= 0) and np.all(np.isfinite(m)) and np.all(m >= 0)):
            raise ValueError(f"{_group_name(problem, g)}: node costs and memory must be finite and >= 0; got costs {c}, memory {m}.")
    for i, e in enumerate(problem.edges):
        if not (0 <= e.src < n and 0 <= e.dst < n):
            raise ValueError(f"edge {i} ({e.src} -> {e.dst}) references a group outside 0..{n - 1}; fix the group indices.")
        want = (len(problem.node_costs[e.src]), len(problem.node_costs[e.dst]))
        r = np.asarray(e.cost)
        if r.shape != want:
            raise ValueError(
                f"edge {i} ({_group_name(problem, e.src)} -> {_group_name(problem, e.dst)}) has cost shape "
                f"{r.shape}; required (n_strategies[src], n_strategies[dst]) = {want}."
            )
        if not (np.all(np.isfinite(r)) and np.all(r >= 0)):
            raise ValueError(f"edge {i} ({e.src} -> {e.dst}): resharding costs must be finite and >= 0.")
    if problem.memory_budget is not None and not (math.isfinite(problem.memory_budget) and problem.memory_budget >= 0):
        raise ValueError(f"memory_budget={problem.memory_budget!r}; give a finite number of bytes >= 0, or None.")
    if not (math.isfinite(problem.memory_constant) and problem.memory_constant >= 0):
        raise ValueError(f"memory_constant={problem.memory_constant!r}; give a finite number of bytes >= 0.")
    if not problem.time_limit_s > 0:
        raise ValueError(f"time_limit_s={problem.time_limit_s!r}; give a positive number of seconds (solver_time_limit_s).")


def evaluate_choice(problem: ILPProblem, choice: tuple[int, ...]) -> tuple[float, float]:
    """Return ``(cost_seconds, memory_bytes)`` of one strategy per group (memory includes the constant)."""
    cost = math.fsum(float(np.asarray(c)[s]) for c, s in zip(problem.node_costs, choice))
    cost += math.fsum(float(np.asarray(e.cost)[choice[e.src], choice[e.dst]]) for e in problem.edges)
    mem = problem.memory_constant + math.fsum(float(np.asarray(m)[s]) for m, s in zip(problem.node_memory, choice))
    return cost, mem


def min_memory_bytes(problem: ILPProblem) -> float:
    """Minimum per-device memory over all choices (exact: memory has no edge terms)."""
    return problem.memory_constant + math.fsum(float(np.min(m)) for m in problem.node_memory)


def _infeasible_error(problem: ILPProblem) -> InfeasibleMemoryError:
    required = min_memory_bytes(problem)
    budget = float(problem.memory_budget if problem.memory_budget is not None else math.inf)
    mins = sorted(((float(np.min(m)), g) for g, m in enumerate(problem.node_memory)), reverse=True)[:3]
    top = ", ".join(f"{_group_name(problem, g)}: {v / 2**30:.3f} GiB" for v, g in mins)
    msg = (
        f"no sharding plan fits the per-device memory budget: given {budget:.0f} bytes "
        f"({budget / 2**30:.3f} GiB), required at least {required:.0f} bytes ({required / 2**30:.3f} GiB) "
        f"with every group on its smallest-memory strategy (constant part {problem.memory_constant:.0f} bytes; "
        f"largest groups {top}). Fix: raise Config.memory_bytes, use more devices, or allow more "
        "tensor/pipeline parallelism so parameters and activations are split further."
    )
    return InfeasibleMemoryError(msg, required_bytes=required, budget_bytes=budget)


# ----------------------------------------------------------------------------- presolve


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
    for s in range(k):
        for t in range(k):
            if t != s and keep[t] and le[t, s] and (t < s or not le[s, t]):
                keep[s] = False
                break
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


def _presolve(problem: ILPProblem) -> tuple[_Reduced, float | None]:
    """Run the exact presolve; return the state and the memory slack (None when unconstrained)."""
    red = _normalise(problem)
    slack = None
    if problem.memory_budget is not None:
        slack = problem.memory_budget - min_memory_bytes(problem)
        slack += 1e-9 * max(problem.memory_budget, 1.0)  # tolerance for rounding in the sums
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


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class _Model:
    solver: pywraplp.Solver
    groups: tuple[int, ...]  # original index of each active group
    x: tuple[tuple[pywraplp.Variable, ...], ...]


def _build(solver: pywraplp.Solver, red: _Reduced, slack: float | None, integer: bool) -> _Model:
    """Build the Alpa formulation over the groups the presolve left open."""
    groups = tuple(g for g in range(len(red.opts)) if not red.fixed[g])
    idx = {g: i for i, g in enumerate(groups)}
    scale = max([float(red.cost[g].max()) for g in groups] + [float(m.max()) for m in red.edges.values()] + [0.0])
    scale = scale if scale > 0 else 1.0
    obj = solver.Objective()
    xs = []
    for g in groups:
        row = tuple(solver.BoolVar("") if integer else solver.NumVar(0.0, 1.0, "") for _ in red.opts[g])
        one = solver.Constraint(1.0, 1.0)
        for s, var in enumerate(row):
            one.SetCoefficient(var, 1.0)
            obj.SetCoefficient(var, float(red.cost[g][s]) / scale)
        xs.append(row)
    for (u, v), mat in sorted(red.edges.items()):
        _add_edge(solver, obj, xs[idx[u]], xs[idx[v]], mat / scale)
    if slack is not None:
        _add_memory(solver, red, groups, xs, slack)
    obj.SetMinimization()
    return _Model(solver, groups, tuple(xs))


def _add_edge(solver: pywraplp.Solver, obj: pywraplp.Objective, xu: tuple, xv: tuple, mat: np.ndarray) -> None:
    rows = [solver.Constraint(0.0, 0.0) for _ in xu]
    cols = [solver.Constraint(0.0, 0.0) for _ in xv]
    for s, ct in enumerate(rows):
        ct.SetCoefficient(xu[s], -1.0)
    for t, ct in enumerate(cols):
        ct.SetCoefficient(xv[t], -1.0)
    for s in range(len(xu)):
        for t in range(len(xv)):
            y = solver.NumVar(0.0, 1.0, "")
            rows[s].SetCoefficient(y, 1.0)
            cols[t].SetCoefficient(y, 1.0)
            if mat[s, t] != 0.0:
                obj.SetCoefficient(y, float(mat[s, t]))


def _add_memory(solver: pywraplp.Solver, red: _Reduced, groups: tuple[int, ...], xs: list, slack: float) -> None:
    """sum_g sum_s (m[g,s] - min_s m[g,s]) x[g,s] <= slack, scaled to O(1); skipped when it cannot bind."""
    extra = [red.mem[g] - red.mem[g].min() for g in groups]
    total_max = math.fsum(float(e.max()) for e in extra)
    if total_max <= slack:
        return
    mscale = max(float(e.max()) for e in extra)
    ct = solver.Constraint(-solver.infinity(), slack / mscale)
    for row, e in zip(xs, extra):
        for var, val in zip(row, e):
            if val != 0.0:
                ct.SetCoefficient(var, float(val) / mscale)


def _read_choice(model: _Model, red: _Reduced, n: int) -> tuple[tuple[int, ...], bool]:
    """Map the solver's x back to original strategy indices; also report whether x is integral."""
    choice = [int(red.opts[g][0]) if red.fixed[g] else -1 for g in range(n)]
    integral = True
    for g, row in zip(model.groups, model.x):
        vals = np.array([var.solution_value() for var in row])
        integral &= bool(np.all(np.minimum(np.abs(vals), np.abs(vals - 1.0)) <= _INTEGRALITY_TOL))
        choice[g] = int(red.opts[g][int(np.argmax(vals))])
    return tuple(choice), integral


# ----------------------------------------------------------------------------- solve


def _solution(problem: ILPProblem, choice: tuple[int, ...], status: str, gap: float, t0: float,
              backend: str, solver: pywraplp.Solver | None) -> ILPSolution:
    cost, mem = evaluate_choice(problem, choice)
    nv = solver.NumVariables() if solver is not None else 0
    nc = solver.NumConstraints() if solver is not None else 0
    return ILPSolution(choice, cost, status, gap, time.perf_counter() - t0, backend, nv, nc, mem)


def _solve_lp(red: _Reduced, slack: float | None, n: int, time_left_s: float) -> tuple[_Model, tuple[int, ...] | None]:
    """Solve the LP relaxation; return the model and the choice when the optimum is integral."""
    solver = pywraplp.Solver.CreateSolver("GLOP")
    model = _build(solver, red, slack, integer=False)
    solver.SetTimeLimit(max(1, int(time_left_s * 1000)))
    if solver.Solve() != pywraplp.Solver.OPTIMAL:
        return model, None
    choice, integral = _read_choice(model, red, n)
    return model, choice if integral else None


def _mip_solvers() -> list[tuple[pywraplp.Solver, str]]:
    """Up to two MIP backends in preference order (the second only runs if the first finds nothing)."""
    found = []
    for name in _MIP_BACKENDS:
        solver = pywraplp.Solver.CreateSolver(name)
        if solver is not None:
            if name == "HIGHS":
                solver.SetSolverSpecificParametersAsString("output_flag=false")  # no banner on stdout
            found.append((solver, _BACKEND_NAMES[name]))
    if not found:
        raise SolverError(
            f"none of the MIP backends {', '.join(_BACKEND_NAMES.values())} is available in this OR-Tools "
            "build (required: at least one); install an OR-Tools wheel that bundles HiGHS, CBC or SCIP "
            "(pip install -U ortools)."
        )
    return found[:2]


def _no_solution_error(code: int, tried: list[str], limit_s: float) -> SolverError:
    """Error for a MIP that ended without any feasible solution."""
    if code in (pywraplp.Solver.NOT_SOLVED, _UNKNOWN_STATUS):
        return SolverTimeoutError(
            f"{' and '.join(tried)} found no feasible sharding within the time limit of {limit_s:.1f} s "
            "(required: at least one feasible solution). Fix: raise Config.solver_time_limit_s, "
            "or shrink the problem (fewer strategies per op, more layer merging)."
        )
    return SolverError(
        f"{' and '.join(tried)} ended with status code {code} (required: OPTIMAL or FEASIBLE); "
        "this is a solver failure, please report the problem instance."
    )


def _solve_mip(problem: ILPProblem, red: _Reduced, slack: float | None, t0: float) -> ILPSolution:
    """Run the MIP; HiGHS reports no incumbent at its time limit, so CBC then gets the remaining time."""
    attempts = _mip_solvers()
    tried: list[str] = []
    code = pywraplp.Solver.NOT_SOLVED
    for i, (solver, backend) in enumerate(attempts):
        model = _build(solver, red, slack, integer=True)
        left = problem.time_limit_s - (time.perf_counter() - t0)
        share = _FIRST_BACKEND_SHARE if i + 1 < len(attempts) else _LAST_BACKEND_SHARE
        solver.SetTimeLimit(max(1, int(max(left * share, 0.02 * problem.time_limit_s) * 1000)))
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, _MIP_RELATIVE_GAP)
        code = solver.Solve(params)
        tried.append(backend)
        if code == pywraplp.Solver.INFEASIBLE:
            raise _infeasible_error(problem)
        if code in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            return _mip_solution(problem, red, model, code, backend, t0)
    raise _no_solution_error(code, tried, problem.time_limit_s)


def _mip_solution(problem: ILPProblem, red: _Reduced, model: _Model, code: int, backend: str, t0: float) -> ILPSolution:
    objective = model.solver.Objective()
    value, bound = objective.Value(), objective.BestBound()
    gap = abs(value - bound) / max(abs(value), 1e-12) if math.isfinite(bound) else math.inf
    gap = 0.0 if gap < 1e-12 else gap
    status = "optimal" if code == pywraplp.Solver.OPTIMAL or gap <= _MIP_RELATIVE_GAP else "feasible"
    choice, _ = _read_choice(model, red, len(problem.node_costs))
    return _solution(problem, choice, status, gap, t0, backend, model.solver)


def solve_ilp(problem: ILPProblem) -> ILPSolution:
    """Solve the intra-operator sharding ILP exactly (within a 1e-4 relative gap).

    Presolves, tries the LP relaxation (returned as ``"lp-relaxation"`` when
    integral) and otherwise runs the MIP.  Raises :class:`InfeasibleMemoryError`
    when no choice fits ``memory_budget``, :class:`SolverTimeoutError` when no
    feasible solution is found within ``time_limit_s`` and ``ValueError`` for a
    malformed problem.
    """
    t0 = time.perf_counter()
    _validate(problem)
    n = len(problem.node_costs)
    if problem.memory_budget is not None and min_memory_bytes(problem) > problem.memory_budget * (1 + 1e-12):
        raise _infeasible_error(problem)
    red, slack = _presolve(problem)
    if all(red.fixed):
        choice = tuple(int(o[0]) for o in red.opts)
        return _solution(problem, choice, "optimal", 0.0, t0, "presolve", None)
    model, choice = _solve_lp(red, slack, n, problem.time_limit_s)
    if choice is not None:
        return _solution(problem, choice, "optimal", 0.0, t0, "lp-relaxation", model.solver)
    return _solve_mip(problem, red, slack, t0)


def brute_force(problem: ILPProblem) -> ILPSolution:
    """Enumerate every choice (for small problems and tests); ties pick the lexicographically smallest choice."""
    t0 = time.perf_counter()
    _validate(problem)
    shape = tuple(len(c) for c in problem.node_costs)
    if math.prod(shape) > _BRUTE_FORCE_MAX:
        raise ValueError(f"brute_force over {math.prod(shape)} choices; at most {_BRUTE_FORCE_MAX} are allowed. Use solve_ilp.")
    n = len(shape)
    cost = np.zeros(shape)
    mem = np.full(shape, float(problem.memory_constant))
    for g in range(n):
        view = [1] * n
        view[g] = shape[g]
        cost = cost + np.asarray(problem.node_costs[g], dtype=np.float64).reshape(view)
        mem = mem + np.asarray(problem.node_memory[g], dtype=np.float64).reshape(view)
    for e in problem.edges:
        r = np.asarray(e.cost, dtype=np.float64)
        view = [1] * n
        if e.src == e.dst:
            view[e.src] = shape[e.src]
            cost = cost + np.diag(r).reshape(view)
            continue
        view[e.src], view[e.dst] = shape[e.src], shape[e.dst]
        cost = cost + (r if e.src < e.dst else r.T).reshape(view)
    if problem.memory_budget is not None:
        cost = np.where(mem <= problem.memory_budget * (1 + 1e-12), cost, np.inf)
    flat = int(np.argmin(cost))
    if not math.isfinite(float(cost.flat[flat])):
        raise _infeasible_error(problem)
    choice = tuple(int(i) for i in np.unravel_index(flat, shape)) if n else ()
    return _solution(problem, choice, "optimal", 0.0, t0, "brute-force", None)

