"""The one planner: the setup search, then the per-operator placements of the chosen setup.

:func:`plan_model` is what :func:`autopar.plan`, :func:`autopar.search` and
:func:`autopar.parallelize` run. For a model built from identical blocks (an ``nn.ModuleList``
of two or more blocks of one structure) it

1. searches the setups (degrees with tp inside a node, microbatch size, schedule and v,
   recomputation, ZeRO, sequence parallelism) priced in closed form from per-layer ILPs of a
   two-block copy of the model (:mod:`autopar.planning.search`), then
2. solves the per-operator placements of the best setup and assembles a runnable plan: the whole
   model's intra-operator ILP on the (dp, tp) mesh without a pipeline, or every pipeline stage's
   ILP on the stage mesh (stages with the same graph solved once,
   :func:`~autopar.planning.pipeline.build_pipeline_plan`). A setup whose per-operator
   solve does not fit the device memory (the per-operator memory model is finer than the
   search's) gives way to the next-ranked one, with a warning.

Other models, a single device and the GPipe and zero-bubble schedules take the
per-unit path (:func:`~autopar.planning.per_unit.make_plan`): the whole model's intra-operator ILP
for every (dp, tp) mesh and, where pipelines are searched, one whole-model ILP per (pp, stage
mesh, microbatch count). Its cost grows with the model: seconds for the test models, minutes for
a billion parameters, which is why models of identical blocks take the search.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import time
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn
from autopar._torch_private import tree_flatten

from autopar.capture import capture, model_fingerprint, normalize_inputs
from autopar.config import Config
from autopar.errors import PlanError
from autopar.plan_context import carry
from autopar.mesh import Mesh
from autopar.capture.layers import identical_blocks
from autopar.plan import Plan
from autopar.solver.ilp import InfeasibleMemoryError, format_bytes
from autopar.planning.pipeline import ModelFacts, PipelineSetup, build_pipeline_plan
from autopar.planning.assembly import traced_flops
from autopar.planning.candidates import HSDP_AXES, inner_axes, mesh_candidates
from autopar.capture.moe import has_expert_blocks
from autopar.planning.per_unit import make_plan
from autopar.planning.solve import solve_candidate
from autopar.planning.setups import sequences_beside_cp
from autopar.planning.search import (
    LayerSolver, SearchResult, layer_key, model_flops, pruned_examples, search,
    search_unsupported,
)
from autopar.cost_models.compute import mfu
from autopar.cost_models.training_step import Setup, StepCost

__all__ = ["COMPARED_DEGREES", "PER_UNIT_FALLBACK_LIMIT", "REALIZE_TRIES", "plan_model"]

# setups, best first, whose per-operator placements are tried before giving up
REALIZE_TRIES = 4
# the search's space is a subset of the per-unit path's (tp inside a node, power-of-two
# microbatches, two schedules): when it has no answer, models small enough for whole-model
# ILPs (blocks x devices up to this) are planned by the per-unit path, which also explains
# what does not fit stage by stage; beyond it the search's own error is raised
PER_UNIT_FALLBACK_LIMIT = 1024
# (dp, tp, pp) degrees whose best setups are realized and compared, for models within it
COMPARED_DEGREES = 3


def plan_model(model: nn.Module, mesh: Mesh, example_inputs: Any, config: Config,
               cost_passes: Sequence[Callable[..., Any]] = (),
               progress: Callable[[str], None] | None = None, top_k: int = 5,
               traced: Any = None) -> Plan:
    """The plan of ``model`` on ``mesh`` (module docstring); ``traced``: the model's whole
    capture when the caller has one (it is made here only when a path needs it). Python's
    cyclic garbage collector is paused meanwhile (:func:`_paused_gc`)."""
    with _paused_gc():
        return _plan_model(model, mesh, example_inputs, config, cost_passes, progress, top_k,
                           traced)


@contextlib.contextmanager
def _paused_gc() -> Iterator[None]:
    """Python's cyclic garbage collector off for the block (as it was after). Planning builds
    millions of small objects that live until it ends (strategies, prices, the ILPs' arrays),
    and each full collection walks all of them again: DeepSeek-V3 on 2,048 virtual GPUs
    (``benchmarks/moe_plan_scale.py``, one run each) planned in 67.2 s with the collector off against 72.4 s
    on, its first stage's strategies enumerated in 3.7-4.0 s against 5.0-6.6 s, for 6% more
    peak memory (2.46 against 2.32 GB; docs/validation.md). Reference counting still frees
    what is not in a cycle; the cycles left are collected once it is back on."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _plan_model(model: nn.Module, mesh: Mesh, example_inputs: Any, config: Config,
                cost_passes: Sequence[Callable[..., Any]], progress: Callable[[str], None] | None,
                top_k: int, traced: Any) -> Plan:
    t0 = time.perf_counter()
    if config.ep not in (None, 1) and not has_expert_blocks(model):
        raise PlanError(f"Config(ep={config.ep}) splits the experts of mixture-of-experts layers, "
                        f"and {type(model).__name__} has none that autopar can split (transformers' "
                        f"experts modules without biases: autopar.capture.moe). Leave ep None.")
    reason = search_unsupported(model, example_inputs, mesh, config)
    plan = None
    if reason is None:
        try:
            plan = _plan_by_search(model, mesh, example_inputs, config, cost_passes, progress,
                                   top_k, traced)
        except PlanError as e:  # InfeasibleMemoryError included
            if _blocks(model) * mesh.size > PER_UNIT_FALLBACK_LIMIT:
                raise
            reason = f"the setup search found no runnable setup ({_first_line(e)})"
    if plan is None:
        if progress:
            progress(f"per-unit planning: {reason}")
        if traced is None:
            traced = capture(model, example_inputs, config.mixed_precision)
        plan = make_plan(traced, mesh, config, cost_passes, progress, model, example_inputs)
        plan = _replace(plan, solver={**plan.solver, "path": f"per-unit ILPs ({reason})"})
    _check_forced(plan, config)
    if config.ep_in_cp is not None and plan.degrees["ep"] == 1:  # (the realized Config drops it)
        plan = _replace(plan, warnings=(*plan.warnings, f"ep_in_cp={config.ep_in_cp!r} changes "
                                        f"nothing without expert parallelism (ep=1): no experts "
                                        f"are split"))
    return _replace(plan, model_fingerprint=model_fingerprint(model, example_inputs),
                    solver={**plan.solver, "planning_time_s": time.perf_counter() - t0})


def _check_forced(plan: Plan, config: Config) -> None:
    """Refuse a plan that drops a setting the config forces: every field set holds in the plan
    or planning stops and says why (sequence parallelism: the model may have no layer norm for
    it to shard; pipeline settings: the plan may have no pipeline). ``recompute`` and ``zero``
    that change nothing on this model and mesh are recorded as off with a warning
    (:func:`autopar.planning.records.applied_techniques`)."""
    if config.sequence_parallel and not plan.techniques.get("sequence_parallel"):
        raise PlanError(
            "Config(sequence_parallel=True) cannot hold for this model and mesh: autopar's "
            "sequence parallelism runs the layer norms (aten.native_layer_norm) on inputs "
            "sharded on the sequence dim over tp, and the plan has none that does (the model "
            "normalises with other ops, e.g. an RMSNorm written out, or no tp > 1 was chosen). "
            "Use sequence_parallel=None or False.")
    pipe = plan.pipeline
    asked = {k: getattr(config, k) for k in ("schedule", "virtual_stages", "microbatch_size")
             if getattr(config, k) is not None}
    if pipe is None:
        batch = plan.techniques.get("microbatch_size")
        asked = {k: v for k, v in asked.items() if not (k == "virtual_stages" and v == 1)
                 and not (k == "microbatch_size" and v == batch)}
        if asked:
            given = ", ".join(f"{k}={v!r}" for k, v in asked.items())
            raise PlanError(f"Config({given}) describes a pipeline, and the plan has none (pp=1 "
                            f"runs the whole batch at once). Set Config.pp > 1 for a pipelined "
                            f"plan, or leave {', '.join(asked)} None.")
        held = {}
    else:
        held = {"schedule": pipe.schedule, "virtual_stages": pipe.virtual_stages,
                "microbatch_size": plan.techniques.get("microbatch_size", pipe.microbatch_size)}
    # a forced degree is the size of the mesh axis of that name (the solver may use a tp axis
    # to split the batch too: plan.degrees says what each axis does, the mesh what was asked)
    sizes = dict(zip(plan.axis_names, plan.mesh_shape))
    held |= {k: sizes.get(k, 1) for k in ("dp", "tp", "pp", "cp", "ep")}
    held["dp"] *= held["ep"]  # (the ep axis is cut out of dp)
    held["ep"] = plan.degrees["ep"]  # (or is the cp axis: ep_in_cp)
    held["ep_in_cp"] = None if held["ep"] == 1 else "ep" not in sizes
    if HSDP_AXES[0] in sizes:  # (hybrid sharding cuts dp in two axes)
        held["dp"] = math.prod(sizes[a] for a in HSDP_AXES)
    if sizes.get("cp", 1) > 1 and sizes.get("tp", 1) > 1:  # (one order otherwise)
        held["cp_inside_tp"] = plan.axis_names.index("cp") > plan.axis_names.index("tp")
    held["bucket_bytes"] = plan.techniques.get("bucket_bytes")
    held["dp_shard"] = plan.techniques.get("dp_shard")
    if config.mixed_precision == "bf16":
        held["mixed_precision"] = "bf16" if plan.techniques.get("mixed_precision") == "bf16-autocast" \
            else plan.techniques.get("mixed_precision")
    dropped = [f"{k}={getattr(config, k)!r} (the plan has {held[k]!r})" for k in held
               if getattr(config, k) is not None and held[k] is not None and held[k] != getattr(config, k)]
    if config.sequence_parallel is False and plan.techniques.get("sequence_parallel"):
        dropped.append("sequence_parallel=False (the plan shards the layer norms on the sequence)")
    if dropped:
        raise PlanError(f"internal: the plan does not hold Config {'; '.join(dropped)}. Please "
                        f"report this with the model; meanwhile plan with the field left None.")


def _blocks(model: nn.Module) -> int:
    return identical_blocks(model)[1] or 1


def _first_line(e: Exception) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def _replace(plan: Plan, **kw: Any) -> Plan:
    """``dataclasses.replace`` keeping what ``plan.explain`` needs."""
    return carry(plan, dataclasses.replace(plan, **kw))


def _plan_by_search(model: nn.Module, mesh: Mesh, example_inputs: Any, config: Config,
                    cost_passes: Sequence[Callable[..., Any]],
                    progress: Callable[[str], None] | None, top_k: int, traced: Any) -> Plan:
    """Search the setups, then realize the best one whose per-operator solve fits; a model
    small enough for whole-model ILPs (:data:`PER_UNIT_FALLBACK_LIMIT`) realizes the best setup
    of each of the :data:`COMPARED_DEGREES` best (dp, tp, pp) and keeps the one the per-operator
    model predicts fastest (the closed form prices data parallelism as splitting the batch; the
    per-operator ILP may do better, e.g. keep a tiny batch replicated)."""
    layers = LayerSolver(model, example_inputs, mesh, config, cost_passes)
    budget = _budget(config, mesh)
    search_config, failed = config, []
    for _ in range(2):
        result = search(model, example_inputs, mesh, search_config, cost_passes, progress, layers)
        if progress:
            progress(f"searched {result.evaluated} setups in {result.timings['total_s']:.1f} s; "
                     f"best {result.best.setup.describe()} {result.best.step_time_s * 1e3:.3f} ms")
        done, excess = _realize_ranked(result, model, mesh, example_inputs, config, cost_passes,
                                       layers, traced, failed, progress)
        if done:
            plan, cost, elapsed = min(done, key=lambda d: d[0].predicted["step_time_s"])
            return _record_search(plan, cost, result, failed, top_k, elapsed)
        if excess <= 1.0 or search_config is not config:
            break
        # a per-operator peak was over the budget by ``excess``: search again for
        # setups that fit a budget that much smaller in the search's memory model (more
        # recomputation or sharding), realized against the real budget
        search_config = dataclasses.replace(config, memory_bytes=budget / excess)
        if progress:
            progress(f"searching again within {format_bytes(budget / excess)} (a per-operator "
                     f"peak was {excess:.3f}x the budget)")
    raise InfeasibleMemoryError(
        f"the {len(failed)} best setups of the search fit the search's memory model but none "
        f"could be placed per operator:\n  " + "\n  ".join(failed)
        + "\nRaise Config.memory_bytes, use more devices or a smaller batch.",
        required_bytes=0.0, budget_bytes=budget)


def _realize_ranked(result: SearchResult, model: nn.Module, mesh: Mesh, example_inputs: Any,
                    config: Config, cost_passes: Sequence[Callable[..., Any]],
                    layers: LayerSolver, traced: Any, failed: list[str],
                    progress: Callable[[str], None] | None) -> tuple[list, float]:
    """Per-operator plans of the search's best setups (see :func:`_plan_by_search`): the
    ``(plan, cost, seconds)`` realized, and the most a failed one's peak exceeded the budget
    (``excess``, 1.0 if none did); failures are appended to ``failed``."""
    small = _blocks(model) * mesh.size <= PER_UNIT_FALLBACK_LIMIT
    whole = [traced]
    done: list[tuple[Plan, StepCost, float]] = []
    degrees: set[tuple[int, ...]] = set()
    budget = _budget(config, mesh)
    excess = 1.0  # the most the per-operator memory exceeded the search's, in failed setups
    before = len(failed)
    for cost in result.ranked:
        st = cost.setup
        if len(failed) - before + len(done) >= REALIZE_TRIES or (done and not small) \
                or len(degrees) >= COMPARED_DEGREES:
            break
        if (st.dp, st.tp, st.pp, st.cp, st.ep, st.ep_in_cp, layer_key(st)[-1]) in degrees or \
                max(cost.rank_memory_bytes) * excess > budget:
            continue
        t0 = time.perf_counter()
        try:
            plan = _realize(cost, model, mesh, example_inputs, config, cost_passes, layers, whole,
                            progress)
        except PlanError as e:  # InfeasibleMemoryError included
            if isinstance(e, InfeasibleMemoryError) and e.budget_bytes > 0:
                # the search's memory model is coarser than the per-operator one: skip the
                # setups that would miss the budget by as much
                excess = max(excess, e.required_bytes / e.budget_bytes)
            failed.append(f"{st.describe()}: {_first_line(e)}")
            if progress:
                progress(f"setup {st.describe()} cannot be placed per operator: {_first_line(e)}")
            continue
        degrees.add((st.dp, st.tp, st.pp, st.cp, st.ep, st.ep_in_cp, layer_key(st)[-1]))  # (+ order)
        elapsed = time.perf_counter() - t0
        if progress:
            progress(f"per-operator placements of {st.describe()} solved in {elapsed:.1f} s: "
                     f"predicted {plan.predicted['step_time_s'] * 1e3:.3f} ms")
        done.append((plan, cost, elapsed))
    return done, excess


def _budget(config: Config, mesh: Mesh) -> float:
    return config.memory_bytes if config.memory_bytes is not None else mesh.topology.memory_bytes


def _concrete(config: Config, cost: StepCost) -> Config:
    """``config`` with the setup's techniques fixed (what the per-operator solve runs with)."""
    st = cost.setup
    return dataclasses.replace(config, recompute=st.recompute, zero=st.zero, cp=st.cp,
                               dp_shard=st.dp_shard or config.dp_shard,
                               ep_in_cp=config.ep_in_cp if st.cp > 1 else None,
                               cp_inside_tp=_order(config, st),
                               sequence_parallel=st.sequence_parallel if st.tp > 1
                               else config.sequence_parallel)


def _order(config: Config, st: Setup) -> bool | None:
    """The setup's order of cp and tp where it has both (the Config's otherwise: moot)."""
    return st.cp_inside_tp if st.cp > 1 and st.tp > 1 else config.cp_inside_tp


def _realize(cost: StepCost, model: nn.Module, mesh: Mesh, example_inputs: Any, config: Config,
             cost_passes: Sequence[Callable[..., Any]], layers: LayerSolver, whole: list,
             progress: Callable[[str], None] | None = None) -> Plan:
    """The runnable plan of one searched setup: its per-operator placements solved
    (``progress``: told as a pipeline's stages are traced and placed)."""
    st = cost.setup
    concrete = _concrete(config, cost)
    budget = _budget(config, mesh)
    # (a dp_shard equal to dp is the setup's 0: ZeRO over all of dp, which ep may cut)
    pinned = dataclasses.replace(config, dp=st.dp, tp=st.tp, pp=None, cp=st.cp, ep=st.ep,
                                 dp_shard=st.dp_shard or (None if st.ep > 1 else config.dp_shard),
                                 cp_inside_tp=_order(config, st),
                                 ep_in_cp=st.ep_in_cp if st.ep > 1 else None)
    if st.pp == 1:
        if whole[0] is None:
            whole[0] = capture(model, example_inputs, config.mixed_precision)
        traced = whole[0]
        cand = mesh_candidates(mesh.size, pinned, layers.num_experts)[0]
        plan = solve_candidate(traced, mesh, concrete, cand, cost_passes, budget)
        flops, dtype = traced_flops(traced, concrete)
        step = plan.predicted["step_time_s"] + plan.predicted["optimizer_s"]
        return _replace(plan, predicted={
            **plan.predicted, "model_flops": flops,
            "mfu": mfu(flops, step, mesh.size, mesh.topology, dtype)})
    cand = mesh_candidates(mesh.size // st.pp, pinned, layers.num_experts)[0]
    stage_of_block = [j for j, n in enumerate(cost.blocks_per_stage) for _ in range(n)]
    stage_of_unit = (0, *[0] * layers.lead, *stage_of_block, st.pp * st.virtual_stages - 1)
    setup = PipelineSetup(st.pp, cand, st.microbatches, st.schedule, st.virtual_stages,
                          stage_of_unit, cost.step_time_s, max(cost.rank_memory_bytes),
                          tuple(cost.stage_memory_bytes), tuple(cost.rank_memory_bytes))
    args, kwargs = normalize_inputs(example_inputs)
    shapes = tuple(tuple(x.shape) for x in tree_flatten((args, kwargs))[0]
                   if isinstance(x, torch.Tensor))
    lc = layers.costs(*layer_key(st))
    facts = ModelFacts("", shapes, model_flops(layers, st.microbatch_size) * st.microbatches * st.dp,
                       "fp32" if lc.param_itemsize >= 4 and config.mixed_precision != "bf16"
                       else "bf16", layers.trace_s)
    return build_pipeline_plan(model, example_inputs, facts, mesh, concrete, setup, cost_passes,
                               budget, progress)


def _logical_mesh(cost: StepCost) -> dict[str, tuple]:
    """The logical mesh a setup runs on (``mesh_shape``, ``axis_names``), as its plan has it:
    ``pp`` outermost when pipelined, then the data axes, ``cp`` and ``tp`` (``tp`` and ``cp``
    with ``cp_inside_tp``) where larger than 1 (a lone ``tp`` of one device when all are 1)."""
    st = cost.setup
    data = [(HSDP_AXES[0], st.dp // st.dp_shard), (HSDP_AXES[1], st.dp_shard)] if st.dp_shard \
        else [("dp", st.dp)] if st.ep_in_cp else [("dp", st.dp // st.ep), ("ep", st.ep)]
    axes = [(n, d) for n, d in data if d > 1] + inner_axes(st.cp, st.tp, st.cp_inside_tp) \
        or [("tp", 1)]
    if st.pp > 1:
        axes.insert(0, ("pp", st.pp))
    return {"mesh_shape": tuple(d for _, d in axes), "axis_names": tuple(n for n, _ in axes)}


def _record_search(plan: Plan, cost: StepCost, result: SearchResult, failed: list[str],
                   top_k: int, realize_s: float) -> Plan:
    """The realized plan with what the search found: the setup and its prediction, the next
    ``top_k`` setups as alternatives, the search's counts and timings."""
    st = cost.setup
    alts = tuple({"setup": c.setup.describe(),
                  "degrees": {"dp": c.setup.dp, "tp": c.setup.tp, "pp": c.setup.pp, "cp": c.setup.cp,
                              "ep": c.setup.ep},
                  **_logical_mesh(c), "step_time_s": float(c.step_time_s),
                  "peak_memory_bytes": float(max(c.rank_memory_bytes))}
                 for c in result.ranked if c is not cost)[:top_k]
    warnings = list(plan.warnings)
    if failed:
        warnings.append(f"{len(failed)} better-ranked setup(s) could not be placed per operator "
                        f"and were skipped: " + "; ".join(failed))
    if sequences_beside_cp(st):
        warnings.append(
            f"dp={st.dp} x cp={st.cp} with {st.microbatch_size} sequences a dp rank: the "
            f"linear layers (batch and sequence flattened) run on the whole sequence on each cp "
            f"rank, and the search priced them split; a batch of one sequence per dp rank "
            f"(batch = dp x microbatches) splits them (autopar.strategies.nested_views)")
    # recompute, zero and sequence_parallel as the placements apply them (plan.techniques), not
    # as the setup asked: a setting the model gives nothing to is recorded off, with a warning
    techniques = {**plan.techniques, "microbatch_size": st.microbatch_size * st.dp,
                  "replica_microbatch_size": st.microbatch_size, "microbatches": st.microbatches}
    solver = {**plan.solver, "path": "setup search + per-operator ILPs",
              "setup": st.describe(), "setups_evaluated": result.evaluated,
              "setups_pruned_memory": len(result.pruned) + result.over_memory,
              "layer_solves": result.layer_solves,
              "search_s": result.timings["total_s"], "placement_s": realize_s,
              "pruned_examples": pruned_examples(result)}
    predicted = {**plan.predicted, "search_step_time_s": float(cost.step_time_s),
                 "search_peak_memory_bytes": float(max(cost.rank_memory_bytes))}
    return _replace(plan, alternatives=alts, warnings=tuple(warnings), techniques=techniques,
                    solver=solver, predicted=predicted)
