"""Tests of the pipeline stage-cut solver against exhaustive enumeration from the definitions.

Tolerances: every objective is a sum of the same layer costs, evaluated with
``math.fsum`` by the module; two optimal cuts can still differ by float
rounding (different layers in the bottleneck stage), and the MIP runs with a
relative gap of 1e-9 and an absolute gap of 0, so objectives are compared with
``REL = 1e-9`` relative.  Memory budgets are respected up to the module's
documented 1e-9 relative tolerance (``fits``).
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest

import autopar.solver.stage_cuts as sc
from autopar.errors import PlanError
from autopar.solver.ilp import InfeasibleMemoryError
from autopar.solver.stage_cuts import (
    CutResult,
    LayerCost,
    brute_force_cuts,
    default_in_flight,
    evaluate_cuts,
    min_feasible_memory,
    solve_cuts,
    solve_cuts_dp,
)

REL = 1e-9
MIP_BACKENDS = {"HiGHS", "CBC"}
MS, GB = 1e-3, 1e9


def fits(memory: float, budget: float | None) -> bool:
    """The module's rule: rank memory within the budget up to 1e-9 relative."""
    return budget is None or memory <= budget * (1 + 1e-9)


# ----------------------------------------------------------------------------- reference from the definitions


def reference(layers, p, m, v=1, in_flight=None, budget=None, w=None):
    """(starts, objective, bottleneck, peak rank memory, fits) of every cut, straight from the definition."""
    n, s = len(layers), p * v
    w = p - 1 if w is None else w
    flight = [min(p - j % p, m) for j in range(s)] if in_flight is None else list(in_flight)
    out = []
    for cuts in itertools.combinations(range(1, n), s - 1):
        starts = (0, *cuts)
        ends = (*cuts, n)
        times, mems = [], []
        for j, (k, e) in enumerate(zip(starts, ends)):
            t = math.fsum(lay.forward_s + lay.backward_s for lay in layers[k:e])
            if j < s - 1:
                t += layers[e - 1].send_s
            times.append(t)
            mems.append(math.fsum(lay.state_bytes for lay in layers[k:e])
                        + flight[j] * math.fsum(lay.activation_bytes for lay in layers[k:e]))
        ranks = [sum(times[j] for j in range(r, s, p)) for r in range(p)]
        peak = max(sum(mems[j] for j in range(r, s, p)) for r in range(p))
        out.append((starts, m * max(ranks) + w * max(times), max(times), peak, fits(peak, budget)))
    return out


def best_of(rows):
    """Optimal objective among fitting cuts, and the cuts within REL of it."""
    feasible = [r for r in rows if r[4]]
    best = min(r[1] for r in feasible)
    return best, [r[0] for r in feasible if r[1] <= best * (1 + REL)]


def random_case(seed: int):
    """2-10 layers, p <= 4, v in {1, 2}; odd seeds use quarter-step costs so that ties are common."""
    rs = np.random.RandomState(seed)
    discrete = seed % 2 == 1
    while True:
        n, p, v = int(rs.randint(2, 11)), int(rs.randint(1, 5)), int(rs.randint(1, 3))
        if p * v <= n:
            break

    def val(scale: float) -> float:
        return float(rs.randint(0, 5) / 4 if discrete else rs.rand()) * scale

    layers = [LayerCost(f"l{i}", val(MS), val(2 * MS), val(GB), val(GB), val(0.3 * MS)) for i in range(n)]
    return layers, p, int(rs.randint(1, 9)), v


def budget_for(rows, rs: np.random.RandomState) -> float:
    """A budget between the smallest and the largest peak memory over cuts (often binding)."""
    lo, hi = min(r[3] for r in rows), max(r[3] for r in rows)
    return lo + float(rs.rand()) * 0.6 * (hi - lo)


# ----------------------------------------------------------------------------- exactness on small cases


@pytest.mark.parametrize("with_budget", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_ilp_matches_enumeration(seed: int, with_budget: bool) -> None:
    layers, p, m, v = random_case(seed)
    rows = reference(layers, p, m, v)
    budget = budget_for(rows, np.random.RandomState(500 + seed)) if with_budget else None
    rows = reference(layers, p, m, v, budget=budget)
    best, optimal_cuts = best_of(rows)
    prob = sc.make_problem(layers, p, m, v, None, None)
    results = {
        "strengthened": solve_cuts(layers, p, m, v, memory_budget_bytes=budget),
        # the bare formulation of the module docstring, without DP bounds, incumbent or exclusions
        "bare": sc._solve_cuts_ilp(prob, budget, 30.0, strengthen=False),
    }
    for label, res in results.items():
        assert res.status == "optimal", label
        assert res.objective_s == pytest.approx(best, rel=REL, abs=0), label
        assert res.starts in optimal_cuts, label
        if len(optimal_cuts) == 1:
            assert res.starts == optimal_cuts[0], label
        assert fits(max(res.rank_memory_bytes), budget), label
        assert (res.stage_time_s, res.rank_memory_bytes, res.objective_s) == evaluate_cuts(layers, res.starts, p, m, v)
    if p * v > 1:  # one stage is answered without a model; otherwise the MIP, not the incumbent, must answer
        assert results["bare"].backend in MIP_BACKENDS
        assert results["strengthened"].backend in MIP_BACKENDS


@pytest.mark.parametrize("with_budget", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_brute_force_and_dp_match_enumeration(seed: int, with_budget: bool) -> None:
    layers, p, m, v = random_case(seed)
    rows = reference(layers, p, m, v)
    budget = budget_for(rows, np.random.RandomState(500 + seed)) if with_budget else None
    rows = reference(layers, p, m, v, budget=budget)
    best, optimal_cuts = best_of(rows)
    brute = brute_force_cuts(layers, p, m, v, memory_budget_bytes=budget)
    assert brute.objective_s == pytest.approx(best, rel=REL, abs=0)
    assert brute.starts == min(optimal_cuts)  # documented tie rule: lexicographically smallest
    assert brute.backend == "brute-force" and brute.status == "optimal"
    if v == 1:
        dp = solve_cuts_dp(layers, p, m, memory_budget_bytes=budget)
        ilp = solve_cuts(layers, p, m, memory_budget_bytes=budget)
        assert dp.objective_s == pytest.approx(best, rel=REL, abs=0)
        assert dp.objective_s == pytest.approx(ilp.objective_s, rel=REL, abs=0)
        # DP tie rule: the lexicographically smallest cut with the smallest bottleneck
        bottleneck = min(r[2] for r in rows if r[4])
        assert dp.starts == min(r[0] for r in rows if r[4] and r[2] == bottleneck)
        assert dp.backend == "dp"


@pytest.mark.parametrize("seed", range(20))
def test_min_feasible_memory_matches_enumeration(seed: int) -> None:
    layers, p, m, v = random_case(seed)
    want = min(r[3] for r in reference(layers, p, m, v))
    # 1e-12: the module's fsum per stage and the reference's per rank agree up to one rounding per rank
    assert min_feasible_memory(layers, p, m, v) == pytest.approx(want, rel=1e-12, abs=0)


def test_dp_tie_rule_prefers_earlier_cuts() -> None:
    layers = [LayerCost(f"l{i}", 1 * MS, 2 * MS, GB, GB) for i in range(5)]  # 2+3 and 3+2 tie
    dp = solve_cuts_dp(layers, 2, 4)
    assert dp.starts == (0, 2) == brute_force_cuts(layers, 2, 4).starts
    assert solve_cuts(layers, 2, 4).objective_s == pytest.approx(dp.objective_s, rel=REL)


# ----------------------------------------------------------------------------- the cost model


def test_evaluate_cuts_by_hand() -> None:
    # a = 3, 6, 9, 12, 15 ms; sends 0.1 .. 0.5 ms; p = 2, v = 2; stages [0] [1] [2, 3] [4]
    layers = [LayerCost(f"l{i}", (i + 1) * MS, 2 * (i + 1) * MS, 10 * (i + 1), i + 1, 0.1 * (i + 1) * MS)
              for i in range(5)]
    times, mems, objective = evaluate_cuts(layers, (0, 1, 2, 4), ranks=2, microbatches=4, virtual_stages=2)
    # t_j = work + send of the stage's last layer, except the last stage
    assert times == pytest.approx((3.1 * MS, 6.2 * MS, 21.4 * MS, 15 * MS), rel=1e-12)
    # default in_flight = min(p - j % p, m) = (2, 1, 2, 1): rank 0 = (10 + 2*1) + (70 + 2*7)
    assert mems == pytest.approx((96.0, 77.0), rel=1e-12)
    # m * max_r R_r + (p - 1) * max_j t_j with R = (3.1 + 21.4, 6.2 + 15)
    assert objective == pytest.approx(4 * 24.5 * MS + 21.4 * MS, rel=1e-12)
    _, mems, objective = evaluate_cuts(layers, (0, 1, 2, 4), 2, 4, 2, in_flight=(3, 3, 3, 3), bubble_weight=0.0)
    assert mems == pytest.approx((10 + 3 + 70 + 21, 20 + 6 + 50 + 15), rel=1e-12)
    assert objective == pytest.approx(4 * 24.5 * MS, rel=1e-12)


def test_default_in_flight() -> None:
    assert default_in_flight(4, 8) == (4, 3, 2, 1)
    assert default_in_flight(4, 2) == (2, 2, 2, 1)
    assert default_in_flight(4, 8, 2) == (4, 3, 2, 1, 4, 3, 2, 1)


# ----------------------------------------------------------------------------- behaviour on model shapes


def gpt_chain(blocks: int, seed: int | None = None) -> list[LayerCost]:
    """Embedding (large vocab), ``blocks`` transformer blocks, LM head; optional +-15 % jitter on the blocks."""
    rs = np.random.RandomState(seed) if seed is not None else None
    out = [LayerCost("embedding", 1 * MS, 2 * MS, 6 * GB, 0.2 * GB, 0.05 * MS)]
    for i in range(blocks):
        j = 1.0 if rs is None else 1.0 + 0.3 * (float(rs.rand()) - 0.5)
        out.append(LayerCost(f"block{i}", j * MS / 3, j * 2 * MS / 3, 1.2 * GB, 0.4 * GB, 0.05 * MS))
    out.append(LayerCost("lm_head", 4 * MS / 3, 8 * MS / 3, 6 * GB, 0.8 * GB, 0.0))
    return out


def test_heavy_ends_get_fewer_blocks() -> None:
    # embedding 3, blocks 1, head 4 (ms per microbatch): equal layer counts put 5 ms on the ends
    layers = gpt_chain(8)
    p, m = 4, 8
    res = solve_cuts(layers, p, m)
    naive = (0, 3, 6, 8)  # 10 layers in 3 + 3 + 2 + 2
    naive_times, _, naive_obj = evaluate_cuts(layers, naive, p, m)
    counts = np.diff([*res.starts, len(layers)])
    assert len(set(counts.tolist())) > 1, "the cut must not simply split layer counts evenly"
    first_blocks, last_blocks = counts[0] - 1, counts[-1] - 1  # minus the embedding / head
    assert first_blocks < max(counts[1:-1]) and last_blocks < max(counts[1:-1])
    assert max(res.stage_time_s) < max(naive_times) - 0.5 * MS  # 4.05 ms against 5.05 ms
    assert res.objective_s < naive_obj
    assert res.objective_s == pytest.approx(solve_cuts_dp(layers, p, m).objective_s, rel=REL)


def test_memory_bound_first_stage_holds_fewer_layers() -> None:
    # 16 equal layers, p = 4, m = 8: default in flight (4, 3, 2, 1), a stage of n layers holds n (1 + f_j) GB
    layers = [LayerCost(f"l{i}", 1 * MS, 2 * MS, GB, GB, 0.01 * MS) for i in range(16)]
    p, m = 4, 8
    free = solve_cuts(layers, p, m)
    assert free.starts == (0, 4, 8, 12)  # even split without a budget (the unique optimum)
    budget = 15 * GB  # stage 0 fits 3 layers (15 GB), stage 1 3 (12), stage 2 5 (15), stage 3 7 (14)
    res = solve_cuts(layers, p, m, memory_budget_bytes=budget)
    counts = np.diff([*res.starts, len(layers)])
    assert counts[0] < counts[-1]
    assert counts[0] == 3 and counts[1] == 3 and max(counts) == 5
    assert max(res.rank_memory_bytes) <= budget * (1 + 1e-9)
    assert res.objective_s > free.objective_s
    assert res.objective_s == pytest.approx(solve_cuts_dp(layers, p, m, memory_budget_bytes=budget).objective_s,
                                            rel=REL)


@pytest.mark.parametrize("v", [1, 2])
def test_infeasible_budget_reports_minimum(v: int) -> None:
    layers = gpt_chain(10, seed=3)
    p, m = 3, 6
    required = min_feasible_memory(layers, p, m, v)
    assert required == min(r[3] for r in reference(layers, p, m, v))
    bad = 0.99 * required
    solvers = [solve_cuts, brute_force_cuts] + ([solve_cuts_dp] if v == 1 else [])
    for solver in solvers:
        with pytest.raises(InfeasibleMemoryError) as info:
            solver(layers, p, m, v, memory_budget_bytes=bad)
        err = info.value
        assert err.required_bytes == pytest.approx(required, rel=1e-12), solver.__name__
        assert err.budget_bytes == bad
        assert isinstance(err, PlanError) and isinstance(err, ValueError)
        text = str(err)
        assert f"{bad:.0f} bytes" in text and f"{required:.0f} bytes" in text
        assert "pipeline stages" in text and "tensor parallelism" in text and "recomputation" in text
    at_min = solve_cuts(layers, p, m, v, memory_budget_bytes=required)
    assert max(at_min.rank_memory_bytes) <= required * (1 + 1e-9)
    best, _ = best_of(reference(layers, p, m, v, budget=required))
    assert at_min.objective_s == pytest.approx(best, rel=REL)


def test_single_layer_too_large_says_so() -> None:
    layers = [LayerCost("small", MS, MS, GB, 0.0), LayerCost("huge", MS, MS, 50 * GB, 0.0),
              LayerCost("small2", MS, MS, GB, 0.0)]
    with pytest.raises(InfeasibleMemoryError) as info:
        solve_cuts(layers, 3, 4, memory_budget_bytes=10 * GB)
    assert info.value.required_bytes == 50 * GB
    assert "'huge'" in str(info.value)


@pytest.mark.parametrize("p", [8, 16, 32])
def test_96_layers_matches_dp(p: int) -> None:
    layers = gpt_chain(94, seed=p)
    m = 4 * p
    t0 = time.perf_counter()
    res = solve_cuts(layers, p, m)
    t_ilp = time.perf_counter() - t0
    dp = solve_cuts_dp(layers, p, m)
    print(f"96 layers p={p}: ILP {t_ilp:.2f} s ({res.backend}), DP {dp.solve_time_s:.3f} s")
    assert res.status == "optimal"
    assert res.objective_s == pytest.approx(dp.objective_s, rel=REL)
    assert len(res.starts) == p and res.starts[0] == 0


def test_96_layers_with_budget_matches_dp() -> None:
    layers = gpt_chain(94, seed=1)
    p, m = 16, 32
    budget = 1.05 * min_feasible_memory(layers, p, m)
    res = solve_cuts(layers, p, m, memory_budget_bytes=budget)
    dp = solve_cuts_dp(layers, p, m, memory_budget_bytes=budget)
    assert res.objective_s == pytest.approx(dp.objective_s, rel=REL)
    assert max(res.rank_memory_bytes) <= budget * (1 + 1e-9)
    assert res.objective_s > solve_cuts_dp(layers, p, m).objective_s  # the budget binds


def test_interleaved_time_limit_returns_a_good_cut() -> None:
    # p = 8, v = 2 on 96 layers cannot be proven optimal quickly: the result must still be a valid, good cut
    layers = gpt_chain(94, seed=0)
    p, m, v = 8, 32, 2
    res = solve_cuts(layers, p, m, v, time_limit_s=2.0)
    assert isinstance(res, CutResult) and res.status in ("feasible", "optimal")
    assert res.status == "optimal" or res.backend in MIP_BACKENDS | {"heuristic"}
    equal = tuple(int(x) for x in np.linspace(0, len(layers), p * v + 1)[:-1].round())
    assert res.objective_s < evaluate_cuts(layers, equal, p, m, v)[2]
    # lower bound: m * (total work / p) + (p - 1) * (total work / S)
    work = math.fsum(lay.forward_s + lay.backward_s for lay in layers)
    bound = m * work / p + (p - 1) * work / (p * v)
    assert res.objective_s <= 1.05 * bound  # within 5 % of a simple lower bound (found: about 2.5 %)


# ----------------------------------------------------------------------------- validation


def test_input_validation() -> None:
    layers = [LayerCost(f"l{i}", MS, MS, GB, GB) for i in range(4)]
    with pytest.raises(ValueError, match="stages but only 4 layers"):
        solve_cuts(layers, 5, 4)
    with pytest.raises(ValueError, match="stages but only 4 layers"):
        solve_cuts(layers, 3, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="ranks=0"):
        solve_cuts(layers, 0, 4)
    with pytest.raises(ValueError, match="microbatches=0"):
        solve_cuts_dp(layers, 2, 0)
    with pytest.raises(ValueError, match="virtual_stages=0"):
        brute_force_cuts(layers, 2, 4, 0)
    neg = [*layers[:3], LayerCost("bad", MS, -MS, GB, GB)]
    with pytest.raises(ValueError, match="backward_s"):
        solve_cuts(neg, 2, 4)
    with pytest.raises(ValueError, match="in_flight has 3 entries"):
        solve_cuts(layers, 2, 4, in_flight=(1, 1, 1))
    with pytest.raises(ValueError, match="in_flight"):
        solve_cuts(layers, 2, 4, in_flight=(1, -1))
    with pytest.raises(ValueError, match="memory_budget_bytes"):
        solve_cuts(layers, 2, 4, memory_budget_bytes=-1.0)
    with pytest.raises(ValueError, match="bubble_weight"):
        solve_cuts(layers, 2, 4, bubble_weight=math.nan)
    with pytest.raises(ValueError, match="time_limit_s"):
        solve_cuts(layers, 2, 4, time_limit_s=0)
    with pytest.raises(ValueError, match="layers is empty"):
        solve_cuts([], 1, 1)
    with pytest.raises(ValueError, match="virtual_stages=1"):
        solve_cuts_dp(layers, 2, 4, virtual_stages=2)
    with pytest.raises(ValueError, match="starts"):
        evaluate_cuts(layers, (0, 2, 2), 3, 4)
    with pytest.raises(ValueError, match="starts"):
        evaluate_cuts(layers, (1, 2), 2, 4)
    many = [LayerCost(f"l{i}", MS, MS, GB, GB) for i in range(40)]
    with pytest.raises(ValueError, match="at most 200000"):
        brute_force_cuts(many, 8, 4)  # C(39, 7) = 15,380,937 cuts


def test_single_stage_and_one_layer_per_stage() -> None:
    layers = [LayerCost(f"l{i}", MS, MS, GB, GB, 0.1 * MS) for i in range(3)]
    one = solve_cuts(layers, 1, 4)
    assert one.starts == (0,) and one.objective_s == pytest.approx(4 * 6 * MS)  # bubble weight p - 1 = 0
    each = solve_cuts(layers, 3, 4)
    assert each.starts == (0, 1, 2) == solve_cuts_dp(layers, 3, 4).starts
