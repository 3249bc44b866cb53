"""Pipeline stage cuts: split a chain of layers into contiguous pipeline stages.

A model is a chain of ``L`` layers in execution order (embedding, blocks, head).
It is cut into ``S = p * v`` stages of contiguous layers (``p`` pipeline ranks,
``v`` virtual chunks per rank); stage ``j`` runs on rank ``j % p`` and every
stage holds at least one layer.  With ``a_l = forward_s + backward_s`` of layer
``l`` (per microbatch) the cost model is::

    t_j  = sum_{l in j} a_l + [j < S - 1] * send_s(last layer of j)     stage time per microbatch
    R_r  = sum_{j : j % p = r} t_j                                      rank work per microbatch
    mem_r = sum_{j : j % p = r} ( sum_{l in j} state_l + f_j * sum_{l in j} act_l )
    objective = m * max_r R_r + w * max_j t_j

``m`` is the number of microbatches, ``w`` the bubble weight (default ``p - 1``)
and ``f_j`` the number of microbatches whose activations stage ``j`` keeps at
its peak (``in_flight``).  For ``v = 1`` the objective is ``(m + p - 1) * max_j
t_j``, the 1F1B/GPipe step time set by the bottleneck stage; for ``v > 1`` it
generalises the interleaved step time ``(m + (p - 1) / v) * t`` of Megatron-LM
(Narayanan et al., SC'21, section 2.2) to unequal stages: ``m`` rounds of the
busiest rank plus a bubble of ``p - 1`` chunk times.  Memory must satisfy
``mem_r <= B`` on every rank when a per-device budget ``B`` is given.

Default ``in_flight`` (when the caller passes None): ``f_j = min(p - j % p, m)``,
the 1F1B count (stage ``i`` of ``p`` holds ``p - i`` microbatches).  For ``v > 1``
the same per-rank count is used for every chunk of a rank; the interleaved
schedule really keeps more microbatches in flight on the early ranks, so
callers should pass the schedule simulator's counts.

ILP (:func:`solve_cuts`).  Cumulative binaries ``z[l, j] = 1`` iff layer ``l``
lies in a stage ``<= j``, for ``j = 0 .. S - 2`` (``z[l, -1] = 0`` and
``z[l, S - 1] = 1`` are constants)::

    variables    z[l, j] in {0, 1};   T >= 0;   Rmax >= 0   (Rmax is T itself when v = 1)
    fixed        z[l, j] = 1 for l <= j;   z[l, j] = 0 for l >= L - S + 1 + j   (stages are non-empty)
    order        z[l + 1, j] <= z[l, j]                      stages are prefixes: contiguous
                 z[l, j] <= z[l + 1, j + 1]                  no stage is skipped: every stage non-empty
    membership   x[l, j] = z[l, j] - z[l, j - 1]             layer l is in stage j
    last layer   c[l, j] = z[l, j] - z[l + 1, j]             l is the last layer of stage j < S - 1
    time         t_j = sum_l a_l x[l, j] + sum_{l < L-1} send_l c[l, j] <= T        every j
    rank         sum_{j % p = r} t_j <= Rmax,   T <= Rmax                           every r (v > 1)
    memory       sum_{j % p = r} sum_l (state_l + f_j act_l) x[l, j] <= B           every r (B given)
    bounds       T >= max_l a_l,   T >= sum_l a_l / S,   Rmax >= sum_l a_l / p
    objective    min  m * Rmax + w * T

Stages are ordered, so there is no symmetry to break; the "last layer"
indicator is linear in ``z`` (no extra variables) and ``x``, ``c`` are
substituted, leaving ``(S - 1)(L - S)`` binaries.  Time rows are scaled by the
largest ``a_l + send_l``, memory rows by ``B``.

Strengthening.  The bare model above is exact but its LP relaxation balances
fractional layers, so proving a bottleneck optimum is pigeonhole-hard: on 96
layers (GPT-like chain) HiGHS needs ~1-5 s for p = 8, 16 and does not finish
p = 32 within 30 s.  Three valid additions fix v = 1:

* ``T >= T_lb``, where ``T_lb`` is the smallest bottleneck over cuts whose
  *stages* each fit the budget (the DP of :func:`solve_cuts_dp`).  A rank holds
  at least its stages, so this relaxes every ``v``; for ``v = 1`` it is exact.
  ``Rmax >= max(T_lb, (sum_l a_l + the S - 1 cheapest sends) / p)``.
* An incumbent cut with objective ``U`` (v = 1: the DP cut; v > 1: local search
  from the DP cut, from the sum-of-squares DP cut and, with a budget, from the
  smallest-memory cut).  Every cut at least as good has
  ``T <= tau = min(U / (m + w), (U - m Rmax_lb) / w, Rmax_ub)`` and
  ``Rmax <= Rmax_ub = (U - w T_lb) / m`` (both widened by 1e-9 so ties stay).
* Interval exclusions ``z[e - 1, j] <= z[k, j - 1]`` ("stage j does not contain
  layers [k, e)") for the shortest ``[k, e)`` whose smallest possible stage time
  exceeds ``tau`` or whose stage memory exceeds ``B``: one row per (j, k).

With them v = 1 on 96 layers solves in 0.1-0.5 s for p = 8 .. 32.  For v > 1
the rank sums remain pigeonhole-hard (96 layers, p = 8, v = 2: HiGHS's bound
stays ~3 % below the best cut after 20 s); the result is then the better of
the MIP's and the incumbent's cut with status ``"feasible"`` (backend
``"heuristic"`` for the incumbent).

Solve: relative gap 1e-9 and absolute gap 0 (exact for 1e-9 comparisons),
HiGHS first with 2/3 of the time, CBC with the rest when HiGHS ends without a
solution (OR-Tools' HiGHS interface exposes no incumbent at its time limit; it
also crashes on solution hints, so none are given).  The limit is approximate
(CBC can overrun it by about a second).  Model construction is ordered, so a
solve that finishes is deterministic; one cut short by the time limit can
depend on machine speed.  The chosen cut is re-evaluated exactly with
:func:`evaluate_cuts`; a cut that breaks the budget by more than the 1e-9
relative tolerance (possible only through the backend's feasibility
tolerance) is re-solved once with a slightly tighter row.

Exact references: :func:`solve_cuts_dp` (``v = 1``, dynamic programming over
(stage, first layer), O(S L^2)) and :func:`brute_force_cuts` (every one of the
``C(L - 1, S - 1)`` cuts, any ``v``).  :func:`min_feasible_memory` is the
smallest budget any cut fits: the same DP with stage memory for ``v = 1``; for
``v > 1`` a min-max-memory MIP (same ``z`` rows, ``mem_r <= M``, min ``M``)
between the stage-memory DP bound and a local-search cut (the same pigeonhole
difficulty: 96 layers, p = 8, v = 2 takes 12 s or more).

A cut fits the budget when every rank's memory is ``<= B * (1 + 1e-9)``.  All
sums are ``math.fsum`` over layers in order, so every solver reports identical
numbers for the same cut.
"""


from __future__ import annotations

import math
import time
from collections.abc import Sequence

from autopar.solver.mip import SolverError, SolverTimeoutError

from autopar.solver.cut_core import (  # noqa: F401  (the public types are re-exported)
    CutResult,
    default_in_flight,
    evaluate_cuts,
    LayerCost,
    CUT_MIP_RELATIVE_GAP,
    CutProblem,
    RETRY_TIGHTEN,
    CutTables,
    all_cuts,
    bottleneck_dp,
    effective_budget,
    check_starts,
    fits_budget,
    format_gib,
    infeasible_error,
    make_problem,
    make_result,
)
from autopar.solver.cut_mip import (  # noqa: F401
    CutBounds,
    min_memory_cut,
    cut_bounds,
    build_cut_model,
    memory_exclusions,
    find_incumbent,
    local_search,
    build_memory_model,
    read_starts,
    relaxed_bottleneck,
    run_cut_mip,
)

__all__ = [
    "LayerCost",
    "CutResult",
    "evaluate_cuts",
    "solve_cuts",
    "solve_cuts_dp",
    "brute_force_cuts",
    "min_feasible_memory",
    "default_in_flight",
]


def solve_cuts_dp(
    layers: Sequence[LayerCost],
    ranks: int,
    microbatches: int,
    virtual_stages: int = 1,
    in_flight: Sequence[float] | None = None,
    memory_budget_bytes: float | None = None,
    bubble_weight: float | None = None,
) -> CutResult:
    """Exact dynamic programme for ``virtual_stages == 1`` (ValueError otherwise).

    With one stage per rank the objective is ``(m + w) * max_j t_j``, so the DP
    minimises the bottleneck stage time over (stage, first layer) states with
    every stage's memory within the budget, in O(S L^2).  Ties: among the cuts
    with the smallest bottleneck, the lexicographically smallest ``starts`` is
    returned.  Raises :class:`InfeasibleMemoryError` when no cut fits.
    """
    t0 = time.perf_counter()
    prob = make_problem(layers, ranks, microbatches, virtual_stages, in_flight, bubble_weight)
    budget = effective_budget(memory_budget_bytes)
    if prob.v != 1:
        raise ValueError(f"solve_cuts_dp needs virtual_stages=1 (given {prob.v}): with several chunks per rank the "
                         "objective is not a bottleneck; use solve_cuts or brute_force_cuts.")
    tab = CutTables(prob)
    found = relaxed_bottleneck(prob, tab, budget)  # exact for v = 1: a rank is its one stage
    if found is None:
        assert budget is not None
        least = min_memory_cut(prob, tab, 1.0)
        raise infeasible_error(prob, budget, least.value, least.starts)
    return make_result(tab, found[1], "optimal", "dp", t0)


def brute_force_cuts(
    layers: Sequence[LayerCost],
    ranks: int,
    microbatches: int,
    virtual_stages: int = 1,
    in_flight: Sequence[float] | None = None,
    memory_budget_bytes: float | None = None,
    bubble_weight: float | None = None,
) -> CutResult:
    """Enumerate all ``C(L - 1, S - 1)`` cuts (any ``virtual_stages``; ValueError above 200,000).

    Ties: the lexicographically smallest ``starts`` among those with the
    smallest objective.  Raises :class:`InfeasibleMemoryError` when no cut fits.
    """
    t0 = time.perf_counter()
    prob = make_problem(layers, ranks, microbatches, virtual_stages, in_flight, bubble_weight)
    budget = effective_budget(memory_budget_bytes)
    tab = CutTables(prob)
    best, arg = math.inf, None
    min_mem, min_arg = math.inf, None
    for starts in all_cuts(prob):
        _, mems, objective = tab.evaluate(starts)
        peak = max(mems)
        if peak < min_mem:
            min_mem, min_arg = peak, starts
        if fits_budget(peak, budget) and objective < best:
            best, arg = objective, starts
    if arg is None:
        assert budget is not None and min_arg is not None
        raise infeasible_error(prob, budget, min_mem, min_arg)
    return make_result(tab, arg, "optimal", "brute-force", t0)





def min_feasible_memory(
    layers: Sequence[LayerCost],
    ranks: int,
    microbatches: int,
    virtual_stages: int = 1,
    in_flight: Sequence[float] | None = None,
    time_limit_s: float = 30.0,
) -> float:
    """Smallest per-device memory budget for which some cut fits: ``min over cuts of max_r mem_r``.

    Exact: a DP for ``virtual_stages == 1``; otherwise a min-max-memory MIP
    (relative gap 1e-9) bounded by the DP over stages and a local-search cut;
    raises :class:`SolverTimeoutError` if the MIP cannot prove the minimum in
    ``time_limit_s``.  ``microbatches`` only matters through the default
    ``in_flight``.  The value is the exact evaluation of the minimising cut, so
    passing it as ``memory_budget_bytes`` to :func:`solve_cuts` succeeds.
    """
    prob = make_problem(layers, ranks, microbatches, virtual_stages, in_flight, None)
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s={time_limit_s!r}; required: a positive number of seconds.")
    found = min_memory_cut(prob, CutTables(prob), time_limit_s)
    if not found.proven:
        raise SolverTimeoutError(
            f"could not prove the minimum per-device memory within {time_limit_s:.1f} s; the best cut found needs "
            f"{format_gib(found.value)} (starts {found.starts}). Fix: raise time_limit_s."
        )
    return found.value


def _raise_infeasible(prob: CutProblem, tab: CutTables, budget: float, time_limit_s: float, t0: float) -> CutResult:
    """Raise InfeasibleMemoryError; returns the minimum-memory cut when it does fit after all (tolerances)."""
    left = max(time_limit_s - (time.perf_counter() - t0), 0.1 * time_limit_s)
    found = min_memory_cut(prob, tab, left)
    if not fits_budget(found.value, budget):
        raise infeasible_error(prob, budget, found.value, found.starts, found.proven)
    return make_result(tab, found.starts, "feasible", found.backend, t0)


def _solve_cuts_ilp(prob: CutProblem, budget: float | None, time_limit_s: float, strengthen: bool) -> CutResult:
    """The MIP path of :func:`solve_cuts`; ``strengthen=False`` runs the bare formulation (for tests)."""
    t0 = time.perf_counter()
    tab = CutTables(prob)
    if prob.n_stages == 1:
        if budget is not None and not fits_budget(max(tab.evaluate((0,))[1]), budget):
            return _raise_infeasible(prob, tab, budget, time_limit_s, t0)
        return make_result(tab, (0,), "optimal", "dp", t0)
    incumbent, bounds = None, CutBounds()
    if strengthen:
        relaxed = relaxed_bottleneck(prob, tab, budget)
        if relaxed is None:  # not even each stage alone fits, so no rank can
            assert budget is not None
            return _raise_infeasible(prob, tab, budget, time_limit_s, t0)
        incumbent = find_incumbent(prob, tab, budget, relaxed[1])
        bounds = cut_bounds(prob, tab, budget, relaxed[0], incumbent[0] if incumbent else math.inf)
    mip: tuple[tuple[int, ...], str, str] | None = None
    for tighten in (0.0, RETRY_TIGHTEN):
        try:
            found = run_cut_mip(lambda s, tg=tighten: build_cut_model(s, prob, budget, tg, bounds), prob, time_limit_s, t0)
        except SolverTimeoutError as err:
            if incumbent is not None:
                break
            if budget is None:
                raise
            least = min_memory_cut(prob, tab, 0.0, exact=False)
            raise SolverTimeoutError(
                f"{err} No cut within the budget of {format_gib(budget)} was found either way; the smallest-memory cut "
                f"found needs {format_gib(least.value)} (starts {least.starts}): the budget may be infeasible. Fix: raise "
                "time_limit_s or the budget, or see min_feasible_memory."
            ) from None
        if found is None:
            break
        model, status, backend = found
        starts = check_starts(prob, read_starts(model, prob))
        if budget is None or fits_budget(max(tab.evaluate(starts)[1]), budget):
            mip = (starts, status, backend)
            break
    inc_obj = incumbent[0] if incumbent is not None else math.inf
    if mip is not None:
        # A proven MIP optimum is kept unless the incumbent beats it by more than the gap (float ties
        # between equally good cuts are not a reason to switch); an unproven one only when no worse.
        mip_obj = tab.evaluate(mip[0])[2]
        if mip_obj <= inc_obj * (1.0 + (CUT_MIP_RELATIVE_GAP if mip[1] == "optimal" else 0.0)):
            return make_result(tab, mip[0], mip[1], mip[2], t0)
    if incumbent is not None:
        # v = 1: the relaxed bottleneck is exact, so the incumbent is the DP optimum.  Otherwise it is
        # optimal only when the MIP proved that nothing beats it.
        proven = prob.v == 1 or (mip is not None and mip[1] == "optimal")
        return make_result(tab, incumbent[1], "optimal" if proven else "feasible", "dp" if prob.v == 1 else "heuristic", t0)
    if budget is None:
        raise SolverError("the stage-cut MIP was reported infeasible without a memory budget; this is a solver "
                          "failure, please report the problem instance.")
    return _raise_infeasible(prob, tab, budget, time_limit_s, t0)


def solve_cuts(
    layers: Sequence[LayerCost],
    ranks: int,
    microbatches: int,
    virtual_stages: int = 1,
    in_flight: Sequence[float] | None = None,
    memory_budget_bytes: float | None = None,
    bubble_weight: float | None = None,
    time_limit_s: float = 30.0,
) -> CutResult:
    """Optimal stage cut by the MIP of the module docstring (HiGHS, then CBC).

    Minimises ``microbatches * max_r R_r + bubble_weight * max_j t_j``
    (``bubble_weight`` defaults to ``ranks - 1``) with every rank's memory within
    ``memory_budget_bytes`` (no limit when None).  ``in_flight`` gives each
    stage's in-flight microbatches (default ``min(p - j % p, m)``).  Ties
    between optimal cuts are broken by the backend (deterministically).

    When the MIP cannot prove optimality in ``time_limit_s`` the best cut known
    is returned with status ``"feasible"`` (the MIP's, or the local-search
    incumbent's with backend ``"heuristic"``); for ``virtual_stages == 1`` the
    DP-derived incumbent is optimal and is returned as ``"optimal"``/``"dp"``.
    Raises :class:`InfeasibleMemoryError` when no cut fits the budget (with the
    smallest budget that would), :class:`SolverTimeoutError` when the time limit
    passes with no cut known, and ``ValueError`` for malformed inputs.
    """
    prob = make_problem(layers, ranks, microbatches, virtual_stages, in_flight, bubble_weight)
    budget = effective_budget(memory_budget_bytes)
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s={time_limit_s!r}; required: a positive number of seconds.")
    return _solve_cuts_ilp(prob, budget, float(time_limit_s), strengthen=True)

