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

import itertools
import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from autopar.solver.ilp import InfeasibleMemoryError, SolverError, SolverTimeoutError

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

_MEM_RTOL = 1e-9  # a cut fits when rank memory <= budget * (1 + _MEM_RTOL)
_MIP_RELATIVE_GAP = 1e-9
_MIP_BACKENDS = (("HIGHS", "HiGHS"), ("CBC", "CBC"))  # (OR-Tools id, reported name)
_HIGHS_OPTIONS = "output_flag=false\nmip_abs_gap=0\nprimal_feasibility_tolerance=1e-9"
_UNKNOWN_STATUS = 99  # what OR-Tools' HiGHS interface returns at its time limit (no incumbent exposed)
_FIRST_BACKEND_SHARE = 2 / 3  # of the remaining time, when a second backend can still take over
_LAST_BACKEND_SHARE = 0.75  # CBC overruns its limit by up to a few seconds
_RETRY_TIGHTEN = 1e-6  # relative tightening of the memory rows when a result broke the budget
_BRUTE_FORCE_MAX = 200_000


@dataclass(frozen=True)
class LayerCost:
    """Cost of one layer of the chain (all values finite and >= 0).

    ``forward_s``/``backward_s`` are per microbatch; ``state_bytes`` is params +
    grads + optimizer states on one device of the stage; ``activation_bytes``
    the saved activations of one microbatch; ``send_s`` the time to send this
    layer's output (forward) and receive its gradient (backward) when a stage
    boundary follows the layer.
    """

    name: str
    forward_s: float
    backward_s: float
    state_bytes: float
    activation_bytes: float
    send_s: float = 0.0


@dataclass(frozen=True)
class CutResult:
    """A stage cut and its exact evaluation.

    ``starts[j]`` is the first layer of stage ``j`` (``starts[0] == 0``, length
    ``S``); ``stage_time_s`` has one entry per stage, ``rank_memory_bytes`` one
    per rank; ``objective_s`` is the predicted step time.  ``status`` is
    ``"optimal"`` or ``"feasible"`` (time limit hit before optimality was
    proven); ``backend`` is ``"HiGHS"``, ``"CBC"``, ``"dp"``, ``"brute-force"`` or
    ``"heuristic"`` (the local-search incumbent, v > 1, when the MIP did not beat it).
    """

    starts: tuple[int, ...]
    stage_time_s: tuple[float, ...]
    rank_memory_bytes: tuple[float, ...]
    objective_s: float
    status: str
    backend: str
    solve_time_s: float


# ----------------------------------------------------------------------------- problem and evaluation


@dataclass(frozen=True)
class _Problem:
    """Validated, normalised inputs."""

    names: tuple[str, ...]
    work: tuple[float, ...]  # a_l = forward_s + backward_s
    send: tuple[float, ...]
    state: tuple[float, ...]
    act: tuple[float, ...]
    p: int
    v: int
    m: int
    w: float
    in_flight: tuple[float, ...]

    @property
    def n_layers(self) -> int:
        return len(self.work)

    @property
    def n_stages(self) -> int:
        return self.p * self.v


def _count(value: object, what: str, hint: str) -> int:
    """An integer >= 1 (bool rejected)."""
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        n = None
    if n is None or isinstance(value, bool) or n < 1:
        raise ValueError(f"{what}={value!r}; required: an integer >= 1 ({hint}).")
    return int(n)


def _nonneg(value: object, what: str) -> float:
    try:
        x = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        x = math.nan
    if isinstance(value, bool) or not (math.isfinite(x) and x >= 0):
        raise ValueError(f"{what}={value!r}; required: a finite number >= 0.")
    return x


def default_in_flight(ranks: int, microbatches: int, virtual_stages: int = 1) -> tuple[int, ...]:
    """Default in-flight microbatches per stage: ``min(p - j % p, m)`` (1F1B; see the module docstring)."""
    p = _count(ranks, "ranks", "the number of pipeline ranks")
    m = _count(microbatches, "microbatches", "microbatches per step")
    v = _count(virtual_stages, "virtual_stages", "model chunks per rank; 1 without interleaving")
    return tuple(min(p - j % p, m) for j in range(p * v))


def _problem(
    layers: Sequence[LayerCost],
    ranks: int,
    microbatches: int,
    virtual_stages: int,
    in_flight: Sequence[float] | None,
    bubble_weight: float | None,
) -> _Problem:
    """Validate the inputs (ValueError says what was given and what is required)."""
    p = _count(ranks, "ranks", "the number of pipeline ranks")
    m = _count(microbatches, "microbatches", "microbatches per step")
    v = _count(virtual_stages, "virtual_stages", "model chunks per rank; 1 without interleaving")
    layers = tuple(layers)
    if not layers:
        raise ValueError("layers is empty; required: at least one LayerCost.")
    for i, lay in enumerate(layers):
        if not isinstance(lay, LayerCost):
            raise ValueError(f"layers[{i}] is {type(lay).__name__}; required: LayerCost.")
        for field in ("forward_s", "backward_s", "state_bytes", "activation_bytes", "send_s"):
            _nonneg(getattr(lay, field), f"layers[{i}] ({lay.name!r}).{field}")
    n_stages, n_layers = p * v, len(layers)
    if n_stages > n_layers:
        raise ValueError(
            f"ranks={p} x virtual_stages={v} = {n_stages} stages but only {n_layers} layers; required: "
            "at most one stage per layer (use fewer pipeline ranks or virtual stages, or split layers finer)."
        )
    if in_flight is None:
        flight = tuple(float(f) for f in default_in_flight(p, m, v))
    else:
        flight = tuple(in_flight)
        if len(flight) != n_stages:
            raise ValueError(f"in_flight has {len(flight)} entries; required: one per stage "
                             f"(ranks x virtual_stages = {n_stages}).")
        flight = tuple(_nonneg(f, f"in_flight[{j}]") for j, f in enumerate(flight))
    w = float(p - 1) if bubble_weight is None else _nonneg(bubble_weight, "bubble_weight")
    return _Problem(
        names=tuple(lay.name for lay in layers),
        work=tuple(float(lay.forward_s) + float(lay.backward_s) for lay in layers),
        send=tuple(float(lay.send_s) for lay in layers),
        state=tuple(float(lay.state_bytes) for lay in layers),
        act=tuple(float(lay.activation_bytes) for lay in layers),
        p=p, v=v, m=m, w=w, in_flight=flight,
    )


def _budget(memory_budget_bytes: float | None) -> float | None:
    if memory_budget_bytes is None:
        return None
    return _nonneg(memory_budget_bytes, "memory_budget_bytes")


def _fits(memory: float, budget: float | None) -> bool:
    return budget is None or memory <= budget * (1.0 + _MEM_RTOL)


class _Tables:
    """fsum of work / state / activation over every layer range [k, e) (the single arithmetic used)."""

    def __init__(self, prob: _Problem) -> None:
        n = prob.n_layers
        self.prob = prob
        self.work = np.full((n + 1, n + 1), np.nan)
        self.state = np.full((n + 1, n + 1), np.nan)
        self.act = np.full((n + 1, n + 1), np.nan)
        for k in range(n):
            for e in range(k + 1, n + 1):
                self.work[k, e] = math.fsum(prob.work[k:e])
                self.state[k, e] = math.fsum(prob.state[k:e])
                self.act[k, e] = math.fsum(prob.act[k:e])
        # send[e] = send_s of layer e - 1: paid by a stage ending before layer e (not the last stage)
        self.send_end = np.array([0.0] + list(prob.send))

    def stage_time(self, k: int, e: int, j: int) -> float:
        t = float(self.work[k, e])
        return t + float(self.send_end[e]) if j < self.prob.n_stages - 1 else t

    def stage_memory(self, k: int, e: int, j: int) -> float:
        return float(self.state[k, e]) + self.prob.in_flight[j] * float(self.act[k, e])

    def time_matrix(self, j: int) -> np.ndarray:
        """[k, e] stage time of stage j covering [k, e) (nan where e <= k); same floats as stage_time."""
        return self.work + self.send_end[None, :] if j < self.prob.n_stages - 1 else self.work.copy()

    def memory_matrix(self, j: int) -> np.ndarray:
        return self.state + self.prob.in_flight[j] * self.act

    def evaluate(self, starts: Sequence[int]) -> tuple[tuple[float, ...], tuple[float, ...], float]:
        prob = self.prob
        ends = list(starts[1:]) + [prob.n_layers]
        times = [self.stage_time(k, e, j) for j, (k, e) in enumerate(zip(starts, ends))]
        mems = [self.stage_memory(k, e, j) for j, (k, e) in enumerate(zip(starts, ends))]
        rank_time = [math.fsum(times[r::prob.p]) for r in range(prob.p)]
        rank_mem = tuple(math.fsum(mems[r::prob.p]) for r in range(prob.p))
        objective = prob.m * max(rank_time) + prob.w * max(times)
        return tuple(times), rank_mem, objective


def _check_starts(prob: _Problem, starts: Sequence[int]) -> tuple[int, ...]:
    try:
        out = tuple(operator.index(s) for s in starts)
    except TypeError:
        raise ValueError(f"starts={tuple(starts)!r}; required: integers.") from None
    n, s = prob.n_layers, prob.n_stages
    ok = len(out) == s and out[0] == 0 and all(a < b for a, b in zip(out, out[1:])) and out[-1] < n
    if not ok:
        raise ValueError(f"starts={out!r}; required: {s} strictly increasing layer indices, the first 0 and "
                         f"all < {n} (every stage holds at least one layer).")
    return out


def _result(tab: _Tables, starts: Sequence[int], status: str, backend: str, t0: float) -> CutResult:
    starts = tuple(int(s) for s in starts)
    times, mems, objective = tab.evaluate(starts)
    return CutResult(starts, times, mems, objective, status, backend, time.perf_counter() - t0)


def evaluate_cuts(
    layers: Sequence[LayerCost],
    starts: Sequence[int],
    ranks: int,
    microbatches: int,
    virtual_stages: int = 1,
    in_flight: Sequence[float] | None = None,
    bubble_weight: float | None = None,
) -> tuple[tuple[float, ...], tuple[float, ...], float]:
    """Return ``(stage_time_s, rank_memory_bytes, objective_s)`` of one cut (see the module docstring).

    ``starts`` holds the first layer of each of the ``ranks * virtual_stages``
    stages.  This is the evaluation every solver of this module reports.
    """
    prob = _problem(layers, ranks, microbatches, virtual_stages, in_flight, bubble_weight)
    return _Tables(prob).evaluate(_check_starts(prob, starts))


# ----------------------------------------------------------------------------- exact references


def _bottleneck_dp(prob: _Problem, cost: list[np.ndarray], allowed: list[np.ndarray] | None
                   ) -> tuple[float, tuple[int, ...]] | None:
    """Minimise ``max_j cost[j][k_j, e_j]`` over cuts (v = 1 semantics: one value per stage).

    ``allowed[j][k, e]`` masks stage ranges out.  Returns the optimum and the
    lexicographically smallest ``starts`` attaining it, or None when no cut is allowed.
    """
    n, s = prob.n_layers, prob.n_stages
    inf = math.inf
    mats = []
    for j in range(s):
        c = np.where(np.isnan(cost[j]), inf, cost[j])
        if allowed is not None:
            c = np.where(allowed[j], c, inf)
        mats.append(c)
    # best[j][k]: min bottleneck of stages j..S-1 when stage j starts at layer k
    best = [np.full(n + 1, inf) for _ in range(s)]
    best[s - 1][: n] = mats[s - 1][: n, n]
    for j in range(s - 2, -1, -1):
        # stage j covers [k, e); stage j + 1 starts at e
        cand = np.maximum(mats[j], best[j + 1][None, :])
        best[j] = cand.min(axis=1)
    opt = float(best[0][0])
    if not math.isfinite(opt):
        return None
    starts, k = [0], 0
    for j in range(s - 1):
        row = np.maximum(mats[j][k], best[j + 1])
        e = int(np.flatnonzero(row <= opt)[0])  # smallest next start that still reaches the optimum
        starts.append(e)
        k = e
    return opt, tuple(starts)


def _all_cuts(prob: _Problem):
    n, s = prob.n_layers, prob.n_stages
    count = math.comb(n - 1, s - 1)
    if count > _BRUTE_FORCE_MAX:
        raise ValueError(f"brute force over C({n - 1}, {s - 1}) = {count} cuts; at most {_BRUTE_FORCE_MAX} are "
                         "allowed. Use solve_cuts (ILP) or solve_cuts_dp (v = 1).")
    for cuts in itertools.combinations(range(1, n), s - 1):  # lexicographic order
        yield (0, *cuts)


def _gib(x: float) -> str:
    return f"{x:.0f} bytes ({x / 2**30:.3f} GiB)"


def _infeasible_error(prob: _Problem, budget: float, required: float, starts: Sequence[int],
                      proven: bool = True) -> InfeasibleMemoryError:
    """Error naming the budget, the smallest budget any cut fits, and the fixes.

    ``proven=False``: ``required`` is the smallest found within the time limit (an upper bound).
    """
    tab_note = ""
    flight = min(prob.in_flight) if prob.in_flight else 0.0
    floor = max(((st + flight * ac, i) for i, (st, ac) in enumerate(zip(prob.state, prob.act))),
                key=lambda x: (x[0], -x[1]))  # the largest layer, the first on ties
    if floor[0] > budget:
        tab_note = (f" Layer {floor[1]} ({prob.names[floor[1]]!r}) alone needs {_gib(floor[0])} even with the fewest "
                    "microbatches in flight, so more pipeline stages cannot help: split it with tensor parallelism "
                    "or recompute its activations.")
    msg = (
        f"no cut of the {prob.n_layers} layers into {prob.n_stages} pipeline stages (ranks={prob.p} x "
        f"virtual_stages={prob.v}) fits the per-device memory budget: given {_gib(budget)}, "
        + ("the smallest budget any cut fits is " if proven else
           "the smallest budget found within the time limit (the exact minimum may be lower) is ")
        + f"{_gib(required)} (cut starts {tuple(starts)}).{tab_note} Fix: use more pipeline stages "
        "(more ranks), tensor parallelism to split each layer's parameters and activations, activation "
        "recomputation (or fewer microbatches in flight) to shrink the saved activations, or a device with "
        "more memory (raise the budget)."
    )
    return InfeasibleMemoryError(msg, required_bytes=required, budget_bytes=budget)


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
    prob = _problem(layers, ranks, microbatches, virtual_stages, in_flight, bubble_weight)
    budget = _budget(memory_budget_bytes)
    if prob.v != 1:
        raise ValueError(f"solve_cuts_dp needs virtual_stages=1 (given {prob.v}): with several chunks per rank the "
                         "objective is not a bottleneck; use solve_cuts or brute_force_cuts.")
    tab = _Tables(prob)
    found = _relaxed_bottleneck(prob, tab, budget)  # exact for v = 1: a rank is its one stage
    if found is None:
        assert budget is not None
        least = _min_memory_cut(prob, tab, 1.0)
        raise _infeasible_error(prob, budget, least.value, least.starts)
    return _result(tab, found[1], "optimal", "dp", t0)


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
    prob = _problem(layers, ranks, microbatches, virtual_stages, in_flight, bubble_weight)
    budget = _budget(memory_budget_bytes)
    tab = _Tables(prob)
    best, arg = math.inf, None
    min_mem, min_arg = math.inf, None
    for starts in _all_cuts(prob):
        _, mems, objective = tab.evaluate(starts)
        peak = max(mems)
        if peak < min_mem:
            min_mem, min_arg = peak, starts
        if _fits(peak, budget) and objective < best:
            best, arg = objective, starts
    if arg is None:
        assert budget is not None and min_arg is not None
        raise _infeasible_error(prob, budget, min_mem, min_arg)
    return _result(tab, arg, "optimal", "brute-force", t0)


# ----------------------------------------------------------------------------- strengthening


@dataclass(frozen=True)
class _Bounds:
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


def _stage_memory_mask(prob: _Problem, tab: _Tables, budget: float | None) -> list[np.ndarray] | None:
    if budget is None:
        return None
    return [tab.memory_matrix(j) <= budget * (1.0 + _MEM_RTOL) for j in range(prob.n_stages)]


def _relaxed_bottleneck(prob: _Problem, tab: _Tables, budget: float | None) -> tuple[float, tuple[int, ...]] | None:
    """min over cuts of max_j t_j with every *stage* (not rank) within the budget.

    Exact for v = 1; a relaxation for v > 1 (a rank's memory is at least each of
    its stages' memory).  None when no cut passes, i.e. no cut fits at all.
    """
    return _bottleneck_dp(prob, [tab.time_matrix(j) for j in range(prob.n_stages)],
                          _stage_memory_mask(prob, tab, budget))


def _moves(prob: _Problem, cur: tuple[int, ...]):
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


def _local_search(prob: _Problem, starts: tuple[int, ...], key) -> tuple[tuple, tuple[int, ...]]:
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


def _sum_of_squares_dp(prob: _Problem, tab: _Tables, budget: float | None) -> tuple[int, ...] | None:
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


def _incumbent(prob: _Problem, tab: _Tables, budget: float | None, start: tuple[int, ...]
               ) -> tuple[float, tuple[int, ...]] | None:
    """A good cut to start from.

    v = 1: the relaxed bottleneck cut ``start`` (optimal).  v > 1: local search
    on the objective (ties broken by sum R_r^2, then sum t_j^2) from ``start``,
    from the sum-of-squares cut and, with a budget, from the local-search
    minimum-memory cut; the best result, or None when no start fits the budget.
    """

    def key(starts: tuple[int, ...]) -> tuple[float, float, float] | None:
        times, mems, objective = tab.evaluate(starts)
        if not _fits(max(mems), budget):
            return None
        ranks = [math.fsum(times[r::prob.p]) for r in range(prob.p)]
        return objective, math.fsum(x * x for x in ranks), math.fsum(x * x for x in times)

    if prob.v == 1:
        return (tab.evaluate(start)[2], start) if key(start) is not None else None
    found = []
    starts = [start, _sum_of_squares_dp(prob, tab, budget)]
    if budget is not None:
        starts.append(_min_memory_cut(prob, tab, 0.0, exact=False).starts)
    for cut in starts:
        if cut is not None and key(cut) is not None:
            value, cut = _local_search(prob, cut, key)
            found.append((value, cut))
    if not found:
        return None
    value, cut = min(found)
    return value[0], cut


def _min_sends(prob: _Problem) -> float:
    """Smallest possible total send time: the S - 1 cheapest layers among 0 .. L - 2."""
    return math.fsum(sorted(prob.send[:-1])[: prob.n_stages - 1])


def _exclusions(prob: _Problem, tab: _Tables, budget: float | None, tau: float) -> tuple[tuple[int, int, int], ...]:
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
            bad |= tab.memory_matrix(j) > budget * (1.0 + _MEM_RTOL)
        for k in range(n):
            if k < j:
                continue  # z[k, j - 1] = 1: layer k is always before stage j
            hits = np.flatnonzero(bad[k, k + 1:])
            if hits.size:
                out.append((j, k, k + 1 + int(hits[0])))
    return tuple(out)


def _bounds(prob: _Problem, tab: _Tables, budget: float | None, t_lb: float, upper: float) -> _Bounds:
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
    return _Bounds(t_lb, r_lb, tau, r_ub, _exclusions(prob, tab, budget, tau))


# ----------------------------------------------------------------------------- ILP


@dataclass
class _Model:
    solver: pywraplp.Solver
    z: list[list[object]]  # z[l][j + 1] for j = -1 .. S - 1: a Variable or the constant 0 / 1


def _z_grid(solver: pywraplp.Solver, prob: _Problem) -> list[list[object]]:
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


def _time_row(prob: _Problem, z: list[list[object]], j: int, scale: float) -> _Row:
    row = _Row()
    for layer in range(prob.n_layers):
        row.add_membership(z, layer, j, prob.work[layer] / scale)
    if j < prob.n_stages - 1:
        for layer in range(prob.n_layers - 1):  # c[l, j] = z[l, j] - z[l + 1, j]
            row.add(z[layer][j + 1], prob.send[layer] / scale)
            row.add(z[layer + 1][j + 1], -prob.send[layer] / scale)
    return row


def _memory_row(prob: _Problem, z: list[list[object]], r: int, scale: float) -> _Row:
    row = _Row()
    for j in range(r, prob.n_stages, prob.p):
        for layer in range(prob.n_layers):
            row.add_membership(z, layer, j, (prob.state[layer] + prob.in_flight[j] * prob.act[layer]) / scale)
    return row


def _order_constraints(solver: pywraplp.Solver, prob: _Problem, z: list[list[object]]) -> None:
    n, s = prob.n_layers, prob.n_stages
    for j in range(s - 1):
        for layer in range(n - 1):
            _le(solver, z[layer + 1][j + 1], z[layer][j + 1])  # contiguous
            if j + 1 < s - 1:
                _le(solver, z[layer][j + 1], z[layer + 1][j + 2])  # no stage skipped


def _add_exclusions(solver: pywraplp.Solver, z: list[list[object]], exclusions) -> None:
    for j, k, e in exclusions:
        _le(solver, z[e - 1][j + 1], z[k][j])  # stage j does not contain [k, e)


def _cut_model(solver: pywraplp.Solver, prob: _Problem, budget: float | None, tighten: float,
               bounds: _Bounds) -> _Model:
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


def _memory_model(solver: pywraplp.Solver, prob: _Problem, lower: float, upper: float,
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


def _read_starts(model: _Model, prob: _Problem) -> tuple[int, ...]:
    counts = []
    for j in range(prob.n_stages - 1):
        total = 0
        for layer in range(prob.n_layers):
            term = model.z[layer][j + 1]
            total += term if isinstance(term, int) else int(round(term.solution_value()))  # type: ignore[attr-defined]
        counts.append(total)
    return (0, *counts)


def _mip_solvers() -> list[tuple[pywraplp.Solver, str]]:
    found = []
    for name, label in _MIP_BACKENDS:
        solver = pywraplp.Solver.CreateSolver(name)
        if solver is not None:
            if name == "HIGHS":
                solver.SetSolverSpecificParametersAsString(_HIGHS_OPTIONS)
            found.append((solver, label))
    if not found:
        raise SolverError("neither HiGHS nor CBC is available in this OR-Tools build (required: at least one); "
                          "install an OR-Tools wheel that bundles them (pip install -U ortools).")
    return found


def _run_mip(build, prob: _Problem, time_limit_s: float, t0: float) -> tuple[_Model, str, str] | None:
    """Solve with HiGHS, then CBC with the remaining time if HiGHS found nothing.

    Returns ``(model, status, backend)``, or None when the model is infeasible.
    Raises SolverTimeoutError / SolverError when no backend produced a solution.
    """
    attempts = _mip_solvers()
    tried: list[str] = []
    code = pywraplp.Solver.NOT_SOLVED
    for i, (solver, backend) in enumerate(attempts):
        model = build(solver)
        left = time_limit_s - (time.perf_counter() - t0)
        share = _FIRST_BACKEND_SHARE if i + 1 < len(attempts) else _LAST_BACKEND_SHARE
        solver.SetTimeLimit(max(1, int(max(left * share, 0.02 * time_limit_s) * 1000)))
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, _MIP_RELATIVE_GAP)
        code = solver.Solve(params)
        tried.append(backend)
        if code == pywraplp.Solver.INFEASIBLE:
            return None
        if code in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
            status = "optimal"
            if code != pywraplp.Solver.OPTIMAL:
                objective = solver.Objective()
                gap = abs(objective.Value() - objective.BestBound()) / max(abs(objective.Value()), 1e-300)
                status = "optimal" if gap <= _MIP_RELATIVE_GAP else "feasible"
            return model, status, backend
    if code in (pywraplp.Solver.NOT_SOLVED, _UNKNOWN_STATUS):
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


def _min_memory_cut(prob: _Problem, tab: _Tables, time_limit_s: float, exact: bool = True) -> _MinMemory:
    """The smallest peak rank memory over all cuts and a cut attaining it.

    v = 1: DP.  v > 1: the relaxed DP (max stage memory) is a lower bound, local
    search from its cut an upper bound, and the min-max-memory MIP closes the gap
    (skipped when ``exact`` is False: then the local-search cut is returned).
    """
    t0 = time.perf_counter()
    found = _bottleneck_dp(prob, [tab.memory_matrix(j) for j in range(prob.n_stages)], None)
    assert found is not None
    lower, start = found  # the largest *stage* memory: exact for v = 1, a lower bound for v > 1
    if prob.v == 1:
        return _MinMemory(max(tab.evaluate(start)[1]), start, True, "dp")

    def key(starts: tuple[int, ...]) -> tuple[float, float]:
        mems = tab.evaluate(starts)[1]
        return max(mems), math.fsum(x * x for x in mems)

    (upper, _), best = _local_search(prob, start, key)
    if upper <= lower * (1.0 + _MIP_RELATIVE_GAP):
        return _MinMemory(upper, best, True, "dp")
    if not exact:
        return _MinMemory(upper, best, False, "heuristic")
    excl = _exclusions(prob, tab, upper, math.inf)
    try:
        found = _run_mip(lambda s: _memory_model(s, prob, lower, upper, excl), prob, time_limit_s, t0)
    except SolverTimeoutError:
        return _MinMemory(upper, best, False, "heuristic")
    if found is None:  # only through tolerances: the incumbent itself satisfies the model
        return _MinMemory(upper, best, False, "heuristic")
    model, status, backend = found
    starts = _check_starts(prob, _read_starts(model, prob))
    value = max(tab.evaluate(starts)[1])
    if value > upper:
        return _MinMemory(upper, best, status == "optimal", backend)
    return _MinMemory(value, starts, status == "optimal", backend)


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
    prob = _problem(layers, ranks, microbatches, virtual_stages, in_flight, None)
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s={time_limit_s!r}; required: a positive number of seconds.")
    found = _min_memory_cut(prob, _Tables(prob), time_limit_s)
    if not found.proven:
        raise SolverTimeoutError(
            f"could not prove the minimum per-device memory within {time_limit_s:.1f} s; the best cut found needs "
            f"{_gib(found.value)} (starts {found.starts}). Fix: raise time_limit_s."
        )
    return found.value


def _raise_infeasible(prob: _Problem, tab: _Tables, budget: float, time_limit_s: float, t0: float) -> CutResult:
    """Raise InfeasibleMemoryError; returns the minimum-memory cut when it does fit after all (tolerances)."""
    left = max(time_limit_s - (time.perf_counter() - t0), 0.1 * time_limit_s)
    found = _min_memory_cut(prob, tab, left)
    if not _fits(found.value, budget):
        raise _infeasible_error(prob, budget, found.value, found.starts, found.proven)
    return _result(tab, found.starts, "feasible", found.backend, t0)


def _solve_cuts_ilp(prob: _Problem, budget: float | None, time_limit_s: float, strengthen: bool) -> CutResult:
    """The MIP path of :func:`solve_cuts`; ``strengthen=False`` runs the bare formulation (for tests)."""
    t0 = time.perf_counter()
    tab = _Tables(prob)
    if prob.n_stages == 1:
        if budget is not None and not _fits(max(tab.evaluate((0,))[1]), budget):
            return _raise_infeasible(prob, tab, budget, time_limit_s, t0)
        return _result(tab, (0,), "optimal", "dp", t0)
    incumbent, bounds = None, _Bounds()
    if strengthen:
        relaxed = _relaxed_bottleneck(prob, tab, budget)
        if relaxed is None:  # not even each stage alone fits, so no rank can
            assert budget is not None
            return _raise_infeasible(prob, tab, budget, time_limit_s, t0)
        incumbent = _incumbent(prob, tab, budget, relaxed[1])
        bounds = _bounds(prob, tab, budget, relaxed[0], incumbent[0] if incumbent else math.inf)
    mip: tuple[tuple[int, ...], str, str] | None = None
    for tighten in (0.0, _RETRY_TIGHTEN):
        try:
            found = _run_mip(lambda s, tg=tighten: _cut_model(s, prob, budget, tg, bounds), prob, time_limit_s, t0)
        except SolverTimeoutError as err:
            if incumbent is not None:
                break
            if budget is None:
                raise
            least = _min_memory_cut(prob, tab, 0.0, exact=False)
            raise SolverTimeoutError(
                f"{err} No cut within the budget of {_gib(budget)} was found either way; the smallest-memory cut "
                f"found needs {_gib(least.value)} (starts {least.starts}): the budget may be infeasible. Fix: raise "
                "time_limit_s or the budget, or see min_feasible_memory."
            ) from None
        if found is None:
            break
        model, status, backend = found
        starts = _check_starts(prob, _read_starts(model, prob))
        if budget is None or _fits(max(tab.evaluate(starts)[1]), budget):
            mip = (starts, status, backend)
            break
    inc_obj = incumbent[0] if incumbent is not None else math.inf
    if mip is not None:
        # A proven MIP optimum is kept unless the incumbent beats it by more than the gap (float ties
        # between equally good cuts are not a reason to switch); an unproven one only when no worse.
        mip_obj = tab.evaluate(mip[0])[2]
        if mip_obj <= inc_obj * (1.0 + (_MIP_RELATIVE_GAP if mip[1] == "optimal" else 0.0)):
            return _result(tab, mip[0], mip[1], mip[2], t0)
    if incumbent is not None:
        # v = 1: the relaxed bottleneck is exact, so the incumbent is the DP optimum.  Otherwise it is
        # optimal only when the MIP proved that nothing beats it.
        proven = prob.v == 1 or (mip is not None and mip[1] == "optimal")
        return _result(tab, incumbent[1], "optimal" if proven else "feasible", "dp" if prob.v == 1 else "heuristic", t0)
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
    prob = _problem(layers, ranks, microbatches, virtual_stages, in_flight, bubble_weight)
    budget = _budget(memory_budget_bytes)
    if not time_limit_s > 0:
        raise ValueError(f"time_limit_s={time_limit_s!r}; required: a positive number of seconds.")
    return _solve_cuts_ilp(prob, budget, float(time_limit_s), strengthen=True)
