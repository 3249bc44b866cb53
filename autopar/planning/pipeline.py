"""Pipeline planning: pp degree, stage mesh, microbatches, schedule, virtual stages and cuts.

For every pipeline degree ``pp > 1`` dividing the devices, every (dp, tp) mesh of one stage and
every microbatch count, the model is traced at the microbatch's shape and solved whole by the
intra-operator ILP on the stage mesh; its per-node times and memory, summed per layer unit
(``pre``, each block, ``post``), are the :class:`LayerCost` chain the stage-cut solver cuts. For
every schedule and virtual-stage count the cut solver minimises the predicted step time within
the device memory, and the schedule simulator prices the result. The best setup is then planned
for real: each stage is traced on its own and solved by the intra-operator ILP on the stage mesh,
and the simulator predicts the step from those stage plans.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

from autopar.config import Config
from autopar.cost_models.comm import axis_collective_time
from autopar.cost_models.sharding import stored_placement
from autopar.cost_models.compute import mfu
from autopar.cost_models.pipeline import (SCHEDULES, check_schedule, held_until, in_flight,
                                          rank_memory, simulate)
from autopar.errors import PlanError
from autopar.graph import TracedGraph
from autopar.mesh import Mesh
from autopar.capture.layers import is_backward, layer_units
from autopar.capture.moe import expert_count
from autopar.plan import Collective, PipelinePlan, Plan
from autopar.solver.ilp import InfeasibleMemoryError, format_bytes
from autopar.planning.assembly import traced_flops
from autopar.planning.candidates import Candidate, mesh_candidates
from autopar.planning.collectives import step_end_reductions
from autopar.planning.solve import solve_candidate, solve_space
from autopar.planning.records import param_shards
from autopar.planning.sequence import common_cp_layout
from autopar.planning.stage_reuse import renamed_stage_plan, stage_key
from autopar.solver.stage_cuts import LayerCost, solve_cuts
from autopar.strategies.reshard import local_shape
from autopar.strategies.space import boundary_placements
from autopar.capture.stages import (
    ForwardGraph, capture_stages, capture_with_forward, export_forward, first_microbatch,
    microbatch_inputs, unflatten_inputs,
)

__all__ = ["batch_size", "boundary_bytes", "build_pipeline_plan", "chosen_comm", "forward_for_plan",
           "ModelFacts",
           "PipelineSetup", "search_pipeline",
           "unit_costs"]

_MAX_MICROBATCH_CANDIDATES = 3
# Share of a backward that computes weight gradients, for zero-bubble's separate W step: about
# half for matmul-dominated layers (Qi et al., ICLR'24, section 2: T_B ~ T_W).
_WEIGHT_FRACTION = 0.5


@dataclass(frozen=True)
class PipelineSetup:
    """One point of the pipeline search."""

    pp: int
    cand: Candidate
    microbatches: int
    schedule: str
    virtual_stages: int
    stage_of_unit: tuple[int, ...]
    predicted_s: float
    memory_bytes: float
    # each stage's predicted memory (its peak while it computes) and each pipeline rank's,
    # when the search knows them: a stage's budget (stage_budgets)
    stage_memory_bytes: tuple[float, ...] = ()
    rank_memory_bytes: tuple[float, ...] = ()

    def stage_budgets(self, budget: float | None) -> list[float | None]:
        """The memory each stage may use of its rank's ``budget``: its predicted peak scaled by
        its rank's slack (``budget`` over the rank's predicted memory), as a rank holds one
        computing stage's peak beside its other stages' held bytes, and a peak's once-a-rank
        buffers are not a share of the budget (the ranks' sums are checked once every stage is
        placed); without the ranks' predictions, in proportion to the stage's among its rank's
        stages; without either, ``budget / v``."""
        stages = self.pp * self.virtual_stages
        if budget is None:
            return [None] * stages
        mem = self.stage_memory_bytes
        if len(mem) != stages or min(mem, default=0.0) <= 0:
            return [budget / self.virtual_stages] * stages
        rank = list(self.rank_memory_bytes)
        if len(rank) != self.pp or min(rank) <= 0:
            rank = [sum(mem[j] for j in range(r, stages, self.pp)) for r in range(self.pp)]
        return [min(budget, budget * mem[j] / rank[j % self.pp]) for j in range(stages)]


def batch_size(example_inputs: Any) -> int:
    chunks, _ = microbatch_inputs(example_inputs, 1)
    sizes = {x.shape[0] for x in chunks[0] if hasattr(x, "shape") and x.dim() > 0}
    if len(sizes) != 1:
        raise PlanError(f"pipelining splits every input on dim 0 into microbatches; the inputs' "
                        f"dim-0 sizes differ ({sorted(sizes)}). Give inputs with one batch size.")
    return sizes.pop()


def _microbatch_counts(batch: int, pp: int, dp: int, config: Config) -> list[int]:
    if config.microbatch_size is not None:
        b = config.microbatch_size
        if batch % b or b % dp:
            return []
        return [batch // b]
    valid = [m for m in range(1, batch + 1) if batch % m == 0 and (batch // m) % dp == 0]
    preferred = [m for m in valid if pp <= m <= 4 * pp]
    return (preferred or [max(valid)] if valid else [])[:_MAX_MICROBATCH_CANDIDATES]


def _no_microbatch_count(batch: int, dp: int, config: Config) -> str:
    """Why no microbatch count splits ``batch`` over ``dp`` replicas under ``config``."""
    b = config.microbatch_size
    if b is None:
        return f"no microbatch count splits the batch of {batch} evenly over dp={dp} replicas"
    fits = [k * dp for k in range(1, batch // dp + 1) if batch % (k * dp) == 0]
    hint = (f"use microbatch_size={dp} for one sample per replica" if dp in fits
            else f"choose one of {fits}")
    return (f"Config(microbatch_size={b}) counts the samples of a microbatch over all dp={dp} "
            f"replicas: it must divide the batch ({batch}) and be a multiple of dp; {hint}")


def _schedules(pp: int, units: int, config: Config) -> list[tuple[str, int]]:
    names = [config.schedule] if config.schedule else list(SCHEDULES)
    out = []
    for name in names:
        vs = [1] if name in ("gpipe", "1f1b") else [v for v in (1, 2, 4) if pp * v <= units]
        if config.virtual_stages is not None:
            vs = [v for v in vs if v == config.virtual_stages]
        out += [(name, v) for v in vs]
    return out


def unit_costs(traced: TracedGraph, units: tuple[str, ...], prefix: str | None, space: Any,
               costs: Any, choice: dict[str, int], fwd: ForwardGraph, cand: Candidate, pp: int,
               mesh: Mesh) -> list[LayerCost]:
    """Per layer unit: forward and backward seconds, state and activation bytes, send time.

    Node costs are those of the chosen strategies (compute, resharding into the node, delivering
    outputs); a parameter's state counts in every unit that reads it (a tied weight is held by
    two stages).
    """
    nodes = list(traced.gm.graph.nodes)
    _, unit_of = layer_units(nodes, prefix, len(units) - 2)
    params = {p.node for p in traced.params}
    fw, bw = np.zeros(len(units)), np.zeros(len(units))
    state, act = np.zeros(len(units)), np.zeros(len(units))
    backward = {n.name for n in nodes if is_backward(n)}
    for n in nodes:
        if n.name not in choice:
            continue
        if n.name in params:
            users = {unit_of[u.name] for u in n.users if u.name in unit_of and u.name not in backward}
            for u in users or {0}:
                state[u] += costs.memory[n.name][choice[n.name]]
            continue
        u = unit_of.get(n.name, len(units) - 1)
        t = costs.compute[n.name][choice[n.name]]
        (bw if n.name in backward else fw)[u] += t
        act[u] += costs.memory[n.name][choice[n.name]]
    for name, in_backward, t in chosen_comm(space, costs, choice, backward):
        (bw if in_backward else fw)[unit_of.get(name, len(units) - 1)] += t
    send = _send_times(fwd, units, cand, pp, mesh)
    return [LayerCost(units[i], float(fw[i]), float(bw[i]), float(state[i]), float(act[i]), send[i])
            for i in range(len(units))]


def chosen_comm(space: Any, costs: Any, choice: dict[str, int], backward: set[str]
                ) -> Iterator[tuple[str, bool, float]]:
    """The collective seconds of the chosen strategies: ``(node, in the backward, seconds)`` for
    every resharding into a node and every delivery of a graph output (a gradient counts as
    backward, the loss and boundary values as forward)."""
    for (name, k), m in costs.edges.items():
        src = space.nodes[name].inputs[k][0]
        yield name, name in backward, float(m[choice[src], choice[name]])
    for value, param, m in costs.outputs.values():
        t = m[choice[value[0]]] if param is None else m[choice[value[0]], choice[param]]
        yield value[0], param is not None, float(t)


def _send_times(fwd: ForwardGraph, units: tuple[str, ...], cand: Candidate, pp: int,
                mesh: Mesh) -> list[float]:
    """Seconds to send the activations crossing a cut after each unit, and their gradients."""
    crossing = np.zeros(len(units))
    for n in fwd.gm.graph.nodes:
        if n.name not in fwd.unit_of:
            continue
        later = [fwd.unit_of[u.name] for u in n.users if u.name in fwd.unit_of]
        val = n.meta.get("val")
        if not later or not hasattr(val, "numel"):
            continue
        lo, hi = fwd.unit_of[n.name], max(later)
        crossing[lo:hi] += boundary_bytes(val, cand)
    stride = math.prod(cand.shape)
    return [2 * axis_collective_time("send_recv", float(b), pp, stride, mesh.topology) if b else 0.0
            for b in crossing]


def search_pipeline(model: Any, example_inputs: Any, mesh: Mesh, config: Config,
                    cost_passes: Sequence[Callable[..., Any]], budget: float | None,
                    progress: Callable[[str], None] | None = None
                    ) -> tuple[list[PipelineSetup], list[InfeasibleMemoryError], list[str]]:
    """Every feasible pipeline setup, best first; the memory errors and placement failures."""
    batch = batch_size(example_inputs)
    setups: list[PipelineSetup] = []
    infeasible: list[InfeasibleMemoryError] = []
    failures: list[str] = []
    cache: dict[int, tuple[ForwardGraph, TracedGraph]] = {}
    pps = [config.pp] if config.pp not in (None, 1) else [p for p in range(2, mesh.size + 1) if mesh.size % p == 0]
    for pp in pps:
        if mesh.size % pp:
            raise PlanError(f"Config(pp={pp}) does not divide the {mesh.size} devices of the mesh.")
        try:
            cands = mesh_candidates(mesh.size // pp, dataclasses.replace(config, pp=None),
                                    expert_count(model), mesh.topology.gpus_per_node)
        except PlanError as e:  # the fixed dp/tp degrees leave no room for this pp
            failures.append(f"pp={pp}: {e}")
            continue
        for cand in cands:
            dp = math.prod(cand.shape[a] for a in cand.dp_axes)
            counts = _microbatch_counts(batch, pp, dp, config)
            if not counts:
                failures.append(_no_microbatch_count(batch, dp, config))
            for m in counts:
                try:
                    setups += _search_point(model, example_inputs, mesh, config, cost_passes, budget,
                                            pp, cand, m, cache, infeasible)
                except InfeasibleMemoryError as e:
                    infeasible.append(e)
                except PlanError as e:
                    failures.append(f"pp={pp}, stage mesh {cand.shape}, {m} microbatches: {e}")
                if progress and setups:
                    best = min(setups, key=lambda s: s.predicted_s)
                    progress(f"pipeline pp={pp} stage mesh {dict(zip(cand.names, cand.shape))} "
                             f"m={m}: best so far {best.predicted_s * 1e3:.3f} ms")
    setups.sort(key=lambda s: (s.predicted_s, s.memory_bytes))
    return setups, infeasible, failures


def _search_point(model: Any, example_inputs: Any, mesh: Mesh, config: Config,
                  cost_passes: Sequence[Callable[..., Any]], budget: float | None, pp: int,
                  cand: Candidate, m: int, cache: dict, infeasible: list) -> list[PipelineSetup]:
    """The setups of one (pp, stage mesh, microbatch count): a cut per schedule and v."""
    if m not in cache:
        traced, fwd = capture_with_forward(model, first_microbatch(example_inputs, m))
        cache[m] = (fwd, traced)
    fwd, traced = cache[m]
    active = sorted(set(fwd.unit_of.values()))  # units holding computation
    if len(active) < pp:
        raise PlanError(
            f"pipelining cuts a model between its repeated blocks (an nn.ModuleList of layers); "
            f"{type(model).__name__} has {len(active)} layer unit(s) with computation "
            f"({', '.join(fwd.units[i] for i in active)}), fewer than pp={pp} stages. Use pp=1 "
            f"or a model built from repeated blocks.")
    # every stage fits the device only if the whole model fits pp devices (a relaxation: it
    # counts each activation once, the stages hold several microbatches in flight)
    try:
        space, costs, res = solve_space(traced, mesh, config, cand, cost_passes,
                                        budget * pp if budget is not None else None)
    except InfeasibleMemoryError as e:
        raise InfeasibleMemoryError(
            f"pp={pp}, stage mesh {dict(zip(cand.names, cand.shape))}, {m} microbatches: the "
            f"{pp} pipeline ranks together ({pp} x {format_bytes(budget)}) cannot hold the model "
            f"even with one microbatch in flight: it needs {format_bytes(e.required_bytes)}, "
            f"{format_bytes(e.required_bytes - e.budget_bytes)} over, so no stage split fits.",
            # (a per-device need this setup surely meets is not known: the whole model's, as
            # the ILP reported it, keeps the other setups' exact needs first in the error)
            required_bytes=e.required_bytes, budget_bytes=budget) from e
    prefix = fwd.units[1].rsplit(".", 1)[0] if len(fwd.units) > 2 else None
    every = unit_costs(traced, fwd.units, prefix, space, costs, res.choice, fwd, cand, pp, mesh)
    layers = _merge_empty(every, active)
    out: list[PipelineSetup] = []
    refused: list[str] = []
    options = _schedules(pp, len(active), config)
    if not options:
        refused.append(f"Config(schedule={config.schedule!r}, virtual_stages="
                       f"{config.virtual_stages!r}) allows no schedule with {len(active)} layer "
                       f"units on pp={pp} (gpipe and 1f1b take one stage per rank; pp * v must "
                       f"not exceed the layer units)")
    for schedule, v in options:
        try:
            check_schedule(schedule, pp, v, m)
        except ValueError as e:
            refused.append(str(e))
            continue
        flight = in_flight(schedule, pp, v, m)
        try:
            # v > 1 is proved optimal only slowly (96 layers, pp=8: > 30 s); its local-search
            # start is already good, so the search spends at most a few seconds on it
            limit = config.solver_time_limit_s if v == 1 else min(config.solver_time_limit_s, 5.0)
            cut = solve_cuts(layers, pp, m, virtual_stages=v, in_flight=flight,
                             memory_budget_bytes=budget, time_limit_s=limit)
        except InfeasibleMemoryError as e:
            infeasible.append(e)
            continue
        stage_of_unit = _expand(_stage_of_unit(cut.starts, len(layers)), active, len(every))
        fw = [sum(c.forward_s for c, s in zip(every, stage_of_unit) if s == j) for j in range(pp * v)]
        bw = [sum(c.backward_s for c, s in zip(every, stage_of_unit) if s == j) for j in range(pp * v)]
        p2p = max(layers[cut.starts[j] - 1].send_s for j in range(1, pp * v)) / 2
        sim = simulate(schedule, fw, bw, m, pp, p2p_s=p2p,
                       weight_fraction=_WEIGHT_FRACTION)
        out.append(PipelineSetup(pp, cand, m, schedule, v, stage_of_unit, sim.step_time_s,
                                 max(cut.rank_memory_bytes)))
    if not out and refused:
        raise PlanError("; ".join(dict.fromkeys(refused)))
    return out


def _merge_empty(every: list[LayerCost], active: list[int]) -> list[LayerCost]:
    """The cut solver's chain: units with computation; an empty unit's costs (parameters that
    are read elsewhere, say) go to the previous active unit."""
    out: list[LayerCost] = []
    for i, c in enumerate(every):
        if i in active or not out:
            out.append(c)
        else:
            last = out[-1]
            out[-1] = LayerCost(last.name, last.forward_s + c.forward_s, last.backward_s + c.backward_s,
                                last.state_bytes + c.state_bytes,
                                last.activation_bytes + c.activation_bytes, c.send_s)
    return out[:len(active)]


def _expand(stages: tuple[int, ...], active: list[int], n: int) -> tuple[int, ...]:
    """Stage of every unit from the stages of the active ones (an empty unit follows the
    previous active unit, or the first one)."""
    out, j = [], 0
    for i in range(n):
        if j < len(active) - 1 and i >= active[j + 1]:
            j += 1
        out.append(stages[j])
    return tuple(out)


def _stage_of_unit(starts: Sequence[int], n: int) -> tuple[int, ...]:
    bounds = list(starts) + [n]
    return tuple(j for j in range(len(starts)) for _ in range(bounds[j], bounds[j + 1]))


# The stages traced for the last plan made in this process, reused by parallelize (tracing is
# most of the time of planning a small model). Keyed by the model object and the cut.
_LAST_STAGES: dict[tuple, tuple[ForwardGraph, list]] = {}
_LAST_MODEL: list[Any] = []  # a weak reference to the model the cache was made for


def _traced_stages(model: Any, example_inputs: Any, microbatches: int,
                   stage_of_unit: tuple[int, ...], autocast: bool) -> tuple[ForwardGraph, list]:
    import weakref

    shapes = tuple(tuple(x.shape) for x in microbatch_inputs(example_inputs, 1)[0][0]
                   if hasattr(x, "shape"))
    key = (id(model), microbatches, tuple(stage_of_unit), shapes, autocast)
    same_model = bool(_LAST_MODEL) and _LAST_MODEL[0]() is model
    if key not in _LAST_STAGES or not same_model:
        chunks, _ = microbatch_inputs(example_inputs, microbatches)
        fwd = export_forward(model, unflatten_inputs(example_inputs, chunks[0]))
        if len(fwd.units) != len(stage_of_unit):
            raise PlanError(f"the model has {len(fwd.units)} layer units {fwd.units}; the plan "
                            f"cuts {len(stage_of_unit)}: re-plan for this model.")
        _LAST_STAGES.clear()
        _LAST_STAGES[key] = (fwd, capture_stages(fwd, stage_of_unit, chunks[0],
                                                 torch.bfloat16 if autocast else None))
        _LAST_MODEL[:] = [weakref.ref(model)]
    return _LAST_STAGES[key]


def forward_for_plan(model: Any, example_inputs: Any, plan: Plan) -> tuple[ForwardGraph, list]:
    """The stages of ``plan.pipeline`` traced for ``model`` (under bf16 autocast when the plan
    was made with it): the forward graph and, per stage, ``(StageGraph, TracedGraph)``."""
    pipe = plan.pipeline
    autocast = plan.techniques.get("mixed_precision") == "bf16-autocast"
    fwd, stages = _traced_stages(model, example_inputs, pipe.microbatches, pipe.stage_of_unit, autocast)
    if fwd.units != pipe.units:
        raise PlanError(f"the model's layer units {fwd.units} differ from the plan's {pipe.units}; "
                        f"re-plan for this model.")
    return fwd, stages


@dataclass(frozen=True)
class ModelFacts:
    """What a pipelined plan records about the whole model, without tracing it whole.

    ``input_shapes``: the flattened user inputs' shapes (one global batch); ``flops``: the
    model's FLOPs per step (forward and backward, no recomputation) and ``flops_dtype`` the
    dtype of the peak they are measured against (MFU).
    """

    fingerprint: str
    input_shapes: tuple[tuple[int, ...], ...]
    flops: float
    flops_dtype: str
    capture_time_s: float = 0.0

    @classmethod
    def of_traced(cls, traced: TracedGraph, config: Config) -> "ModelFacts":
        """The facts of a whole-model trace."""
        flops, dtype = traced_flops(traced, config)
        return cls(traced.fingerprint(), tuple(tuple(i.shape) for i in traced.inputs), flops,
                   dtype, traced.capture_time_s)


def build_pipeline_plan(model: Any, example_inputs: Any, facts: ModelFacts, mesh: Mesh,
                        config: Config, setup: PipelineSetup,
                        cost_passes: Sequence[Callable[..., Any]], budget: float | None,
                        progress: Callable[[str], None] | None = None) -> Plan:
    """Plan every stage of ``setup`` with the intra-operator ILP and assemble the Plan
    (``progress``: told when the stages are traced and as each distinct one is placed).

    Stages with the same graph (node for node: ops, shapes, parameter shapes) and the same
    pinned tied weights are solved once (:func:`stage_key`), with the most microbatches in
    flight among them (the tightest memory, so the solution fits every one of them); the
    others take that solution under their own parameter and layer names, with their memory
    scaled to their own microbatches in flight (:func:`renamed_stage_plan`). For a model of
    identical blocks that is a handful of solves whatever the number of stages. The price: a
    stage holding fewer microbatches than its group's most could, where memory binds, have
    had a faster strategy.
    """
    t0 = time.perf_counter()
    fwd, stages = _traced_stages(model, example_inputs, setup.microbatches, setup.stage_of_unit,
                                 config.mixed_precision == "bf16")
    plans: list[Plan] = []
    placed: dict[str, tuple[str, ...]] = {}  # a tied weight takes the first stage's placement
    # zero-bubble holds a microbatch's saved values until its weight step
    flight = in_flight(setup.schedule, setup.pp, setup.virtual_stages, setup.microbatches,
                       held_until(setup.schedule))
    shape_of = [stage_key(traced, {}) for _, traced in stages]
    if progress:
        progress(f"traced the model and its {len(stages)} pipeline stages in "
                 f"{time.perf_counter() - t0:.1f} s ({len(set(shape_of))} distinct graphs)")
    most = {k: max(f for k2, f in zip(shape_of, flight) if k2 == k) for k in shape_of}
    # a group is solved for the stages holding its most microbatches in flight (their budget);
    # the ranks' sums are checked once every stage is placed
    budgets = setup.stage_budgets(budget)
    tightest = {k: min(b for k2, b, f in zip(shape_of, budgets, flight) if k2 == k and f == most[k])
                for k in shape_of}
    solved: dict[str, tuple[Plan, TracedGraph, int]] = {}
    for (st, traced), shape in zip(stages, shape_of):
        fixed = {p.name: placed[fwd.canonical.get(p.name, p.name)] for p in traced.params
                 if fwd.canonical.get(p.name, p.name) in placed}
        key = stage_key(traced, fixed)
        if key not in solved:
            # the stage's budget: its predicted peak scaled by its rank's slack (stage_budgets)
            plan = solve_candidate(traced, mesh, config, setup.cand, cost_passes,
                                   tightest[shape], stage=st.index, fixed=fixed,
                                   activation_scale=most[shape],
                                   microbatches=setup.microbatches,
                                   split_backward=setup.schedule == "zero-bubble")
            solved[key] = (plan, traced, most[shape])
            if progress:
                progress(f"placed stage {st.index} ({len(solved)} distinct so far), "
                         f"{time.perf_counter() - t0:.1f} s in")
        plan = renamed_stage_plan(*solved[key], traced, st.index, flight[st.index])
        for p in traced.params:
            placed.setdefault(fwd.canonical.get(p.name, p.name), plan.params[p.name])
        plans.append(plan)
    plans = common_cp_layout(plans, config)
    rank = _rank_memory(plans, setup, setup.pp)
    if budget is not None and max(rank) > budget * (1 + 1e-9):
        r = max(range(setup.pp), key=rank.__getitem__)
        raise InfeasibleMemoryError(
            f"pipeline rank {r} of {setup.pp} needs {format_bytes(rank[r])} over its "
            f"{len(plans) // setup.pp} stage(s), over the {format_bytes(budget)} budget (each "
            f"stage fits its own budget; the rank's sum does not). Raise Config.memory_bytes or use more "
            f"pipeline stages.", required_bytes=rank[r], budget_bytes=budget)
    return _assemble(model, facts, mesh, config, setup, fwd, stages, plans,
                     time.perf_counter() - t0, len(solved))


def _assemble(model: Any, facts: ModelFacts, mesh: Mesh, config: Config, setup: PipelineSetup,
              fwd: ForwardGraph, stages: list, plans: list[Plan], elapsed: float,
              distinct: int) -> Plan:
    m, pp, cand = setup.microbatches, setup.pp, setup.cand
    fw = [p.predicted["forward_s"] for p in plans]
    bw = [p.predicted["step_time_s"] - f for p, f in zip(plans, fw)]
    # ZeRO-1 (a stage's reductions are deferred to the step's end, runtime.pipeline): stored
    # sharded over dp, gathered once a step; ZeRO-3: gathered for every microbatch's forward
    # and backward, each gather issued while the rank's action before it computes
    # (runtime.prefetch; priced by the schedule's simulation)
    zero_axes = tuple(cand.zero_axes) if config.zero else ()
    stored = [{p.name: stored_placement(plan.params[p.name], p.shape, cand.shape, zero_axes)
               for p in traced.params} for (_, traced), plan in zip(stages, plans)]
    regathers = m if config.zero == 3 and zero_axes else 0
    reductions, reduce_s, gather_s = step_end_reductions(stages, plans, pp, cand, mesh, stored,
                                                         regathers)
    sends = _send_times(fwd, fwd.units, cand, pp, mesh)
    starts = [i for i in range(1, len(setup.stage_of_unit)) if setup.stage_of_unit[i] != setup.stage_of_unit[i - 1]]
    p2p = max((sends[i - 1] for i in starts), default=0.0) / 2
    sim = simulate(setup.schedule, fw, bw, m, pp, p2p_s=p2p,
                   weight_fraction=_WEIGHT_FRACTION, gather_s=gather_s if regathers else None)
    collectives: list[Collective] = []
    params: dict[str, tuple[str, ...]] = {}  # as stored between steps
    holders: dict[str, set[int]] = {}
    for ((st, traced), plan), kept in zip(zip(stages, plans), stored):
        collectives += [c for _ in range(m) for c in plan.collectives]
        for p in traced.params:
            name = fwd.canonical.get(p.name, p.name)
            params.setdefault(name, kept[p.name])
            holders.setdefault(name, set()).add(st.index % pp)
    stride = math.prod(cand.shape)
    tied_s = 0.0
    for name in sorted(n for n, h in holders.items() if len(h) > 1):
        weight = model.get_parameter(name)
        nbytes = weight.numel() * weight.element_size() // param_shards(params[name], cand.shape)
        collectives.append(Collective("all_reduce", "pp", int(nbytes), "backward", "", name, None))
        tied_s += axis_collective_time("all_reduce", nbytes, pp, stride, mesh.topology)
    collectives.append(Collective("all_reduce", "pp", 4, "forward", "", "loss", None))
    collectives += _point_to_point(stages, cand, m)
    collectives += reductions
    memory = _rank_memory(plans, setup, pp)
    inputs = _input_placements(len(facts.input_shapes), stages, plans)
    pipe = PipelinePlan(
        schedule=setup.schedule, microbatches=m, microbatch_size=facts.input_shapes[0][0] // m,
        virtual_stages=setup.virtual_stages, units=fwd.units, stage_of_unit=setup.stage_of_unit,
        stages=tuple(plans),
        predicted={"step_time_s": sim.step_time_s + tied_s + reduce_s,
                   "bubble_fraction": sim.bubble_fraction,
                   "stage_time_s": [f + b for f, b in zip(fw, bw)], "peak_memory_bytes": memory,
                   "stage_memory_bytes": [p.predicted["peak_memory_bytes"] for p in plans],
                   "p2p_s": p2p, "weight_fraction": _WEIGHT_FRACTION,
                   "search_estimate_s": setup.predicted_s},
        cut_solver={"search_estimate_s": setup.predicted_s, "stage_planning_s": elapsed,
                    "distinct_stage_solves": distinct})
    degrees = dict(plans[0].degrees, pp=pp)
    warnings = tuple(dict.fromkeys(w for p in plans for w in p.warnings))
    # per device: the busiest pipeline rank's stages, every microbatch
    compute = max(sum(p.predicted["compute_s"] for j, p in enumerate(plans) if j % pp == r)
                  for r in range(pp)) * m
    comm = max(sum(p.predicted["comm_s"] for j, p in enumerate(plans) if j % pp == r)
               for r in range(pp)) * m
    optimizer = max(sum(p.predicted["optimizer_s"] for j, p in enumerate(plans) if j % pp == r)
                    for r in range(pp))
    if regathers:  # the busiest rank's ZeRO-3 gathers, one per forward and backward
        comm += max(2 * m * sum(gather_s[r::pp]) for r in range(pp))
    step = sim.step_time_s + tied_s + reduce_s
    return Plan(
        model_fingerprint=facts.fingerprint, mesh_shape=(pp, *cand.shape),
        axis_names=("pp", *cand.names), degrees=degrees, params=params, inputs=inputs,
        output_placements=(), nodes={}, collectives=tuple(collectives),
        predicted={"model_flops": facts.flops,
                   "mfu": mfu(facts.flops, step + optimizer, pp * stride, mesh.topology,
                              facts.flops_dtype),
                   "step_time_s": step, "compute_s": compute, "comm_s": comm + tied_s + reduce_s,
                   "optimizer_s": optimizer, "peak_memory_bytes": max(memory),
                   "bubble_fraction": sim.bubble_fraction},
        solver={"status": "optimal" if all(p.solver["status"] == "optimal" for p in plans) else "feasible",
                "backend": plans[0].solver["backend"], "gap": max(p.solver["gap"] for p in plans),
                "solve_time_s": sum(p.solver["solve_time_s"] for p in plans),
                "ilp_variables": sum(p.solver["ilp_variables"] for p in plans),
                "ilp_variables_unlinked": sum(p.solver["ilp_variables_unlinked"] for p in plans),
                "ilp_groups": sum(p.solver["ilp_groups"] for p in plans),
                "capture_time_s": facts.capture_time_s},
        warnings=warnings, topology=mesh.topology.name, config=config.to_dict(),
        input_shapes=facts.input_shapes, pipeline=pipe,
        techniques=dict(plans[0].techniques))


def boundary_bytes(val: Any, cand: Candidate) -> int:
    """Bytes a rank sends (and receives) of a value crossing a pipeline cut: its part under
    :func:`~autopar.strategies.space.boundary_placements` (split on the batch over the data
    axes, on the sequence over cp)."""
    shape = tuple(val.shape)
    edge = boundary_placements(shape, cand.shape, cand.dp_axes, cand.cp_axes)
    return math.prod(local_shape(shape, edge, tuple(cand.shape))) * val.element_size()


def _point_to_point(stages: list, cand: Candidate, m: int) -> list[Collective]:
    """The sends and receives of boundary activations (forward) and their gradients (backward),
    for every microbatch, tagged with the stage whose ranks issue them."""
    out: list[Collective] = []
    for st, traced in stages:
        nodes = {n.name: n for n in traced.gm.graph.nodes}
        for names, fwd_kind in ((traced.boundary_inputs, "recv"), (traced.boundary_tangents, "send")):
            for name in names:
                val = nodes[name].meta["val"]
                nbytes = boundary_bytes(val, cand)
                bwd_kind = "send" if fwd_kind == "recv" else "recv"
                for _ in range(m):
                    out.append(Collective(fwd_kind, "pp", nbytes, "forward", "", name, st.index))
                    out.append(Collective(bwd_kind, "pp", nbytes, "backward", "", name, st.index))
    return out


def _rank_memory(plans: list[Plan], setup: PipelineSetup, pp: int) -> list[float]:
    """Per pipeline rank, the peak of its stages (:func:`~autopar.cost_models.pipeline.
    rank_memory` on the stage plans' predictions). A ZeRO-3 stage's peak holds the next
    action's gather in flight at its own size (``cost_models.liveness.step_memory``); that
    action may be another stage of the rank (``runtime.prefetch``): the rank's largest."""
    ahead = [p.predicted.get("ahead_bytes", 0.0) for p in plans]
    most = [max(ahead[r::pp]) for r in range(pp)]
    return list(rank_memory(setup.schedule, pp, setup.virtual_stages, setup.microbatches,
                            [p.predicted["peak_memory_bytes"] - g + most[j % pp]
                             for j, (p, g) in enumerate(zip(plans, ahead))],
                            [p.predicted["held_bytes"] for p in plans],
                            [p.predicted["saved_bytes"] for p in plans]))


def _input_placements(num_inputs: int, stages: list, plans: list[Plan]) -> tuple:
    """Placement of every flattened model input, from the first stage that reads it."""
    found: dict[int, tuple[str, ...]] = {}
    for (st, traced), plan in zip(stages, plans):
        for info, pl in zip(traced.inputs, plan.inputs):
            found.setdefault(info.index, pl)
    return tuple(found.get(i, ()) for i in range(num_inputs))
