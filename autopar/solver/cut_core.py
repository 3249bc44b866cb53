"""Stage cuts: the problem, its exact evaluation and the exact dynamic program's building blocks
(see :mod:`autopar.solver.stage_cuts` for the model)."""

from __future__ import annotations

import itertools
import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopar.solver.ilp import InfeasibleMemoryError, format_bytes
from autopar.solver.mip import CUT_SETTINGS


__all__ = [
    "CUT_MIP_RELATIVE_GAP", "CutProblem", "CutResult", "CutTables", "LayerCost", "MEM_RTOL",
    "RETRY_TIGHTEN", "all_cuts", "bottleneck_dp", "check_starts",
    "default_in_flight", "effective_budget", "evaluate_cuts", "fits_budget", "format_gib",
    "infeasible_error", "make_problem", "make_result",
]

MEM_RTOL = 1e-9  # a cut fits when rank memory <= budget * (1 + MEM_RTOL)


CUT_MIP_RELATIVE_GAP = CUT_SETTINGS.relative_gap


RETRY_TIGHTEN = 1e-6  # relative tightening of the memory rows when a result broke the budget


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


@dataclass(frozen=True)
class CutProblem:
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


def make_problem(
    layers: Sequence[LayerCost],
    ranks: int,
    microbatches: int,
    virtual_stages: int,
    in_flight: Sequence[float] | None,
    bubble_weight: float | None,
) -> CutProblem:
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
    return CutProblem(
        names=tuple(lay.name for lay in layers),
        work=tuple(float(lay.forward_s) + float(lay.backward_s) for lay in layers),
        send=tuple(float(lay.send_s) for lay in layers),
        state=tuple(float(lay.state_bytes) for lay in layers),
        act=tuple(float(lay.activation_bytes) for lay in layers),
        p=p, v=v, m=m, w=w, in_flight=flight,
    )


def effective_budget(memory_budget_bytes: float | None) -> float | None:
    if memory_budget_bytes is None:
        return None
    return _nonneg(memory_budget_bytes, "memory_budget_bytes")


def fits_budget(memory: float, budget: float | None) -> bool:
    return budget is None or memory <= budget * (1.0 + MEM_RTOL)


class CutTables:
    """fsum of work / state / activation over every layer range [k, e) (the single arithmetic used)."""

    def __init__(self, prob: CutProblem) -> None:
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


def check_starts(prob: CutProblem, starts: Sequence[int]) -> tuple[int, ...]:
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


def make_result(tab: CutTables, starts: Sequence[int], status: str, backend: str, t0: float) -> CutResult:
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
    prob = make_problem(layers, ranks, microbatches, virtual_stages, in_flight, bubble_weight)
    return CutTables(prob).evaluate(check_starts(prob, starts))


def bottleneck_dp(prob: CutProblem, cost: list[np.ndarray], allowed: list[np.ndarray] | None
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


def all_cuts(prob: CutProblem):
    n, s = prob.n_layers, prob.n_stages
    count = math.comb(n - 1, s - 1)
    if count > _BRUTE_FORCE_MAX:
        raise ValueError(f"brute force over C({n - 1}, {s - 1}) = {count} cuts; at most {_BRUTE_FORCE_MAX} are "
                         "allowed. Use solve_cuts (ILP) or solve_cuts_dp (v = 1).")
    for cuts in itertools.combinations(range(1, n), s - 1):  # lexicographic order
        yield (0, *cuts)


def format_gib(x: float) -> str:
    return f"{x:.0f} bytes ({format_bytes(x)})"


def _stage_excess(prob: CutProblem, budget: float, starts: Sequence[int]) -> str:
    """Each pipeline rank's memory at the cut ``starts`` and how far it is over ``budget``."""
    ends = list(starts[1:]) + [prob.n_layers]
    _, rank_mem, _ = CutTables(prob).evaluate(starts)
    parts = []
    for r, mem in enumerate(rank_mem):
        layers = ", ".join(f"{starts[j]}-{ends[j] - 1}" for j in range(r, prob.n_stages, prob.p))
        over = f"{format_bytes(mem - budget)} over" if mem > budget else "fits"
        parts.append(f"pipeline rank {r} (layers {layers}) needs {format_bytes(mem)}, {over}")
    return "; ".join(parts)


def infeasible_error(prob: CutProblem, budget: float, required: float, starts: Sequence[int],
                      proven: bool = True) -> InfeasibleMemoryError:
    """Error naming the budget, the smallest budget any cut fits, and the fixes.

    ``proven=False``: ``required`` is the smallest found within the time limit (an upper bound).
    """
    tab_note = ""
    flight = min(prob.in_flight) if prob.in_flight else 0.0
    floor = max(((st + flight * ac, i) for i, (st, ac) in enumerate(zip(prob.state, prob.act))),
                key=lambda x: (x[0], -x[1]))  # the largest layer, the first on ties
    if floor[0] > budget:
        tab_note = (f" Layer {floor[1]} ({prob.names[floor[1]]!r}) alone needs {format_gib(floor[0])} even with the fewest "
                    "microbatches in flight, so more pipeline stages cannot help: split it with tensor parallelism "
                    "or recompute its activations.")
    msg = (
        f"no cut of the {prob.n_layers} layers into {prob.n_stages} pipeline stages (ranks={prob.p} x "
        f"virtual_stages={prob.v}) fits the per-device memory budget: given {format_gib(budget)}, "
        + ("the smallest budget any cut fits is " if proven else
           "the smallest budget found within the time limit (the exact minimum may be lower) is ")
        + f"{format_gib(required)} (cut starts {tuple(starts)}: {_stage_excess(prob, budget, starts)})."
        + f"{tab_note} Fix: use more pipeline stages "
        "(more ranks), tensor parallelism to split each layer's parameters and activations, activation "
        "recomputation (or fewer microbatches in flight) to shrink the saved activations, or a device with "
        "more memory (raise the budget)."
    )
    return InfeasibleMemoryError(msg, required_bytes=required, budget_bytes=budget)

