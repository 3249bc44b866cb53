"""A pipelined setup planned for real: each stage traced on its own and solved by the
intra-operator ILP on the stage mesh, the step predicted by the schedule simulator from those
stage plans (:func:`build_pipeline_plan`). The setups come from the setup search
(:mod:`autopar.planning.search`) or the per-unit path's pipeline search
(:mod:`autopar.planning.pipeline_search`).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from autopar.config import Config
from autopar.cost_models.comm import axis_collective_time
from autopar.cost_models.sharding import stored_placement
from autopar.cost_models.compute import mfu
from autopar.cost_models.pipeline import held_until, in_flight, rank_memory, simulate
from autopar.errors import PlanError
from autopar.graph import TracedGraph
from autopar.mesh import Mesh
from autopar.plan import Collective, PipelinePlan, Plan
from autopar.solver.ilp import InfeasibleMemoryError, format_bytes
from autopar.planning.assembly import traced_flops
from autopar.planning.candidates import Candidate
from autopar.planning.collectives import step_end_reductions
from autopar.planning.solve import solve_candidate
from autopar.planning.stage_workers import StageWorkers, explained, independent_jobs, worker_count
from autopar.plan_context import attach
from autopar.planning.records import param_shards
from autopar.planning.sequence import common_cp_layout
from autopar.planning.stage_reuse import renamed_stage_plan, stage_key
from autopar.strategies.reshard import local_shape
from autopar.strategies.space import boundary_placements
from autopar.capture.stages import (
    ForwardGraph, capture_stages, export_forward, microbatch_inputs, unflatten_inputs,
)

__all__ = ["WEIGHT_FRACTION", "batch_size", "boundary_bytes", "build_pipeline_plan",
           "forward_for_plan", "ModelFacts", "PipelineSetup", "send_times"]

# Share of a backward that computes weight gradients, for zero-bubble's separate W step: about
# half for matmul-dominated layers (Qi et al., ICLR'24, section 2: T_B ~ T_W).
WEIGHT_FRACTION = 0.5


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
    """The inputs' batch (their common dim-0 size); PlanError when they differ."""
    chunks, _ = microbatch_inputs(example_inputs, 1)
    sizes = {x.shape[0] for x in chunks[0] if hasattr(x, "shape") and x.dim() > 0}
    if len(sizes) != 1:
        raise PlanError(f"pipelining splits every input on dim 0 into microbatches; the inputs' "
                        f"dim-0 sizes differ ({sorted(sizes)}). Give inputs with one batch size.")
    return sizes.pop()


def send_times(fwd: ForwardGraph, units: tuple[str, ...], cand: Candidate, pp: int,
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

    def job(st: Any, traced: TracedGraph, shape: str, fixed: dict) -> Callable[[], Plan]:
        # the stage's budget: its predicted peak scaled by its rank's slack (stage_budgets)
        return functools.partial(solve_candidate, traced, mesh, config, setup.cand, cost_passes,
                                 tightest[shape], stage=st.index, fixed=fixed,
                                 activation_scale=most[shape], microbatches=setup.microbatches,
                                 split_backward=setup.schedule == "zero-bubble")

    # the distinct stages that depend on no other's placement, solved at once (stage_workers)
    workers = StageWorkers(independent_jobs(stages, shape_of, fwd.canonical, job),
                           worker_count(model), config.solver_time_limit_s)
    try:
        for (st, traced), shape in zip(stages, shape_of):
            fixed = {p.name: placed[fwd.canonical.get(p.name, p.name)] for p in traced.params
                     if fwd.canonical.get(p.name, p.name) in placed}
            key = stage_key(traced, fixed)
            if key not in solved:
                solve = job(st, traced, shape, fixed)
                plan, extra = workers.plan(key, solve)
                if extra is not None:  # (placed by a worker: explained from its choice)
                    attach(plan, functools.partial(explained, solve, extra))
                solved[key] = (plan, traced, most[shape])
                if progress:
                    progress(f"placed stage {st.index} ({len(solved)} distinct so far), "
                             f"{time.perf_counter() - t0:.1f} s in")
            plan = renamed_stage_plan(*solved[key], traced, st.index, flight[st.index])
            for p in traced.params:
                placed.setdefault(fwd.canonical.get(p.name, p.name), plan.params[p.name])
            plans.append(plan)
    finally:
        workers.close()
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
    sends = send_times(fwd, fwd.units, cand, pp, mesh)
    starts = [i for i in range(1, len(setup.stage_of_unit)) if setup.stage_of_unit[i] != setup.stage_of_unit[i - 1]]
    p2p = max((sends[i - 1] for i in starts), default=0.0) / 2
    sim = simulate(setup.schedule, fw, bw, m, pp, p2p_s=p2p,
                   weight_fraction=WEIGHT_FRACTION, gather_s=gather_s if regathers else None)
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
                   "p2p_s": p2p, "weight_fraction": WEIGHT_FRACTION,
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
