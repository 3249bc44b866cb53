"""Plan assembly for one solved setup: degrees from the chosen axes, per-node records, the
step's collectives and gradient buckets, the predicted step, FLOPs and MFU."""

from __future__ import annotations

import math
from typing import Any

from torch.distributed.tensor import Replicate

from autopar.config import Config
from autopar.capture.remat import recompute_nodes, zero_gathers
from autopar.cost_models.compute import graph_flops, mfu
from autopar.cost_models.liveness import StageRun, step_memory
from autopar.cost_models.overlap import overlapped_step_time
from autopar.cost_models.sharding import SpaceCosts, deferred_placement
from autopar.cost_models.training_step import optimizer_step_time
from autopar.graph import TracedGraph
from autopar.mesh import Mesh
from autopar.placements import from_str, to_str
from autopar.plan import NodePlan, Plan
from autopar.planning.buckets import gradient_buckets
from autopar.planning.collectives import step_collectives
from autopar.solver.intra_op import IntraOpResult
from autopar.planning.records import (
    applied_techniques, describe_nodes, local_elements, precision,
)
from autopar.strategies.space import StrategySpace, boundary_placements

from autopar.capture.layers import node_phase
__all__ = ['BUCKET_CAPS', 'build_plan', 'deferred_gradient', 'traced_flops', 'utilization']


from autopar.planning.candidates import Candidate


def _axis_roles(traced: TracedGraph, space: StrategySpace, res: IntraOpResult,
                cand: Candidate) -> tuple[dict[str, int], list[str]]:
    """Degrees from what the solver chose: a data-parallel axis of the candidate (parameters
    replicated on it, or ZeRO-sharded) or an axis on which every parameter is replicated is data
    parallel (the batch is split); any other axis is tensor parallel. An axis on which nothing at
    all is split keeps its name's role, and is warned about."""
    dp, tp, cp, notes = 1, 1, 1, []
    inputs = {i.node for i in traced.inputs}
    for axis, size in enumerate(cand.shape):
        if axis in cand.cp_axes:  # (the inputs' sequence is split on it: context parallel)
            cp *= size
            continue
        params_rep = axis in cand.dp_axes or all(
            isinstance(space.nodes[p.node].strategies[res.choice[p.node]].outputs[0][axis], Replicate)
            for p in traced.params)
        # (a user input sharded on the axis splits no work by itself: only ops and parameters)
        used = any(
            out is not None and not isinstance(out[axis], Replicate)
            for name, i in res.choice.items() if name not in inputs
            for out in space.nodes[name].strategies[i].outputs)
        # an axis that splits nothing keeps the role its name gives (a forced tp=2 stays tp=2,
        # with the warning below), not "data parallel" for its replicated parameters
        if params_rep and (used or cand.names[axis] != "tp"):
            dp *= size
        else:
            tp *= size
        if not used:
            notes.append(f"mesh axis {cand.names[axis]!r} ({size} devices) splits nothing: every "
                         f"device on it repeats the same work (the model is too small to gain); "
                         f"{cand.names[axis]}=1 on {math.prod(cand.shape) // size} device(s) "
                         f"would cost the same")
    ep = math.prod(cand.shape[a] for a in cand.ep_axes)  # (data-parallel axes too)
    return {"dp": dp, "tp": tp, "pp": 1, "cp": cp, "ep": ep}, notes


def build_plan(traced: TracedGraph, mesh: Mesh, config: Config, cand: Candidate,
                space: StrategySpace, costs: SpaceCosts, res: IntraOpResult,
                defer_axes: tuple[int, ...] = (), stage: StageRun | None = None) -> Plan:
    """The Plan of one solved intra-operator ILP. ``defer_axes``: mesh axes over which a
    parameter's gradient, where the program computes it as a partial sum and the parameter is
    replicated there, is left unreduced (its output placement keeps ``P(sum)``): a pipeline
    stage's runtime sums such gradients over the step's microbatches and reduces them once
    (:func:`deferred_gradient`). ``stage``: how the program runs when it is a pipeline stage's.
    The predicted peak memory is the liveness walk of the program the plan lowers to
    (:func:`~autopar.cost_models.liveness.step_memory`), not the ILP's sum of saved values."""
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
    boundary = set(traced.boundary_outputs) | set(traced.boundary_grad_outputs)
    outputs: list[tuple[str, ...] | None] = []
    param_of_grad = {p.grad_output_index: p for p in traced.params}
    for i, a in enumerate(out_node.args[0]):
        if a is None:
            outputs.append(None)
        elif i == traced.loss_output_index:
            outputs.append(rep)
        elif i in boundary:
            outputs.append(txt(boundary_placements(tuple(a.meta["val"].shape), cand.shape,
                                                   cand.dp_axes, cand.cp_axes)))
        else:
            outputs.append(deferred_gradient(nodes[param_of_grad[i].node].outputs[0],
                                             nodes[a.name].outputs[0] if a.name in nodes else None,
                                             defer_axes))
    node_compute = {n: float(costs.compute[n][i]) for n, i in res.choice.items()}
    zero_axes = stage.zero_axes if stage is not None else ()
    techniques, applied_notes = applied_techniques(traced, config, cand, nodes, zero_axes)
    # no pipeline: ZeRO's gathers prefetched and bucketed, ZeRO-3's made again for the backward
    # (runtime: api.py); a pipeline stage's program computes with its gathered copy
    # (StageRun.regather)
    prefetch, regather = (zero_gathers(traced, techniques["zero"]) if not zero_axes
                          else (frozenset(), frozenset()))
    recomputed = recompute_nodes(traced, config.recompute or "none")
    step_s, cap, buckets, comm = _communication(traced, cand, mesh, config, nodes, outputs,
                                                set(param_of_grad), node_compute, regather,
                                                recomputed, prefetch)
    collectives, comm_s, comm_fwd = comm.collectives, comm.total_s, comm.forward_s
    held = step_memory(traced, cand.shape, nodes, outputs, buckets, recomputed, config.optimizer,
                       stage, regather, prefetch)
    nodes = describe_nodes(traced, nodes, node_compute, comm.per_node)
    compute_s = float(sum(node_compute.values()))
    params = {p.node for p in traced.params}
    state = float(sum(costs.memory[n][i] for n, i in res.choice.items() if n in params))
    graph_nodes = {n.name: n for n in traced.gm.graph.nodes}
    compute_fwd = float(sum(costs.compute[n][i] for n, i in res.choice.items()
                            if node_phase(graph_nodes[n]) == "forward"))
    sol = res.solution
    degrees, notes = _axis_roles(traced, space, res, cand)
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
                   "peak_memory_bytes": held.peak_bytes, "saved_bytes": held.saved_bytes,
                   "held_bytes": held.held_bytes, "ahead_bytes": held.ahead_bytes,
                   "ilp_objective_s": sol.objective,
                   "optimizer_s": optimizer_step_time(local_elements(traced, nodes, cand, zero_axes),
                                                      config.optimizer, mesh.topology)},
        solver={"status": sol.status, "gap": sol.gap, "backend": sol.backend,
                "solve_time_s": sol.solve_time_s, "ilp_variables": sol.num_variables,
                "ilp_variables_unlinked": res.variables_unlinked, "ilp_groups": res.groups,
                "capture_time_s": traced.capture_time_s},
        warnings=tuple(warnings), topology=mesh.topology.name, config=config.to_dict(),
        input_shapes=tuple(i.shape for i in traced.inputs),
        techniques=techniques,
    )


def deferred_gradient(param: tuple[str, ...], grad: tuple[str, ...] | None,
                      axes: tuple[int, ...]) -> tuple[str, ...]:
    """The output placement (text form) of a parameter's gradient computed as ``grad``:
    :func:`~autopar.cost_models.sharding.deferred_placement` over ``axes`` (none: the
    parameter's own placement)."""
    if grad is None or not axes:
        return param
    return tuple(map(to_str, deferred_placement(tuple(map(from_str, grad)),
                                                tuple(map(from_str, param)), axes)))


BUCKET_CAPS = (25 * 2**20, 4 * 2**20, 2**20)  # tried when Config.bucket_bytes is None


def _communication(traced: TracedGraph, cand: Candidate, mesh: Mesh, config: Config,
                   nodes: dict[str, NodePlan], outputs: list, grads: set[int],
                   node_compute: dict[str, float], regather: frozenset[str] = frozenset(),
                   recompute: frozenset[str] = frozenset(), prefetch: frozenset[str] = frozenset()
                   ) -> tuple[float, int, tuple, Any]:
    """The step's collectives and its time as the lowered program runs it (collectives
    overlapping the compute between their issue and their first use: autopar.passes.overlap,
    cost_models.overlap), for the gradient bucket cap of the config or, left to the planner,
    the cap of :data:`BUCKET_CAPS` with the shortest step (the largest on a tie: fewer
    collectives). ``regather``, ``recompute``, ``prefetch``: as ``step_collectives``. Returns ``(step
    seconds, cap, buckets, StepCollectives)``."""
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
        comm = step_collectives(traced, cand.shape, cand.names, nodes, outputs, mesh, buckets,
                                regather, recompute, prefetch)
        step = overlapped_step_time(order, node_compute, comm.comms)
        if best is None or step < best[0] * (1 - 1e-9):
            best = (step, cap, buckets, comm)
    return best


def traced_flops(traced: TracedGraph, config: Config) -> tuple[float, str]:
    """The model's FLOPs per step of a whole trace (forward and backward, no recomputation) and
    the dtype whose peak its matmuls run at (``"bf16"`` or ``"fp32"``, for MFU)."""
    dtype = "bf16" if precision(traced, config) in ("bf16-autocast", "bfloat16", "float16") else "fp32"
    return graph_flops(traced.gm), dtype


def utilization(traced: TracedGraph, config: Config, mesh: Mesh, step_s: float,
                 devices: int) -> dict[str, float]:
    """The model's FLOPs per step and the predicted MFU at the peak of the dtype the matmuls
    run in, over ``step_s`` (the training step with its optimizer update)."""
    flops, dtype = traced_flops(traced, config)
    return {"model_flops": flops, "mfu": mfu(flops, step_s, devices, mesh.topology, dtype)}
