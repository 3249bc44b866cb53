"""Tests of the intra-operator sharding ILP against exhaustive enumeration."""

from __future__ import annotations

import dataclasses
import itertools
import math
import time

import numpy as np
import pytest
from ortools.linear_solver import linear_solver_pb2, pywraplp

import autopar.solver.ilp as ilp
from autopar.solver.formulation import formulate, load, variable_records
from autopar.errors import AutoparError, PlanError
from autopar.solver.mip import SolverTimeoutError
from autopar.solver.ilp import (
    ILPEdge,
    ILPProblem,
    InfeasibleMemoryError,
    brute_force,
    solve_ilp,
)

MIP_BACKENDS = {"HiGHS", "CBC", "SCIP"}


def _values(rs: np.random.RandomState, shape: tuple[int, ...], discrete: bool) -> np.ndarray:
    """Continuous values, or a few discrete levels so that ties (and dominance) are common."""
    return rs.randint(0, 4, size=shape) / 4.0 if discrete else rs.rand(*shape)


def random_problem(seed: int, budget_frac: float | None = None) -> ILPProblem:
    """2-6 groups, 1-4 strategies, random edges plus a self edge, a duplicate and a reversed duplicate."""
    rs = np.random.RandomState(seed)
    discrete = seed % 2 == 1
    n = rs.randint(2, 7)
    ks = [int(k) for k in rs.randint(1, 5, size=n)]
    costs = tuple(_values(rs, (k,), discrete) for k in ks)
    mem = tuple(rs.randint(0, 100, size=k).astype(float) * 1e6 for k in ks)
    edges = []
    for _ in range(rs.randint(1, 2 * n)):
        u, v = (int(i) for i in rs.randint(n, size=2))
        edges.append(ILPEdge(u, v, _values(rs, (ks[u], ks[v]), discrete)))
    g = int(rs.randint(n))
    edges.append(ILPEdge(g, g, _values(rs, (ks[g], ks[g]), discrete)))
    u, v = edges[0].src, edges[0].dst
    edges.append(ILPEdge(u, v, _values(rs, (ks[u], ks[v]), discrete)))
    edges.append(ILPEdge(v, u, _values(rs, (ks[v], ks[u]), discrete)))
    constant = 5e6
    budget = None
    if budget_frac is not None:
        lo, hi = sum(m.min() for m in mem), sum(m.max() for m in mem)
        budget = constant + lo + budget_frac * (hi - lo)
    return ILPProblem(costs, mem, tuple(edges), budget, memory_constant=constant)


def enumerate_all(problem: ILPProblem) -> list[tuple[tuple[int, ...], float, float]]:
    """(choice, cost, memory) of every choice, computed directly from the definition."""
    out = []
    for choice in itertools.product(*(range(len(c)) for c in problem.node_costs)):
        cost = sum(float(c[s]) for c, s in zip(problem.node_costs, choice))
        cost += sum(float(e.cost[choice[e.src], choice[e.dst]]) for e in problem.edges)
        mem = problem.memory_constant + sum(float(m[s]) for m, s in zip(problem.node_memory, choice))
        out.append((choice, cost, mem))
    return out


def frustrated_triangle() -> ILPProblem:
    """Odd cycle that wants neighbours to differ: LP optimum 0 at x = 1/2, integer optimum 1."""
    diff = np.array([[1.0, 0.0], [0.0, 1.0]])
    costs = tuple(np.zeros(2) for _ in range(3))
    mem = tuple(np.zeros(2) for _ in range(3))
    edges = (ILPEdge(0, 1, diff), ILPEdge(1, 2, diff), ILPEdge(2, 0, diff))
    return ILPProblem(costs, mem, edges, None, names=("a", "b", "c"))


def knapsack_problem() -> ILPProblem:
    """No edges; a binding budget lets only one group keep its cheap, memory-hungry strategy."""
    costs = tuple(np.array([0.0, 1.0 + 0.1 * g]) for g in range(4))
    mem = tuple(np.array([10.0, 0.0]) for _ in range(4))
    return ILPProblem(costs, mem, (), memory_budget=15.0)


def large_problem(seed: int, budget_frac: float | None, time_limit_s: float = 30.0) -> ILPProblem:
    """300 groups x 8 strategies: a chain plus random long-range edges (~400 edges in all)."""
    rs = np.random.RandomState(seed)
    n, k = 300, 8
    costs = tuple(rs.rand(k) * 1e-3 for _ in range(n))
    mem = tuple(rs.randint(1, 1000, size=k).astype(float) * 1e6 for _ in range(n))
    pairs = [(i, i + 1) for i in range(n - 1)]
    pairs += [tuple(int(i) for i in sorted(rs.choice(n, 2, replace=False))) for _ in range(400 - (n - 1))]
    edges = tuple(ILPEdge(u, v, rs.rand(k, k) * 1e-3) for u, v in pairs)
    budget = None
    if budget_frac is not None:
        lo, hi = sum(m.min() for m in mem), sum(m.max() for m in mem)
        budget = lo + budget_frac * (hi - lo)
    return ILPProblem(costs, mem, edges, budget, time_limit_s=time_limit_s)


# ----------------------------------------------------------------------------- exactness


@pytest.mark.parametrize("seed", range(12))
def test_brute_force_matches_definition(seed: int) -> None:
    problem = random_problem(seed, budget_frac=0.5)
    feasible = [(c, cost, m) for c, cost, m in enumerate_all(problem) if m <= problem.memory_budget]
    best = min(cost for _, cost, _ in feasible)
    sol = brute_force(problem)
    assert sol.objective == pytest.approx(best, rel=1e-9, abs=1e-12)
    assert sol.memory_bytes <= problem.memory_budget


@pytest.mark.parametrize("seed", range(40))
def test_unconstrained_matches_brute_force(seed: int) -> None:
    problem = random_problem(seed)
    sol, ref = solve_ilp(problem), brute_force(problem)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(ref.objective, rel=1e-6, abs=1e-12)
    assert ilp.evaluate_choice(problem, sol.choice) == pytest.approx((sol.objective, sol.memory_bytes))


@pytest.mark.parametrize("seed", range(40))
def test_memory_budget_matches_brute_force(seed: int) -> None:
    frac = float(np.random.RandomState(1000 + seed).rand())
    problem = random_problem(seed, budget_frac=frac)
    sol, ref = solve_ilp(problem), brute_force(problem)
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(ref.objective, rel=1e-6, abs=1e-12)
    assert sol.memory_bytes <= problem.memory_budget * (1 + 1e-9)


def test_budget_exactly_at_minimum_memory_is_feasible() -> None:
    problem = random_problem(3)
    required = min(m for _, _, m in enumerate_all(problem))
    tight = ILPProblem(problem.node_costs, problem.node_memory, problem.edges, required, problem.memory_constant)
    sol, ref = solve_ilp(tight), brute_force(tight)
    assert sol.memory_bytes == pytest.approx(required)
    assert sol.objective == pytest.approx(ref.objective, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("seed", range(8))
def test_infeasible_memory_reports_minimum(seed: int) -> None:
    problem = random_problem(seed)
    required = min(m for _, _, m in enumerate_all(problem))
    bad = ILPProblem(problem.node_costs, problem.node_memory, problem.edges, required * 0.99, problem.memory_constant)
    with pytest.raises(InfeasibleMemoryError) as info:
        solve_ilp(bad)
    assert info.value.required_bytes == pytest.approx(required, rel=1e-12)
    assert info.value.budget_bytes == pytest.approx(required * 0.99)
    assert isinstance(info.value, PlanError) and isinstance(info.value, ValueError)
    assert "memory_bytes" in str(info.value) and "more devices" in str(info.value)
    with pytest.raises(InfeasibleMemoryError):
        brute_force(bad)


# ----------------------------------------------------------------------------- solver paths


def test_chain_lp_relaxation_is_integral() -> None:
    rs = np.random.RandomState(7)
    n, k = 8, 4
    costs = tuple(rs.rand(k) for _ in range(n))
    mem = tuple(rs.rand(k) * 1e6 for _ in range(n))
    edges = tuple(ILPEdge(i, i + 1, rs.rand(k, k)) for i in range(n - 1))
    problem = ILPProblem(costs, mem, edges, None)
    sol = solve_ilp(problem)
    assert sol.backend == "lp-relaxation"
    assert sol.status == "optimal" and sol.gap == 0.0
    assert sol.num_variables == n * k + (n - 1) * k * k
    assert sol.objective == pytest.approx(brute_force(problem).objective, rel=1e-6)


def test_fractional_lp_cycle_goes_to_mip() -> None:
    problem = frustrated_triangle()
    solver = pywraplp.Solver.CreateSolver("GLOP")
    red, slack = ilp._presolve(problem)
    model = ilp._write(red, slack, integer=False).load(solver)
    assert solver.Solve() == pywraplp.Solver.OPTIMAL
    assert not ilp._positions(model.groups, ilp._values(model))[1], "the LP relaxation of this instance must be fractional"
    sol = solve_ilp(problem)
    assert sol.backend in MIP_BACKENDS
    assert sol.status == "optimal"
    assert sol.objective == pytest.approx(1.0) == brute_force(problem).objective


def test_fractional_lp_knapsack_goes_to_mip() -> None:
    problem = knapsack_problem()
    sol = solve_ilp(problem)
    assert sol.backend in MIP_BACKENDS
    assert sol.objective == pytest.approx(brute_force(problem).objective) == pytest.approx(3.3)
    assert sol.memory_bytes <= 15.0


def test_single_strategy_and_dominated_groups_are_presolved() -> None:
    costs = (np.array([2.0]), np.array([1.0, 1.0, 3.0]), np.array([0.5, 0.5]))
    mem = (np.array([4.0]), np.array([1.0, 1.0, 1.0]), np.array([2.0, 2.0]))
    edges = (ILPEdge(0, 1, np.array([[0.0, 0.0, 1.0]])), ILPEdge(1, 2, np.ones((3, 2))))
    sol = solve_ilp(ILPProblem(costs, mem, edges, None))
    assert sol.backend == "presolve" and sol.num_variables == 0
    assert sol.choice == (0, 0, 0)  # ties keep the lowest index
    assert sol.objective == pytest.approx(2.0 + 1.0 + 0.5 + 1.0)


def test_timeout_falls_back_to_lp_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = knapsack_problem()
    monkeypatch.setattr(ilp, "_solve_mip", lambda *a: (None, pywraplp.Solver.NOT_SOLVED, ["HiGHS", "CBC"]))
    sol = solve_ilp(problem)
    ref = brute_force(problem)
    assert sol.backend == "lp-rounding"
    assert sol.memory_bytes <= problem.memory_budget
    assert sol.objective == pytest.approx(ref.objective) == pytest.approx(3.3)  # greedy repair is exact here
    # LP bound: groups 0 and 1 pay 1.0 + 1.1, group 2 pays half of 1.2 (budget holds 1.5 big strategies)
    assert sol.gap == pytest.approx((3.3 - 2.7) / 3.3)
    assert sol.status == "feasible"


def test_no_solution_at_all_raises_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    problem = frustrated_triangle()
    real_lp = ilp._solve_lp

    def no_lp(*args: object) -> ilp._LPResult:
        lp = real_lp(*args)
        return dataclasses.replace(lp, values=(), pos=None, integral=False, bound=-math.inf)

    monkeypatch.setattr(ilp, "_solve_lp", no_lp)
    monkeypatch.setattr(ilp, "_solve_mip", lambda *a: (None, pywraplp.Solver.NOT_SOLVED, ["HiGHS", "CBC"]))
    with pytest.raises(SolverTimeoutError, match="solver_time_limit_s") as info:
        solve_ilp(problem)
    assert isinstance(info.value, RuntimeError)


# ----------------------------------------------------------------------------- determinism and validation


@pytest.mark.parametrize("make", [frustrated_triangle, knapsack_problem, lambda: random_problem(5, 0.4)])
def test_deterministic(make: object) -> None:
    problem = make()  # type: ignore[operator]
    first, second = solve_ilp(problem), solve_ilp(problem)
    assert first.choice == second.choice
    assert first.objective == second.objective and first.backend == second.backend


def test_all_ties_pick_lowest_indices() -> None:
    costs = tuple(np.ones(3) for _ in range(4))
    mem = tuple(np.ones(3) for _ in range(4))
    edges = (ILPEdge(0, 1, np.ones((3, 3))), ILPEdge(1, 2, np.ones((3, 3))), ILPEdge(2, 0, np.ones((3, 3))))
    assert solve_ilp(ILPProblem(costs, mem, edges, 10.0)).choice == (0, 0, 0, 0)


def test_empty_problem() -> None:
    sol = solve_ilp(ILPProblem((), (), (), None, memory_constant=3.0))
    assert sol.choice == () and sol.objective == 0.0 and sol.memory_bytes == 3.0


@pytest.mark.parametrize(
    "problem, needle",
    [
        (ILPProblem((np.ones(2),), (np.ones(3),), (), None), "same non-empty 1-D shape"),
        (ILPProblem((np.ones(2),), (np.ones(2),), (ILPEdge(0, 1, np.ones((2, 2))),), None), "0..0"),
        (ILPProblem((np.ones(2),), (np.ones(2),), (ILPEdge(0, 0, np.ones((2, 3))),), None), "(2, 2)"),
        (ILPProblem((-np.ones(2),), (np.ones(2),), (), None), "finite and >= 0"),
        (ILPProblem((np.ones(2),), (np.ones(2),), (), None, time_limit_s=0.0), "solver_time_limit_s"),
        (ILPProblem((np.ones(2),), (np.ones(2),), (), None, names=("a", "b")), "one name"),
    ],
)
def test_malformed_problem_is_rejected(problem: ILPProblem, needle: str) -> None:
    with pytest.raises(ValueError, match="required") as info:
        solve_ilp(problem)
    assert needle in str(info.value)


# ----------------------------------------------------------------------------- scale


def test_large_problem_unconstrained() -> None:
    problem = large_problem(seed=0, budget_frac=None)
    t0 = time.perf_counter()
    sol = solve_ilp(problem)
    assert time.perf_counter() - t0 < 30.0
    assert sol.status in ("optimal", "feasible")
    greedy = tuple(int(np.argmin(c)) for c in problem.node_costs)
    assert sol.objective <= ilp.evaluate_choice(problem, greedy)[0]


@pytest.mark.slow
@pytest.mark.parametrize("time_limit_s", [5.0, 20.0])
def test_large_problem_with_binding_budget(time_limit_s: float) -> None:
    problem = large_problem(seed=2, budget_frac=0.3, time_limit_s=time_limit_s)
    t0 = time.perf_counter()
    sol = solve_ilp(problem)
    assert time.perf_counter() - t0 < time_limit_s + 10.0
    assert sol.status in ("optimal", "feasible")
    assert sol.memory_bytes <= problem.memory_budget * (1 + 1e-9)
    assert 0.0 <= sol.gap < 0.1


def test_a_time_limited_solve_reaches_the_plan_as_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the solver stops at its time limit, the plan keeps its best feasible choice, records
    status and gap, and warns with the fix."""
    import dataclasses

    import autopar
    import autopar.solver.intra_op as intra_op
    from models import build

    real = intra_op.solve_ilp
    monkeypatch.setattr(intra_op, "solve_ilp",
                        lambda p: dataclasses.replace(real(p), status="feasible", gap=0.05))
    model, inputs = build("mlp")
    plan = autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2), inputs,
                        config=autopar.Config(tp=2, solver_time_limit_s=7))
    assert plan.solver["status"] == "feasible" and plan.solver["gap"] == 0.05
    assert any("time limit (7" in w and "gap 0.05" in w and "solver_time_limit_s" in w
               for w in plan.warnings), plan.warnings


def test_variable_records_are_protobufs_own_encoding() -> None:
    """The numpy-written variables of the intra-operator model parse as protobuf writes them."""
    lower, upper, obj = np.array([0.0, -1.5, 0.0]), np.array([1.0, 2.0, np.inf]), np.array([0.25, 0.0, -3.0])
    for integer in (False, True):
        ref = linear_solver_pb2.MPModelProto()
        for lo, hi, c in zip(lower, upper, obj):
            ref.variable.add(lower_bound=lo, upper_bound=hi, objective_coefficient=c,
                             **({"is_integer": True} if integer else {}))
        got = linear_solver_pb2.MPModelProto.FromString(variable_records(lower, upper, obj, integer))
        assert got == ref, (integer, got, ref)
        assert got.SerializeToString() == ref.SerializeToString()


def _call_by_call(solver: pywraplp.Solver, costs, edges, extra, slack: float) -> None:
    """The model :func:`formulate` writes, built with one pywraplp call per term (the order
    of variables, constraints and terms included): the build it replaced."""
    xs = []
    for c in costs:
        row = [solver.BoolVar("") for _ in c]
        one = solver.Constraint(1.0, 1.0)
        for var, value in zip(row, c):
            one.SetCoefficient(var, 1.0)
            solver.Objective().SetCoefficient(var, float(value))
        xs.append(row)
    for u, v, mat in edges:
        rows = [solver.Constraint(0.0, 0.0) for _ in xs[u]]
        cols = [solver.Constraint(0.0, 0.0) for _ in xs[v]]
        for ct, var in [*zip(rows, xs[u]), *zip(cols, xs[v])]:
            ct.SetCoefficient(var, -1.0)
        for s, t in itertools.product(range(mat.shape[0]), range(mat.shape[1])):
            y = solver.NumVar(0.0, 1.0, "")
            rows[s].SetCoefficient(y, 1.0)
            cols[t].SetCoefficient(y, 1.0)
            solver.Objective().SetCoefficient(y, float(mat[s, t]))
    if extra is None:
        return
    ct = solver.Constraint(-solver.infinity(), slack)
    for row, e in zip(xs, extra):
        for var, value in zip(row, e):
            if value != 0.0:
                ct.SetCoefficient(var, float(value))


@pytest.mark.parametrize("with_memory", [True, False])
def test_the_written_model_is_the_one_built_call_by_call(with_memory: bool) -> None:
    """Loaded into a solver, the written model exports the same variables (bounds, objective,
    integrality) and constraints (bounds and terms, in order) as the call-by-call build, and
    solves to the same choice."""
    rng = np.random.default_rng(3)
    costs = [rng.random(k) for k in (2, 3, 1, 3)]
    edges = [(0, 1, rng.random((2, 3))), (1, 3, rng.random((3, 3))), (2, 3, rng.random((1, 3)))]
    extra = [np.array([0.0, 1.0]), np.array([0.5, 0.0, 0.0]), np.zeros(1), np.array([0.0, 0.25, 1.0])]
    extra = extra if with_memory else None
    ref = pywraplp.Solver.CreateSolver("CBC")
    _call_by_call(ref, costs, edges, extra, 1.0)
    loaded = load(pywraplp.Solver.CreateSolver("CBC"), formulate(costs, edges, extra, 1.0, integer=True))
    assert [len(r) for r in loaded.x] == [2, 3, 1, 3]
    want, got = linear_solver_pb2.MPModelProto(), linear_solver_pb2.MPModelProto()
    ref.ExportModelToProto(want)
    loaded.solver.ExportModelToProto(got)
    assert list(got.variable) == list(want.variable)
    assert len(got.constraint) == len(want.constraint) == 4 + 2 + 3 + 3 + 3 + 1 + 3 + with_memory
    for a, b in zip(got.constraint, want.constraint):
        assert (a.lower_bound, a.upper_bound) == (b.lower_bound, b.upper_bound)
        assert (list(a.var_index), list(a.coefficient)) == (list(b.var_index), list(b.coefficient))
    assert ref.Solve() == loaded.solver.Solve() == pywraplp.Solver.OPTIMAL
    assert [v.solution_value() for v in ref.variables()] == \
        [v.solution_value() for v in loaded.solver.variables()]


def test_the_written_model_refuses_rows_that_do_not_fit_their_groups() -> None:
    """An edge matrix or a memory row of the wrong size would read another group's variables."""
    costs = [np.ones(2), np.ones(3)]
    with pytest.raises(ValueError, match=r"shape \(3, 2\).*\(2, 3\)"):
        formulate(costs, [(0, 1, np.ones((3, 2)))], None, 0.0, integer=False)
    with pytest.raises(ValueError, match="groups in 0..1"):
        formulate(costs, [(0, 2, np.ones((2, 3)))], None, 0.0, integer=False)
    with pytest.raises(ValueError, match=r"lengths \[3, 3\]"):
        formulate(costs, [], [np.ones(3), np.ones(3)], 1.0, integer=False)


def test_the_ilp_objective_is_written_scaled() -> None:
    """``solver.ilp._write`` scales node and edge costs by one factor (the largest cost) and
    the memory row by the largest extra memory: the loaded model's objective times the scale
    is the problem's objective of the same choice."""
    problem = knapsack_problem()
    problem = ILPProblem(problem.node_costs, problem.node_memory,
                         (ILPEdge(0, 1, np.array([[0.0, 2.0], [0.5, 0.0]])),), problem.memory_budget)
    red, slack = ilp._presolve(problem)
    written = ilp._write(red, slack, integer=True)
    model = written.load(pywraplp.Solver.CreateSolver("CBC"))
    assert model.solver.Solve() == pywraplp.Solver.OPTIMAL
    pos, _ = ilp._positions(model.groups, ilp._values(model))
    choice = ilp._full_choice(red, pos)
    assert model.solver.Objective().Value() * written.scale == pytest.approx(
        ilp._reduced_value(red, pos), rel=1e-12)
    assert choice == brute_force(problem).choice and written.scale == pytest.approx(2.0)


def test_a_rounding_within_the_gap_of_the_lp_bound_skips_the_mip(monkeypatch) -> None:
    """A fractional LP whose rounding the local search brings to the LP bound is solved without
    the MIP: here the LP is made to answer the worst strategy of every group with the true
    bound, and the search walks to the optimum."""
    rng = np.random.default_rng(0)
    costs = tuple(rng.random(3) for _ in range(5))
    edges = tuple(ILPEdge(g, g + 1, 0.01 * rng.random((3, 3))) for g in range(4))
    problem = ILPProblem(costs, tuple(np.zeros(3) for _ in range(5)), edges, None)
    best = brute_force(problem)
    real_lp = ilp._solve_lp

    def fractional(red, slack, limit):
        lp = real_lp(red, slack, limit)
        assert len(lp.pos) == 5  # (nothing presolved away: the search has all to do)
        return dataclasses.replace(lp, pos={g: int(np.argmax(red.cost[g])) for g in lp.pos}, integral=False)

    monkeypatch.setattr(ilp, "_solve_lp", fractional)
    monkeypatch.setattr(ilp, "_solve_mip", lambda *a: pytest.fail("the MIP ran"))
    sol = solve_ilp(problem)
    assert (sol.backend, sol.status, sol.choice) == ("lp-rounding", "optimal", best.choice)
    assert sol.objective == pytest.approx(best.objective, rel=1e-12)


def test_the_local_search_keeps_the_memory_budget() -> None:
    """From every group on its lean, dear strategy, the search moves groups to the cheap one
    while the budget allows: one of the four (10 + 10 bytes would pass the 15)."""
    problem = knapsack_problem()
    red, slack = ilp._presolve(problem)
    pos = ilp._improve(red, {g: 1 for g in range(4)}, slack)
    _, memory = ilp.evaluate_choice(problem, ilp._full_choice(red, pos))
    assert sorted(pos.values()) == [0, 1, 1, 1] and memory <= problem.memory_budget
    assert ilp._improve(red, {g: 1 for g in range(4)}, None) == {g: 0 for g in range(4)}


def test_a_large_fixed_cost_does_not_let_a_rounding_pass_for_optimal() -> None:
    """The frustrated triangle beside a fixed group of cost 1e6: the rounding (1 against the LP
    bound 0) is within 1e-6 of the bound on the whole objective but not on the part the MIP
    optimises, so the MIP still runs and proves it."""
    tri = frustrated_triangle()
    problem = ILPProblem((*tri.node_costs, np.array([1e6])), (*tri.node_memory, np.zeros(1)),
                         tri.edges, None)
    sol = solve_ilp(problem)
    assert sol.backend in MIP_BACKENDS and sol.status == "optimal", sol
    assert sol.objective == pytest.approx(1e6 + 1.0)


@pytest.mark.parametrize("budget", [None, 15.0])
def test_the_groups_the_lp_leaves_fractional_are_solved_exactly_within_the_budget(monkeypatch, budget) -> None:
    """Groups u and v want to agree ((0, 0) costs 0, (1, 1) 1, mixed 10): from (1, 1) neither
    moves alone, so the local search stops there. With the LP made to leave u and v fractional
    and set w and x (half the groups free), the MIP over u and v alone finds (0, 0), at the LP
    bound, and the full MIP does not run. With a budget that (0, 0) exceeds (each of u and v
    holds 10 bytes on its option 0), the answer stays within it: (1, 1), the optimum."""
    costs = (np.zeros(2), np.zeros(2), np.array([0.0, 1.0]), np.array([0.0, 1.0]))
    mem = (np.array([10.0, 0.0]), np.array([10.0, 0.0]), np.zeros(2), np.zeros(2))
    nudge = np.array([[0.0, 0.5], [0.0, 0.0]])  # (keeps w's and x's options apart in presolve)
    edges = (ILPEdge(0, 1, np.array([[0.0, 10.0], [10.0, 1.0]])), ILPEdge(2, 0, nudge), ILPEdge(3, 2, nudge))
    problem = ILPProblem(costs, mem, edges, budget)
    best = brute_force(problem)
    start = {0: 1, 1: 1, 2: 0, 3: 0}
    red, slack = ilp._presolve(problem)
    assert not any(red.fixed) and ilp._improve(red, dict(start), slack) == start
    real_lp = ilp._solve_lp

    def stuck(red, slack, limit):  # (the whole problem's LP; the neighbourhood's as it is)
        lp = real_lp(red, slack, limit)
        return dataclasses.replace(lp, pos=dict(start), integral=False) if len(lp.pos) == 4 else lp

    monkeypatch.setattr(ilp, "_solve_lp", stuck)
    monkeypatch.setattr(ilp, "_settled", lambda lp: {2: 0, 3: 0} if len(lp.groups) == 4 else {})
    if budget is None:
        monkeypatch.setattr(ilp, "_solve_mip", lambda *a: pytest.fail("the MIP ran"))
    sol = solve_ilp(problem)
    assert sol.choice == best.choice == ((0, 0, 0, 0) if budget is None else (1, 1, 0, 0))
    assert sol.memory_bytes <= (budget or math.inf)
    if budget is None:
        assert (sol.backend, sol.status) == ("lp-rounding", "optimal")


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 4, 5, 7, 11])  # (seed 6: the presolve settles 5 of 6)
def test_the_neighbourhood_is_the_best_choice_of_its_free_groups(monkeypatch, seed: int) -> None:
    """Random problems (uneven edge matrices in both orientations, memory on every group, a
    budget that binds, options the presolve drops): holding half the open groups at a feasible
    choice, the neighbourhood's answer is the cheapest choice of the other half within the
    budget (enumerated), and keeps the held groups as they were."""
    rng = np.random.default_rng(seed)
    sizes = (2, 3, 2, 3, 2, 3)
    costs = tuple(rng.random(k) for k in sizes)
    mem = tuple(rng.integers(0, 6, k).astype(float) for k in sizes)
    pairs = ((0, 1), (2, 1), (1, 3), (4, 3), (5, 4), (0, 5), (2, 3))
    edges = tuple(ILPEdge(u, v, rng.random((sizes[u], sizes[v])) * rng.integers(0, 2, (sizes[u], sizes[v])))
                  for u, v in pairs)
    budget = float(sum(m.min() for m in mem) + 8)
    problem = ILPProblem(costs, mem, edges, budget, time_limit_s=30.0)
    red, slack = ilp._presolve(problem)
    open_ = [g for g in range(len(sizes)) if not red.fixed[g]]
    assert len(open_) >= 5  # (the neighbourhood has groups to solve: not a case passed by refusing)
    extra = {g: red.mem[g] - red.mem[g].min() for g in open_}
    fits = [dict(zip(open_, c)) for c in itertools.product(*(range(len(red.opts[g])) for g in open_))
            if sum(extra[g][s] for g, s in zip(open_, c)) <= slack]
    pos = fits[int(rng.integers(len(fits)))]
    held = open_[::2]  # (every other: free groups on both ends of edges to held ones)
    monkeypatch.setattr(ilp, "_settled", lambda lp: {g: pos[g] for g in held})
    lp = ilp._LPResult(tuple(open_), (), dict(pos), False, 0.0, (0, 0))
    got = ilp._neighbourhood(problem, red, lp, dict(pos), slack, time.perf_counter())
    best = min((c for c in fits if all(c[g] == pos[g] for g in held)), key=lambda c: ilp._reduced_value(red, c))
    assert all(got[g] == pos[g] for g in held)
    assert sum(extra[g][got[g]] for g in open_) <= slack
    assert ilp._reduced_value(red, got) == pytest.approx(ilp._reduced_value(red, best), rel=1e-4, abs=1e-12)


@pytest.mark.parametrize("backend", ["HIGHS_LP", "GLOP"])
def test_the_relaxation_solved_from_the_written_message_is_the_loaded_models(monkeypatch, backend) -> None:
    """``_solve_lp`` hands the written model to the backend as a message: its bound, every x
    and the sizes are those of the same model loaded into a ``pywraplp.Solver`` and solved
    there, and a whole solve through it equals brute force (HiGHS's LP, and GLOP where a build
    lacks it)."""
    monkeypatch.setattr(ilp, "_lp_backend", lambda: backend)
    for seed in range(4):
        problem = random_problem(seed, 0.5)
        red, slack = ilp._presolve(problem)
        lp = ilp._solve_lp(red, slack, 30.0)
        written = ilp._write(red, slack, integer=False)
        solver = pywraplp.Solver.CreateSolver(backend)
        solver.SetSolverSpecificParametersAsString("output_flag=false" if backend == "HIGHS_LP" else "")
        model = written.load(solver)
        assert solver.Solve() == pywraplp.Solver.OPTIMAL
        assert lp.bound == pytest.approx(solver.Objective().Value() * written.scale, rel=1e-9)
        assert lp.size == (solver.NumVariables(), solver.NumConstraints()) and lp.groups == model.groups
        loaded = ilp._values(model)
        assert [len(v) for v in lp.values] == [len(v) for v in loaded]
        assert all(np.allclose(a, b, rtol=0, atol=1e-9) for a, b in zip(lp.values, loaded))
        assert (lp.pos, lp.integral) == ilp._positions(model.groups, ilp._values(model))
        sol, ref = solve_ilp(problem), brute_force(problem)
        assert sol.objective == pytest.approx(ref.objective, rel=1e-6)


def test_a_relaxation_the_backend_refuses_raises_with_its_words() -> None:
    """A model OR-Tools refuses (here a NaN cost, which ``validate_problem`` would have
    stopped before) is a bug of autopar's: raised, with the status and OR-Tools' message, not
    taken for an LP that ran out of time."""
    red, slack = ilp._presolve(random_problem(1, 0.5))
    g = next(g for g in range(len(red.opts)) if not red.fixed[g])
    red.cost[g][0] = math.nan
    with pytest.raises(AutoparError, match="refused the intra-operator LP .MPSOLVER_MODEL_INVALID"):
        ilp._solve_lp(red, slack, 30.0)
