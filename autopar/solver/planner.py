"""The planner: search (dp, tp) over the mesh, solve the intra-op ILP for each, build the Plan."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from torch.distributed.tensor import Replicate, Shard

from autopar.config import Config
from autopar.cost_models.compute import graph_flops, mfu
from autopar.cost_models.overlap import overlapped_step_time
from autopar.cost_models.passes import run_cost_passes
from autopar.cost_models.sharding import SpaceCosts, price_space
from autopar.cost_models.training_step import optimizer_step_time
from autopar.errors import PlanError
from autopar.graph import TracedGraph
from autopar.mesh import Mesh, planning_device_mesh
from autopar.placements import to_str
from autopar.plan import NodePlan, Plan
from autopar.solver.buckets import gradient_buckets, reduce_at_outputs
from autopar.solver.collectives import step_collectives
from autopar.solver.ilp import InfeasibleMemoryError, format_bytes
from autopar.solver.intra_op import IntraOpResult, ilp_groups, solve_intra_op
from autopar.solver.records import (
    _NORMS, _applied, _describe_nodes, _local_elements, _phase, _precision,
)
from autopar.explain import ExplainContext, attach, context_of
from autopar.passes.recompute import recompute_nodes
from autopar.strategies.space import StrategySpace, boundary_placements, build_space

__all__ = ["make_plan", "memory_techniques", "mesh_candidates", "solve_candidate", "solve_space",
           "traced_flops"]


@dataclass(frozen=True)
class _Candidate:
    shape: tuple[int, ...]
    names: tuple[str, ...]
    dp_axes: tuple[int, ...]


def mesh_candidates(world: int, config: Config) -> list[_Candidate]:
    """Logical meshes to try: (dp, tp) factorisations of ``world`` allowed by the config
    (``world`` is the devices of one pipeline stage)."""
    out = []
    for tp in range(1, world + 1):
        if world % tp:
            continue
        dp = world // tp
        if (config.tp is not None and config.tp != tp) or (config.dp is not None and config.dp != dp):
            continue
        if dp > 1 and tp > 1:
            out.append(_Candidate((dp, tp), ("dp", "tp"), (0,)))
        elif tp > 1 or world == 1:
            out.append(_Candidate((tp,), ("tp",), ()))
        else:
            out.append(_Candidate((dp,), ("dp",), (0,)))
    if not out:
        raise PlanError(
            f"no (dp, tp) with dp * tp = {world} devices matches Config(dp={config.dp}, "
            f"tp={config.tp}); choose degrees whose product is the mesh size, or leave them None.")
    return out


def make_plan(traced: TracedGraph, mesh: Mesh, config: Config,
              cost_passes: Sequence[Callable[..., SpaceCosts]] = (),
              progress: Callable[[str], None] | None = None,
              model: Any = None, example_inputs: Any = None) -> Plan:
    """Solve every candidate logical mesh and return the plan with the lowest predicted time.

    With ``model`` and ``example_inputs`` given, pipelined plans (``pp > 1``) are searched too
    (see :mod:`autopar.solver.pipeline_planner`). ``Config.recompute`` and ``Config.zero`` left
    ``None`` are chosen by memory: the plan uses neither unless nothing fits the budget without
    them; then the cheapest that fits, in the order of :func:`memory_techniques`. A pipeline
    (when the config leaves ``pp`` free) comes after them, without them (set them explicitly
    for a pipelined plan that recomputes or shards the optimizer).
    """
    if config.mixed_precision == "bf16" and config.pp not in (None, 1):
        raise PlanError(f"Config(mixed_precision='bf16', pp={config.pp}): pipeline stages do "
                        f"not run under autocast yet; use pp=1 (or None), or build the model "
                        f"in bf16 and leave mixed_precision None.")
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


def memory_techniques(config: Config) -> list[Config]:
    """The concrete (recompute, zero) settings ``config`` allows, cheapest first: ZeRO-1 costs
    no extra communication (a reduce-scatter and an all-gather move what one all-reduce does,
    Rajbhandari et al., SC'20, sec. 7.2.1), recomputation costs forward compute."""
    recompute = [config.recompute] if config.recompute is not None else ["none", "selective", "full"]
    zero = [config.zero] if config.zero is not None else [0, 1]
    return [dataclasses.replace(config, recompute=r, zero=z) for r in recompute for z in zero]


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
    cands = mesh_candidates(mesh.size, config) if config.pp in (None, 1) and flat else []
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
        raise PlanError("no mesh candidate can place the model:\n" + "\n".join(unplaceable))
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
        best = _replace(best, predicted={**best.predicted, **_utilization(
            traced, config, mesh, best.predicted["step_time_s"] + best.predicted["optimizer_s"],
            mesh.size)})
    alts = tuple({"degrees": p.degrees, "mesh_shape": p.mesh_shape, "axis_names": p.axis_names,
                  "step_time_s": p.predicted["step_time_s"]} for p in results[1:])
    return _replace(best, alternatives=alts)


def _search_pipelines(config: Config, mesh: Mesh, flat_plans: list[Plan], fallback: bool = True) -> bool:
    """Whether to search pipelined plans: when asked (``Config.pp > 1``), when no plan without
    a pipeline fits, or when the mesh spans nodes (where Megatron-LM puts pipeline stages, to
    keep tensor parallelism on the fast links inside a node). On one node with a plan that fits,
    tensor and data parallelism over the node's links beat a pipeline bubble and the search
    (a trace per microbatch size) is skipped."""
    if mesh.size == 1 or config.pp == 1:
        return False
    if config.mixed_precision == "bf16":  # refused with pp > 1 by make_plan
        return False
    return config.pp is not None or (fallback and not flat_plans) or mesh.nodes > 1


def _describe(cand: _Candidate | None) -> str:
    """``mesh dp=2 x tp=2`` for a flat candidate; a pipelined setup says its own."""
    if cand is None:
        return "a pipeline"
    return "mesh " + " x ".join(f"{n}={s}" for n, s in zip(cand.names, cand.shape))


def _add_pipeline(traced: TracedGraph, mesh: Mesh, config: Config, cost_passes: Sequence,
                  progress: Callable[[str], None] | None, model: Any, example_inputs: Any,
                  budget: float | None, results: list, infeasible: list, unplaceable: list) -> None:
    """Search pipelined setups; plan the best one's stages and add it to ``results``."""
    from autopar.solver.pipeline_planner import ModelFacts, build_pipeline_plan, search_pipeline

    setups, errors, failures = search_pipeline(model, example_inputs, mesh, config, cost_passes,
                                               budget, progress)
    infeasible.extend((None, e) for e in errors)
    unplaceable.extend(failures)
    for setup in setups[:1]:
        try:
            plan = build_pipeline_plan(model, example_inputs, ModelFacts.of_traced(traced, config),
                                       mesh, config, setup, cost_passes, budget)
        except InfeasibleMemoryError as e:
            infeasible.append((None, e))
            continue
        if progress:
            progress(f"pipeline pp={setup.pp} {setup.schedule} v={setup.virtual_stages} "
                     f"m={setup.microbatches}: predicted {plan.predicted['step_time_s'] * 1e3:.3f} ms")
        results.append(plan)


def solve_space(traced: TracedGraph, mesh: Mesh, config: Config, cand: _Candidate,
                cost_passes: Sequence[Callable[..., SpaceCosts]], budget: float | None,
                fixed: dict[str, tuple[str, ...]] | None = None, activation_scale: int = 1,
                sequence_parallel: bool | None = None, base_space: StrategySpace | None = None
                ) -> tuple[StrategySpace, SpaceCosts, IntraOpResult]:
    """Strategy space, its prices and the intra-operator ILP's choice on the logical mesh.

    ``fixed`` pins parameters (by name) to a placement, e.g. a tied weight already placed by an
    earlier pipeline stage. ``activation_scale`` multiplies the memory of saved activations: a
    pipeline stage holds that many microbatches in flight. ``sequence_parallel`` True makes
    every layer norm take its input sharded on the sequence dim (dim 1) over the ``tp`` axis
    (Korthikanti et al., MLSys'23, sec. 4.2.2), False makes it take it replicated there; None
    leaves the choice to the ILP. ``base_space``: the unpinned space of this graph and mesh,
    built earlier (it is copied, not changed). With ``config.zero`` the parameters take
    :func:`zero_placement` on the dp axes; with sequence parallelism on, the forward's residual
    adds are pinned to ``Shard(1)`` too (:func:`_pin_norms`); recomputation
    (``config.recompute``) is priced by :func:`~autopar.cost_models.sharding.price_space`.
    """
    if base_space is None:
        base_space = unpinned_space(traced, cand, config)
    space = dataclasses.replace(base_space, nodes=dict(base_space.nodes))
    if config.zero and cand.dp_axes:
        _shard_states(traced, space, cand)
    for p in traced.params:
        if fixed and p.name in fixed:
            _pin(space, p.node, p.name, fixed[p.name])
    if sequence_parallel is None:
        sequence_parallel = config.sequence_parallel
    if sequence_parallel is not None and "tp" in cand.names:
        _pin_norms(traced, space, cand.names.index("tp"), sequence_parallel)
    recompute = recompute_nodes(traced, config.recompute or "none")
    costs = run_cost_passes(price_space(traced, space, mesh.topology, config.optimizer, recompute),
                            space, mesh.topology, cost_passes)
    if activation_scale != 1:
        params = {p.node for p in traced.params}
        costs = dataclasses.replace(costs, memory={
            n: m if n in params else m * activation_scale for n, m in costs.memory.items()})
    costs = _with_recompute_peak(traced, costs)
    return space, costs, solve_intra_op(traced, space, costs, budget, config.solver_time_limit_s)


def unpinned_space(traced: TracedGraph, cand: _Candidate, config: Config) -> StrategySpace:
    """Every node's strategies on the logical mesh ``cand``, before any pinning."""
    with planning_device_mesh(cand.shape, cand.names) as dm:
        return build_space(traced, dm, cand.names, cand.dp_axes, config.unknown_op)


def _pin(space: StrategySpace, node: str, name: str, placement: tuple[str, ...]) -> None:
    ns = space.nodes[node]
    keep = tuple(s for s in ns.strategies if tuple(to_str(p) for p in s.outputs[0]) == tuple(placement))
    if not keep:
        raise PlanError(f"parameter {name!r} cannot take the placement {placement} that another "
                        f"pipeline stage gave it (it shares the tensor); choose other degrees.")
    space.nodes[node] = dataclasses.replace(ns, strategies=keep)


def zero_placement(placements: tuple, shape: Sequence[int], mesh_shape: Sequence[int],
                   dp_axes: Sequence[int]) -> tuple:
    """A parameter's placement under ZeRO: on each data-parallel axis, ``Shard`` of the largest
    dim no other axis shards and whose shard divides evenly; ``Replicate`` stays where no dim
    qualifies (the parameter is then not sharded over that axis).

    A parameter stored this way is all-gathered where it is used and its gradient is
    reduce-scattered, as FSDP2 shards ``DTensor`` parameters; the optimizer, built on the
    parameters, then keeps its states sharded (ZeRO-1, Rajbhandari et al., SC'20, sec. 5.1).
    """
    out = list(placements)
    for axis in dp_axes:
        if not isinstance(out[axis], Replicate):
            continue
        taken = {p.dim for p in out if hasattr(p, "dim")}
        local = list(shape)
        for a, p in enumerate(out):
            if hasattr(p, "dim"):
                local[p.dim] //= mesh_shape[a]
        dims = [d for d in range(len(shape)) if d not in taken and local[d] % mesh_shape[axis] == 0
                and local[d] >= mesh_shape[axis]]
        if dims:
            out[axis] = Shard(max(dims, key=lambda d: (local[d], -d)))
    return tuple(out)


def _shard_states(traced: TracedGraph, space: StrategySpace, cand: _Candidate) -> None:
    """Give every parameter its :func:`zero_placement` on the dp axes (ZeRO-1)."""
    for p in traced.params:
        ns = space.nodes[p.node]
        shape = tuple(traced.node(p.node).meta["val"].shape)
        strategies = tuple(dataclasses.replace(s, outputs=(zero_placement(
            s.outputs[0], shape, cand.shape, cand.dp_axes),)) for s in ns.strategies)
        space.nodes[p.node] = dataclasses.replace(ns, strategies=tuple(dict.fromkeys(strategies)))




def _pin_norms(traced: TracedGraph, space: StrategySpace, axis: int, sharded: bool) -> None:
    """Keep the layer-norm strategies whose input on ``axis`` is ``Shard(1)`` (``sharded``) or
    ``Replicate`` (not ``sharded``). Sharded, the forward's residual adds (the adds of the
    shape a layer norm reads) are kept on ``Shard(1)`` too, as in Megatron-LM's sequence
    parallelism, where the whole region between a row-parallel output and the next
    column-parallel input is sequence-sharded: the row-parallel partial sum is reduce-scattered
    into it and all-gathered out of it (Korthikanti et al., MLSys'23, sec. 4.2.2, Fig. 5)."""
    want = Shard(1) if sharded else Replicate()
    norm_shapes = set()
    for n in traced.gm.graph.nodes:
        name = getattr(n.target, "__name__", "").split(".")[0]
        if n.op != "call_function" or name not in _NORMS or n.name not in space.nodes:
            continue
        norm_shapes.add(tuple(n.args[0].meta["val"].shape))
        _keep(space, n.name, lambda s: s.inputs and s.inputs[0][axis] == want,
              f"layer norm {n.name} has no strategy with its input {want} on the tp axis; use "
              f"sequence_parallel={not sharded} or None for this model.")
    if not sharded:
        return
    for n in traced.gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "__name__", "") == "add.Tensor" and \
                n.meta.get("partitioner_tag") != "is_backward" and n.name in space.nodes and \
                tuple(n.meta["val"].shape) in norm_shapes and len(n.all_input_nodes) == 2:
            _keep(space, n.name, lambda s: s.outputs[0] is not None and s.outputs[0][axis] == want,
                  f"residual add {n.name} has no strategy with its output Shard(1) on the tp "
                  f"axis, which sequence parallelism requires; use sequence_parallel=None or "
                  f"False for this model.")


def _keep(space: StrategySpace, node: str, pred: Callable[[Any], bool], error: str) -> None:
    """Keep the strategies of ``node`` that satisfy ``pred``; none left raises ``error``."""
    ns = space.nodes[node]
    keep = tuple(s for s in ns.strategies if pred(s))
    if not keep:
        raise PlanError(error)
    space.nodes[node] = dataclasses.replace(ns, strategies=keep)


def solve_candidate(traced: TracedGraph, mesh: Mesh, config: Config, cand: _Candidate,
                    cost_passes: Sequence[Callable[..., SpaceCosts]], budget: float | None,
                    stage: int | None = None, fixed: dict[str, tuple[str, ...]] | None = None,
                    activation_scale: int = 1) -> Plan:
    """Solve the intra-operator ILP of ``traced`` on the logical mesh ``cand``.

    Raises :class:`PlanError` when the graph cannot be placed on it and
    :class:`InfeasibleMemoryError` when nothing fits ``budget``. ``stage`` tags the collectives
    of a pipeline stage.
    """
    space, costs, res = solve_space(traced, mesh, config, cand, cost_passes, budget, fixed,
                                    activation_scale)
    grads = {p.grad_output_index for p in traced.params if p.grad_output_index is not None}
    res = dataclasses.replace(res, choice=reduce_at_outputs(traced.gm, space, res.choice, grads))
    plan = _build_plan(traced, mesh, config, cand, space, costs, res)
    attach(plan, ExplainContext(traced, space, costs, res.choice, budget,
                                ilp_groups(traced, space)[0]))
    if stage is not None:
        plan = _replace(plan, collectives=tuple(dataclasses.replace(c, stage=stage)
                                                for c in plan.collectives))
    return plan


def _replace(plan: Plan, **kw: Any) -> Plan:
    """``dataclasses.replace`` that keeps what ``plan.explain`` needs."""
    return attach(dataclasses.replace(plan, **kw), context_of(plan))


def _axis_roles(traced: TracedGraph, space: StrategySpace, res: IntraOpResult,
                cand: _Candidate) -> tuple[dict[str, int], list[str]]:
    """Degrees from what the solver chose: a data-parallel axis of the candidate (parameters
    replicated on it, or ZeRO-sharded) or an axis on which every parameter is replicated is data
    parallel (the batch is split, or nothing is); any other axis is tensor parallel. Also warns
    about axes on which nothing at all is split."""
    dp, tp, notes = 1, 1, []
    for axis, size in enumerate(cand.shape):
        params_rep = axis in cand.dp_axes or all(
            isinstance(space.nodes[p.node].strategies[res.choice[p.node]].outputs[0][axis], Replicate)
            for p in traced.params)
        used = any(
            out is not None and not isinstance(out[axis], Replicate)
            for name, i in res.choice.items() for out in space.nodes[name].strategies[i].outputs)
        if params_rep:
            dp *= size
        else:
            tp *= size
        if not used:
            notes.append(f"mesh axis {cand.names[axis]!r} ({size} devices) splits nothing: every "
                         f"device on it repeats the same work (the model is too small to gain)")
    return {"dp": dp, "tp": tp, "pp": 1}, notes


def _build_plan(traced: TracedGraph, mesh: Mesh, config: Config, cand: _Candidate,
                space: StrategySpace, costs: SpaceCosts, res: IntraOpResult) -> Plan:
    chosen = {name: space.nodes[name].strategies[i] for name, i in res.choice.items()}
    txt = lambda pl: tuple(to_str(p) for p in pl) if pl is not None else None  # noqa: E731
    nodes = {name: NodePlan(tuple(txt(o) for o in s.outputs), tuple(txt(i) for i in s.inputs))
             for name, s in chosen.items()}
    for n in traced.gm.graph.nodes:  # getitem aliases read their producer's placement
        if n.name in space.alias:
            src, idx = space.alias[n.name]
            nodes[n.name] = NodePlan((nodes[src].outputs[idx],), ())
    out_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    rep = tuple("R" for _ in cand.shape)
    edge = txt(boundary_placements(len(cand.shape), cand.dp_axes))
    boundary = set(traced.boundary_outputs) | set(traced.boundary_grad_outputs)
    outputs: list[tuple[str, ...] | None] = []
    param_of_grad = {p.grad_output_index: p for p in traced.params}
    for i, a in enumerate(out_node.args[0]):
        if a is None:
            outputs.append(None)
        elif i == traced.loss_output_index:
            outputs.append(rep)
        elif i in boundary:
            outputs.append(edge)
        else:
            outputs.append(nodes[param_of_grad[i].node].outputs[0])
    node_compute = {n: float(costs.compute[n][i]) for n, i in res.choice.items()}
    step_s, cap, buckets, comm = _communication(traced, cand, mesh, config, nodes, outputs,
                                                set(param_of_grad), node_compute)
    collectives, comm_s, comm_fwd = comm.collectives, comm.total_s, comm.forward_s
    nodes = _describe_nodes(traced, nodes, node_compute, comm.per_node)
    compute_s = float(sum(node_compute.values()))
    memory = float(sum(costs.memory[n][i] for n, i in res.choice.items()))
    params = {p.node for p in traced.params}
    state = float(sum(costs.memory[n][i] for n, i in res.choice.items() if n in params))
    graph_nodes = {n.name: n for n in traced.gm.graph.nodes}
    compute_fwd = float(sum(costs.compute[n][i] for n, i in res.choice.items()
                            if _phase(graph_nodes[n]) == "forward"))
    sol = res.solution
    degrees, notes = _axis_roles(traced, space, res, cand)
    techniques, applied_notes = _applied(traced, config, cand, nodes)
    techniques["bucket_bytes"] = cap
    warnings = list(space.warnings) + notes + applied_notes
    if sol.status != "optimal":
        warnings.append(f"ILP stopped at the time limit ({config.solver_time_limit_s} s) with "
                        f"gap {sol.gap:.3g}; raise Config.solver_time_limit_s for a better plan")
    return Plan(
        model_fingerprint=traced.fingerprint(), mesh_shape=cand.shape, axis_names=cand.names,
        degrees=degrees,
        params={p.name: nodes[p.node].outputs[0] for p in traced.params},
        inputs=tuple(nodes[i.node].outputs[0] for i in traced.inputs),
        output_placements=tuple(outputs), nodes=nodes, collectives=tuple(collectives),
        grad_buckets=buckets,
        predicted={"step_time_s": step_s, "compute_s": compute_s, "comm_s": comm_s,
                   "forward_s": compute_fwd + comm_fwd, "state_bytes": state,
                   "peak_memory_bytes": memory, "ilp_objective_s": sol.objective,
                   "optimizer_s": optimizer_step_time(_local_elements(traced, nodes, cand),
                                                      config.optimizer, mesh.topology)},
        solver={"status": sol.status, "gap": sol.gap, "backend": sol.backend,
                "solve_time_s": sol.solve_time_s, "ilp_variables": sol.num_variables,
                "ilp_variables_unlinked": res.variables_unlinked, "ilp_groups": res.groups,
                "capture_time_s": traced.capture_time_s},
        warnings=tuple(warnings), topology=mesh.topology.name, config=config.to_dict(),
        input_shapes=tuple(i.shape for i in traced.inputs),
        techniques=techniques,
    )


BUCKET_CAPS = (25 * 2**20, 4 * 2**20, 2**20)  # tried when Config.bucket_bytes is None


def _communication(traced: TracedGraph, cand: _Candidate, mesh: Mesh, config: Config,
                   nodes: dict[str, NodePlan], outputs: list, grads: set[int],
                   node_compute: dict[str, float]) -> tuple[float, int, tuple, Any]:
    """The step's collectives and its time as the lowered program runs it (collectives
    overlapping the compute between their issue and their first use: autopar.passes.overlap,
    cost_models.overlap), for the gradient bucket cap of the config or, left to the planner,
    the cap of :data:`BUCKET_CAPS` with the shortest step (the largest on a tie: fewer
    collectives). Returns ``(step seconds, cap, buckets, StepCollectives)``."""
    order = [n.name for n in traced.gm.graph.nodes]
    placements = {k: v.outputs[0] for k, v in nodes.items()}
    caps = BUCKET_CAPS if config.bucket_bytes is None else (config.bucket_bytes,)
    best: tuple | None = None
    seen: set[tuple] = set()
    for cap in caps:
        buckets = gradient_buckets(traced.gm, placements, outputs, grads, cand.shape, cap)
        if buckets in seen:
            continue
        seen.add(buckets)
        comm = step_collectives(traced, cand.shape, cand.names, nodes, outputs, mesh, buckets)
        step = overlapped_step_time(order, node_compute, comm.comms)
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, cap, buckets, comm)
    return best


def traced_flops(traced: TracedGraph, config: Config) -> tuple[float, str]:
    """The model's FLOPs per step of a whole trace (forward and backward, no recomputation) and
    the dtype whose peak its matmuls run at (``"bf16"`` or ``"fp32"``, for MFU)."""
    dtype = "bf16" if _precision(traced, config) in ("bf16-autocast", "bfloat16", "float16") else "fp32"
    return graph_flops(traced.gm), dtype


def _utilization(traced: TracedGraph, config: Config, mesh: Mesh, step_s: float,
                 devices: int) -> dict[str, float]:
    """The model's FLOPs per step and the predicted MFU at the peak of the dtype the matmuls
    run in, over ``step_s`` (the training step with its optimizer update)."""
    flops, dtype = traced_flops(traced, config)
    return {"model_flops": flops, "mfu": mfu(flops, step_s, devices, mesh.topology, dtype)}


def _with_recompute_peak(traced: TracedGraph, costs: SpaceCosts) -> SpaceCosts:
    """Add to the memory the values recomputed values occupy at once: those of one block,
    rematerialized while that block's backward runs (Chen et al. 2016, arXiv:1604.06174,
    sec. 4). Each recomputed node carries its bytes divided by the number of blocks, so the ILP
    sees one block's worth (exact when the blocks are identical, as the ILP links them; their
    mean otherwise)."""
    if not costs.recomputed:
        return costs
    blocks = len({traced.node_layer.get(n, "") for n in costs.recomputed})
    memory = dict(costs.memory)
    for name, arr in costs.recomputed.items():
        memory[name] = memory[name] + arr / blocks
    return dataclasses.replace(costs, memory=memory)
