"""The per-unit path: the whole model's intra-operator ILP for every (dp, tp) mesh and, where
pipelines are searched, one whole-model ILP per (pp, stage mesh, microbatch count)
(:mod:`autopar.planning.pipeline`). The entry policy (:mod:`autopar.planning.entry`) takes it
for models the setup search cannot price, a single device and small models the search has no
answer for."""

from __future__ import annotations

import math

from typing import Any, Callable, Sequence


from autopar.config import Config
from autopar.cost_models.sharding import SpaceCosts
from autopar.errors import PlanError
from autopar.graph import TracedGraph
from autopar.mesh import Mesh
from autopar.plan import Plan
from autopar.solver.ilp import InfeasibleMemoryError, format_bytes

__all__ = ['make_plan']


from autopar.strategies.rules import EXPERT_OPS
from autopar.strategies.space import tensor_inputs
from autopar.planning.candidates import Candidate, memory_techniques, mesh_candidates
from autopar.planning.pipeline import ModelFacts, build_pipeline_plan
from autopar.planning.pipeline_search import search_pipeline
from autopar.planning.assembly import utilization
from autopar.planning.solve import replace_plan, solve_candidate


def make_plan(traced: TracedGraph, mesh: Mesh, config: Config,
              cost_passes: Sequence[Callable[..., SpaceCosts]] = (),
              progress: Callable[[str], None] | None = None,
              model: Any = None, example_inputs: Any = None) -> Plan:
    """Solve every candidate logical mesh and return the plan with the lowest predicted time.

    With ``model`` and ``example_inputs`` given, pipelined plans (``pp > 1``) are searched too
    (see :mod:`autopar.planning.pipeline`). ``Config.recompute`` and ``Config.zero`` left
    ``None`` are chosen by memory: the plan uses neither unless nothing fits the budget without
    them; then the cheapest that fits, in the order of :func:`memory_techniques`. A pipeline
    (when the config leaves ``pp`` free) comes after them, without them (set them explicitly
    for a pipelined plan that recomputes or shards the optimizer).
    """
    combos = memory_techniques(config)
    if len(combos) == 1:
        return _make_plan(traced, mesh, combos[0], cost_passes, progress, model, example_inputs)
    tried: list[InfeasibleMemoryError] = []
    for concrete in combos:  # without a pipeline first: a pipeline's bubble costs more
        try:
            return _make_plan(traced, mesh, concrete, cost_passes, progress, model,
                              example_inputs, pipeline_fallback=False)
        except InfeasibleMemoryError as e:
            tried.append(e)
            if progress:
                progress(f"recompute={concrete.recompute} zero={concrete.zero}: nothing fits")
    pipeline = ""
    if model is not None and _search_pipelines(combos[0], mesh, [], True) and config.pp is None:
        try:  # then a pipeline, with neither technique (the flat plans are known not to fit)
            return _make_plan(traced, mesh, combos[0], cost_passes, progress, model,
                              example_inputs, flat=False)
        except InfeasibleMemoryError as e:
            tried.append(e)
            pipeline = ", then a pipeline"
        except PlanError as e:  # no pipeline can be placed: the memory error is the answer
            pipeline = f", then a pipeline, which cannot be placed ({e})"
    best = min(tried, key=lambda e: e.required_bytes)
    settings = ", ".join(f"recompute={c.recompute} zero={c.zero}" for c in combos)
    raise InfeasibleMemoryError(f"{best} Tried {settings}{pipeline}.",
                                required_bytes=best.required_bytes, budget_bytes=best.budget_bytes)


def _make_plan(traced: TracedGraph, mesh: Mesh, config: Config,
               cost_passes: Sequence[Callable[..., SpaceCosts]] = (),
               progress: Callable[[str], None] | None = None,
               model: Any = None, example_inputs: Any = None, pipeline_fallback: bool = True,
               flat: bool = True) -> Plan:
    """:func:`make_plan` for one concrete (recompute, zero) setting; ``pipeline_fallback``
    False searches pipelines only where they are searched even when a flat plan fits;
    ``flat`` False skips the plans without a pipeline."""
    budget = config.memory_bytes if config.memory_bytes is not None else mesh.topology.memory_bytes
    results, infeasible, unplaceable = [], [], []
    # (the experts of the MoE layers, their gcd: what an ep degree must split evenly)
    experts = math.gcd(*[tensor_inputs(n)[EXPERT_OPS[n.target][1]].meta["val"].shape[0]
                         for n in traced.gm.graph.nodes if n.target in EXPERT_OPS])
    cands = mesh_candidates(mesh.size, config, experts, mesh.topology.gpus_per_node) \
        if config.pp in (None, 1) and flat else []
    for cand in cands:
        try:
            plan = solve_candidate(traced, mesh, config, cand, cost_passes, budget)
        except InfeasibleMemoryError as e:
            infeasible.append((cand, e))
            continue
        except PlanError as e:  # e.g. a batch not divisible by this data-parallel degree
            unplaceable.append(str(e))
            continue
        if progress:
            progress(f"mesh {dict(zip(cand.names, cand.shape))}: predicted "
                     f"{plan.predicted['step_time_s'] * 1e3:.3f} ms")
        results.append(plan)
    if model is not None and _search_pipelines(config, mesh, results, pipeline_fallback):
        _add_pipeline(traced, mesh, config, cost_passes, progress, model, example_inputs, budget,
                      results, infeasible, unplaceable)
    elif config.pp not in (None, 1):
        raise PlanError(f"Config(pp={config.pp}) needs the model: plan with autopar.plan(model, "
                        f"mesh, example_inputs) or autopar.parallelize(...).")
    if not results and not infeasible:
        raise PlanError("no mesh candidate can place the model:\n" + "\n".join(
            unplaceable or [f"no (dp, tp, pp) setup of {mesh.size} devices matches {config}; "
                            f"relax the degrees set in the Config"]))
    if not results:
        cand, closest = min(infeasible, key=lambda x: x[1].required_bytes)
        need = closest.required_bytes
        raise InfeasibleMemoryError(
            f"no plan fits the memory budget of {format_bytes(budget)} per device on "
            f"{mesh.size} devices; the smallest plan needs {format_bytes(need)} "
            f"({format_bytes(need - budget)} over), on {_describe(cand)}: {closest} Raise "
            f"Config.memory_bytes, use more devices, or a smaller model/batch.",
            required_bytes=need, budget_bytes=budget)
    results.sort(key=lambda p: p.predicted["step_time_s"])
    best = results[0]
    if "mfu" not in best.predicted:  # pipelined plans have it from their assembly
        best = replace_plan(best, predicted={**best.predicted, **utilization(
            traced, config, mesh, best.predicted["step_time_s"] + best.predicted["optimizer_s"],
            mesh.size)})
    alts = tuple({"degrees": p.degrees, "mesh_shape": p.mesh_shape, "axis_names": p.axis_names,
                  "step_time_s": p.predicted["step_time_s"]} for p in results[1:])
    return replace_plan(best, alternatives=alts)


def _search_pipelines(config: Config, mesh: Mesh, flat_plans: list[Plan], fallback: bool = True) -> bool:
    """Whether to search pipelined plans: when asked (``Config.pp > 1``), when no plan without
    a pipeline fits, or when the mesh spans nodes (where Megatron-LM puts pipeline stages, to
    keep tensor parallelism on the fast links inside a node). On one node with a plan that fits,
    tensor and data parallelism over the node's links beat a pipeline bubble and the search
    (a trace per microbatch size) is skipped."""
    if mesh.size == 1 or config.pp == 1:
        return False
    return config.pp is not None or (fallback and not flat_plans) or mesh.nodes > 1


def _describe(cand: Candidate | None) -> str:
    """``mesh dp=2 x tp=2`` for a flat candidate; a pipelined setup says its own."""
    if cand is None:
        return "a pipeline"
    return "mesh " + " x ".join(f"{n}={s}" for n, s in zip(cand.names, cand.shape))


def _add_pipeline(traced: TracedGraph, mesh: Mesh, config: Config, cost_passes: Sequence,
                  progress: Callable[[str], None] | None, model: Any, example_inputs: Any,
                  budget: float | None, results: list, infeasible: list, unplaceable: list) -> None:
    """Search pipelined setups; plan the best one's stages and add it to ``results``."""

    setups, errors, failures = search_pipeline(model, example_inputs, mesh, config, cost_passes,
                                               budget, progress)
    infeasible.extend((None, e) for e in errors)
    unplaceable.extend(failures)
    for setup in setups[:1]:
        try:
            plan = build_pipeline_plan(model, example_inputs, ModelFacts.of_traced(traced, config),
                                       mesh, config, setup, cost_passes, budget, progress)
        except InfeasibleMemoryError as e:
            infeasible.append((None, e))
            continue
        if progress:
            progress(f"pipeline pp={setup.pp} {setup.schedule} v={setup.virtual_stages} "
                     f"m={setup.microbatches}: predicted {plan.predicted['step_time_s'] * 1e3:.3f} ms")
        results.append(plan)
