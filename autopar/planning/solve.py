"""The intra-operator solve of one setup: strategy space, pinning (ZeRO, sequence parallelism,
tied weights), prices, cost passes and the ILP, assembled into a Plan."""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar._torch_private import _StridedShard
from autopar.config import Config
from autopar.cost_models.passes import run_cost_passes
from autopar.cost_models.sharding import (REGATHERED_LAYERS, SpaceCosts, deferred_gradient_matrix, price_space,
                                          zero_placement)
from autopar.errors import PlanError
from autopar.graph import TracedGraph
from autopar.mesh import Mesh, planning_device_mesh
from autopar.placements import to_str
from autopar.plan import Plan
from autopar.planning.buckets import reduce_at_outputs
from autopar.cost_models.liveness import StageRun
from autopar.cost_models.experts import expert_weight_params
from autopar.solver.ilp import InfeasibleMemoryError, format_bytes
from autopar.solver.mip import SolverTimeoutError
from autopar.solver.intra_op import IntraOpResult, ilp_groups, solve_intra_op
from autopar.planning.records import NORMS
from autopar.planning.sequence import cp_layout, graph_sequence_length
from autopar.plan_context import ExplainContext, attach, carry
from autopar.capture.layers import is_backward, is_op
from autopar.capture.remat import recompute_nodes
from autopar.strategies.rules import (
    EXPERT_OPS, SEQ_DIM, SEQUENCE_ATTENTION_QUERY, dispatches_experts, splits_experts,
)
from autopar.strategies.space import Strategy, StrategySpace, build_space, share_equal_strategies

__all__ = ['explain_context', 'gradient_axes', 'regathered_share', 'replace_plan', 'solve_candidate', 'solve_space',
           'unpinned_space']


from autopar.planning.assembly import build_plan
from autopar.planning.candidates import Candidate


def solve_space(traced: TracedGraph, mesh: Mesh, config: Config, cand: Candidate,
                cost_passes: Sequence[Callable[..., SpaceCosts]], budget: float | None,
                fixed: dict[str, tuple[str, ...]] | None = None, activation_scale: int = 1,
                sequence_parallel: bool | None = None, base_space: StrategySpace | None = None,
                gradient_share: float = 1.0, price_memo: dict | None = None
                ) -> tuple[StrategySpace, SpaceCosts, IntraOpResult]:
    """Strategy space, its prices (:func:`priced_space`, same arguments) and the
    intra-operator ILP's choice within ``budget`` on the logical mesh."""
    space, costs = priced_space(traced, mesh, config, cand, cost_passes, fixed, activation_scale,
                                sequence_parallel, base_space, gradient_share,
                                price_memo=price_memo)
    return space, costs, solve_intra_op(traced, space, costs, budget, config.solver_time_limit_s)


def priced_space(traced: TracedGraph, mesh: Mesh, config: Config, cand: Candidate,
                 cost_passes: Sequence[Callable[..., SpaceCosts]],
                 fixed: dict[str, tuple[str, ...]] | None = None, activation_scale: int = 1,
                 sequence_parallel: bool | None = None, base_space: StrategySpace | None = None,
                 gradient_share: float = 1.0, zero_once: bool = False,
                 price_memo: dict | None = None) -> tuple[StrategySpace, SpaceCosts]:
    """Strategy space and its prices on the logical mesh.

    ``fixed`` pins parameters (by name) to a placement, e.g. a tied weight already placed by an
    earlier pipeline stage. ``activation_scale`` multiplies the memory of saved activations: a
    pipeline stage holds that many microbatches in flight (the incoming gradients, consumed at
    once, are not multiplied). ``gradient_share``: the share of the moves of the parameters'
    gradients to their placements that one run of the graph pays (``1/m`` for a pipeline stage
    that reduces its gradients over dp and cp once a step over its ``m`` microbatches, 0 for
    the per-layer costs of the setup search, whose step end prices those reductions; the moves
    over the other axes are paid every run: :func:`gradient_axes`). ``sequence_parallel`` True makes
    every layer norm take its input sharded on the sequence dim (dim 1) over the ``tp`` axis
    (Korthikanti et al., MLSys'23, sec. 4.2.2), False makes it take it replicated there; None
    leaves the choice to the ILP. ``base_space``: the unpinned space of this graph and mesh,
    built earlier (it is copied, not changed). With ``config.zero`` the parameters take
    :func:`zero_placement` on the dp axes, and the program gathers them where they are used;
    ``zero_once`` (a pipeline stage's runtime gathers its ZeRO parameters once a step) leaves
    them placed as the ILP chooses and prices their state as stored by
    :func:`~autopar.cost_models.sharding.zero_once_placement` of that
    (:func:`~autopar.cost_models.sharding.price_space`); with sequence parallelism on, the
    forward's residual adds are pinned to ``Shard(1)`` too (:func:`_pin_norms`); recomputation
    (``config.recompute``) is priced by :func:`~autopar.cost_models.sharding.price_space`,
    which takes ``price_memo`` (prices shared between the spaces of one model's graph).
    """
    if base_space is None:
        base_space = unpinned_space(traced, cand, config)
    space = dataclasses.replace(base_space, nodes=dict(base_space.nodes))
    zero_axes = tuple(cand.zero_axes) if config.zero and zero_once else ()
    for axis in cand.ep_axes:  # (before ZeRO's sharding, which leaves them split there)
        _store_experts_split(traced, space, axis, cand.shape[axis])
    if config.zero and cand.zero_axes and not zero_once:
        _shard_states(traced, space, cand)
    for p in traced.params:
        if fixed and p.name in fixed:
            _pin(space, p.node, p.name, fixed[p.name])
    if sequence_parallel is None:
        sequence_parallel = config.sequence_parallel
    if sequence_parallel is not None and "tp" in cand.names:
        _pin_norms(traced, space, cand.names.index("tp"), sequence_parallel)
    balanced = balanced_axis(traced, config, cand)
    _pin_axes(traced, space, config, cand, balanced)
    _pin_data_axes(traced, mesh, config, cand, space, gradient_share)
    space = share_equal_strategies(space, base_space)  # (identical layers priced once)
    recompute = recompute_nodes(traced, config.recompute or "none")
    share = regathered_share(traced) if config.zero == 3 and not zero_once else 1.0
    costs = run_cost_passes(price_space(traced, space, mesh.topology, config.optimizer, recompute,
                                        zero_axes, share, config.expert_load_skew,
                                        memo=price_memo, balanced_axis=balanced,
                                        ep_axes=cand.ep_axes),
                            space, mesh.topology, cost_passes)
    if activation_scale != 1:
        # parameters are held once; a gradient coming in from the next stage (a tangent) is
        # consumed by its microbatch's backward, so one is held at a time
        once = {p.node for p in traced.params} | set(traced.tangent_nodes)
        costs = dataclasses.replace(costs, memory={
            n: m if n in once else m * activation_scale for n, m in costs.memory.items()})
    if gradient_share != 1.0 and gradient_axes(cand):
        costs = _deferred_gradients(traced, space, costs, mesh, cand, gradient_share)
    return space, _with_recompute_peak(traced, costs)


# a mesh of this many axes of size > 1 or more has its data-parallel axes placed first, alone
# (:func:`_pin_data_axes`): each node's strategies on three axes are about 8 times those on
# two, and the pairs the edges price about 60 times (a one-layer Llama, (dp, cp, tp) = (4, 2, 4)
# against (cp, tp) = (2, 4): 127,809 strategies against 15,770)
PIN_DATA_FROM_AXES = 3


def _pin_data_axes(traced: TracedGraph, mesh: Mesh, config: Config, cand: Candidate,
                   space: StrategySpace, gradient_share: float = 1.0) -> None:
    """On a mesh of :data:`PIN_DATA_FROM_AXES` axes or more, keep of each node's strategies
    those that place it on every data-parallel axis (not an expert-parallel one) as the
    intra-operator ILP of that axis alone places it (typically the batch split, parameters
    replicated and their gradients partial sums: the data parallelism the setup search prices).
    The one-axis ILP prices the gradients' moves as the whole problem does (``gradient_share``:
    a pipeline stage reduces them once a step): priced every run, it split the MoE experts over
    the axis in the backward of DeepSeek-V3's (dp, ep, tp) stage mesh, to all-gather their
    gradients instead of all-reducing them, and the stage then all-gathered each layer's whole
    expert weights over ep for every microbatch.
    A node with no strategy that agrees keeps all of its own (a parameter stored by ZeRO's
    placement among them). Applied last of the pins, so that no later pin can empty a node. The
    one-axis ILP prices the axis as a mesh of its own (intra-node links, the whole graph's
    compute), which can change only the choice of nodes the batch split and the replicated
    parameters leave open; it is not asked the user's cost passes. A one-axis solve that runs
    out of time leaves that axis free, with a warning (the restriction is a speed-up, not a
    requirement). Guarantees: every node keeps at least one strategy."""
    if sum(d > 1 for d in cand.shape) < PIN_DATA_FROM_AXES:
        return
    solved: dict[int, tuple[StrategySpace, dict[str, int] | None]] = {}
    for axis in cand.dp_axes:
        if axis in cand.ep_axes or cand.shape[axis] == 1:
            continue
        size = cand.shape[axis]
        if size not in solved:
            alone = Candidate((size,), ("dp",), (0,))
            plain = dataclasses.replace(config, zero=0, recompute="none", sequence_parallel=None)
            one, costs = priced_space(traced, mesh, plain, alone, (),
                                      gradient_share=gradient_share)
            try:
                solved[size] = (one, solve_intra_op(traced, one, costs, None,
                                                    config.solver_time_limit_s).choice)
            except SolverTimeoutError as e:
                warnings.warn(f"the data-parallel axis {cand.names[axis]} was not placed on its "
                              f"own first ({e}); the ILP places it with the others, more slowly. "
                              f"Raise Config.solver_time_limit_s to place it first.")
                solved[size] = (one, None)
        one, choice = solved[size]
        if choice is None:
            continue
        # (nodes of identical layers list one tuple of strategies and choose alike: each pair
        # is compared once; each entry holds its tuple, so that no other takes its id)
        kept: dict[tuple[int, Strategy], tuple[tuple[Strategy, ...], tuple[Strategy, ...]]] = {}
        for name, ns in space.nodes.items():
            chosen = one.nodes[name].strategies[choice[name]]
            key = (id(ns.strategies), chosen)
            if key not in kept:
                kept[key] = (ns.strategies, _agreeing(ns.strategies, chosen, axis))
            if kept[key][1]:
                space.nodes[name] = dataclasses.replace(ns, strategies=kept[key][1])


def _agreeing(strategies: tuple[Strategy, ...], alone: Strategy, axis: int) -> tuple[Strategy, ...]:
    """Those of ``strategies`` that place every output and input on mesh ``axis`` as the
    one-axis strategy ``alone`` does (in order)."""
    want = tuple(None if b is None else b[0] for b in (*alone.outputs, *alone.inputs))
    return tuple(s for s in strategies
                 if all(a is None or b is None or a[axis] == b
                        for a, b in zip((*s.outputs, *s.inputs), want)))


def _pin_axes(traced: TracedGraph, space: StrategySpace, config: Config, cand: Candidate,
              balanced: int | None) -> None:
    """Per mesh axis: attention on the sequence over cp only, the cp axis splitting only the
    sequence (``balanced``: the cp axis held in chunk pairs, or ``None``), experts over ep."""
    for axis in range(len(cand.shape)):
        if axis in cand.cp_axes:
            _pin_attention(traced, space, axis, form=config.cp_attention)
            _sequence_only(traced, space, axis, balanced == axis, axis in cand.ep_axes)
        else:
            _pin_attention(traced, space, axis, sequence=False)
        _pin_experts(traced, space, axis, axis in cand.ep_axes)


def balanced_axis(traced: TracedGraph, config: Config, cand: Candidate) -> int | None:
    """The cp axis of ``cand`` when the plan will hold its sequence in chunk pairs
    (:func:`~autopar.planning.sequence.cp_layout`, before solving), else ``None``."""
    if cp_layout(traced, config, cand)["cp_layout"] != "balanced":
        return None
    return cand.names.index("cp")


def regathered_share(traced: TracedGraph) -> float:
    """The share of every parameter's gathered copy that the ILP counts under ZeRO-3 (see
    :func:`~autopar.cost_models.sharding.price_space`):
    :data:`~autopar.cost_models.sharding.REGATHERED_LAYERS` of the layers that read parameters."""
    layers = {traced.node_layer.get(u.name, "") for p in traced.params
              for u in traced.node(p.node).users}
    return min(1.0, REGATHERED_LAYERS / max(1, len(layers)))


def gradient_axes(cand: Candidate) -> tuple[int, ...]:
    """The mesh axes over which a pipeline stage reduces its gradients once a step (summed over
    its microbatches first, as Megatron-LM reduces over its data-and-context-parallel group):
    data parallel and context parallel (each cp rank's gradients are partial sums over its
    sequence chunk)."""
    return tuple(sorted(set(cand.dp_axes) | set(cand.cp_axes)))


def _deferred_gradients(traced: TracedGraph, space: StrategySpace, costs: SpaceCosts,
                        mesh: Mesh, cand: Candidate, share: float) -> SpaceCosts:
    """``costs`` with the moves of the parameters' gradients priced as a pipeline stage runs
    them: the reduction over the dp and cp axes once a step, ``share`` of it per microbatch
    (:func:`~autopar.cost_models.sharding.deferred_gradient_matrix`)."""
    outs = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
    moved = {}
    for i, (value, param, m) in costs.outputs.items():
        if param is not None:
            m = deferred_gradient_matrix(space.nodes[value[0]].strategies, value[1],
                                         space.nodes[param].strategies, outs[i].meta["val"],
                                         tuple(cand.shape), mesh.topology, gradient_axes(cand),
                                         share)
        moved[i] = (value, param, m)
    return dataclasses.replace(costs, outputs=moved)


def unpinned_space(traced: TracedGraph, cand: Candidate, config: Config) -> StrategySpace:
    """Every node's strategies on the logical mesh ``cand``, before any pinning."""
    with planning_device_mesh(cand.shape, cand.names) as dm:
        return build_space(traced, dm, cand.names, cand.dp_axes, config.unknown_op, cand.cp_axes)


def _pin(space: StrategySpace, node: str, name: str, placement: tuple[str, ...]) -> None:
    ns = space.nodes[node]
    keep = tuple(s for s in ns.strategies if tuple(to_str(p) for p in s.outputs[0]) == tuple(placement))
    if not keep:
        raise PlanError(f"parameter {name!r} cannot take the placement {placement} that another "
                        f"pipeline stage gave it (it shares the tensor); choose other degrees.")
    space.nodes[node] = dataclasses.replace(ns, strategies=keep)


def _shard_states(traced: TracedGraph, space: StrategySpace, cand: Candidate) -> None:
    """Give every parameter its :func:`zero_placement` on the axes ZeRO shards over (the dp
    axes, or hybrid sharding's inner one)."""
    for p in traced.params:
        ns = space.nodes[p.node]
        shape = tuple(traced.node(p.node).meta["val"].shape)
        strategies = tuple(dataclasses.replace(s, outputs=(zero_placement(
            s.outputs[0], shape, cand.shape, cand.zero_axes),)) for s in ns.strategies)
        space.nodes[p.node] = dataclasses.replace(ns, strategies=tuple(dict.fromkeys(strategies)))




_ADD = frozenset({torch.ops.aten.add.Tensor})  # the residual add (the Tensor overload only)


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
        if not is_op(n, NORMS) or n.name not in space.nodes:
            continue
        norm_shapes.add(tuple(n.args[0].meta["val"].shape))
        _keep(space, n.name, lambda s: s.inputs and s.inputs[0][axis] == want,
              f"layer norm {n.name} has no strategy with its input {want} on the tp axis; use "
              f"sequence_parallel={not sharded} or None for this model.")
    if not sharded:
        return
    for n in traced.gm.graph.nodes:
        if is_op(n, _ADD) and not is_backward(n) and n.name in space.nodes and \
                tuple(n.meta["val"].shape) in norm_shapes and len(n.all_input_nodes) == 2:
            _keep(space, n.name, lambda s: s.outputs[0] is not None and s.outputs[0][axis] == want,
                  f"residual add {n.name} has no strategy with its output Shard(1) on the tp "
                  f"axis, which sequence parallelism requires; use sequence_parallel=None or "
                  f"False for this model.")


def _pin_attention(traced: TracedGraph, space: StrategySpace, axis: int,
                   sequence: bool = True, form: str | None = None) -> None:
    """Context parallelism: keep the attention strategies whose queries are sharded on the
    sequence (dim 2) over the cp ``axis``, their keys and values either whole (gathered over
    it) or sharded too (the ring), as ``form`` (``Config.cp_attention``) says or both for the
    ILP to price, so that the ILP cannot turn the cp axis into a second batch split; on another
    axis (``sequence`` False) drop them: the sequence is split over cp only, and the plans of
    the other axes stay as they were before cp existed (Megatron's heads split over tp)."""
    want = Shard(SEQ_DIM)
    for n in traced.gm.graph.nodes:
        if n.target not in SEQUENCE_ATTENTION_QUERY or n.name not in space.nodes:
            continue
        q = SEQUENCE_ATTENTION_QUERY[n.target]
        if not sequence:
            _keep(space, n.name, lambda s: len(s.inputs) <= q or s.inputs[q][axis] != want,
                  f"attention {n.name} has only strategies with its queries split on the "
                  f"sequence, which autopar runs over a cp axis only; use cp > 1.")
            continue

        def ok(s: Any) -> bool:
            if len(s.inputs) <= q + 1 or s.inputs[q][axis] != want:
                return False
            return form is None or (s.inputs[q + 1][axis] == want) == (form == "ring")

        _keep(space, n.name, ok,
              f"attention {n.name} has no strategy with its queries sharded on the sequence over "
              f"the cp axis{'' if form is None else f' in the {form} form'} (it has dropout, or "
              f"an attention mask that cannot follow the queries); use cp=1 for this model.")


def _store_experts_split(traced: TracedGraph, space: StrategySpace, axis: int, size: int) -> None:
    """Expert parallelism: the MoE experts' weights stored split on their experts dim over the
    ep ``axis`` (a data axis, where other parameters are replicated): each rank holds, updates
    and keeps the optimizer state of its own experts only, their gradients reduced over the
    other data axes (Megatron-LM's expert-data-parallel group)."""
    for name in expert_weight_params(traced.gm.graph.nodes):
        ns = space.nodes[name]
        experts = traced.node(name).meta["val"].shape[0]
        if experts % size:
            raise PlanError(f"{name} holds {experts} experts, which do not split over ep={size}; "
                            f"use an ep that divides {experts}.")
        split = [dataclasses.replace(st, outputs=(tuple(
            Shard(0) if a == axis else p for a, p in enumerate(st.outputs[0])),))
            for st in ns.strategies]
        # (dim 0 split over the ep axis and any other axis that splits it: evenly, or not at all)
        even = [st for st in split if experts % math.prod(
            size_ for size_, p in zip(space.mesh_shape, st.outputs[0])
            if splits_experts(p)) == 0]
        if not even:
            raise PlanError(f"{name} holds {experts} experts, which no placement splits evenly "
                            f"over ep={size} and the other axes of the mesh {space.mesh_shape}; "
                            f"choose degrees that divide {experts}.")
        space.nodes[name] = dataclasses.replace(ns, strategies=tuple(dict.fromkeys(even)))


def _pin_experts(traced: TracedGraph, space: StrategySpace, axis: int, dispatch: bool) -> None:
    """Expert parallelism: on the ep ``axis`` (``dispatch``) keep the strategies of the MoE
    experts ops that split both their tokens and their experts there (the pairs sent to their
    experts' ranks by all-to-all, ``passes.experts``); on any other axis drop them, so that the
    tokens are sent over one axis only, the ep axis the plan names."""
    for n in traced.gm.graph.nodes:
        if n.target not in EXPERT_OPS or n.name not in space.nodes:
            continue
        _keep(space, n.name, lambda s: dispatches_experts(n.target, s.inputs, axis) == dispatch,
              f"MoE experts {n.name} have no strategy that "
              f"{'splits' if dispatch else 'does not split'} both tokens and experts over mesh "
              f"axis {axis}; use ep=1 for this model.")


def _shapes(val: Any) -> list[tuple[int, ...] | None]:
    vals = val if isinstance(val, (tuple, list)) else [val]
    return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals]


def _sequence_only(traced: TracedGraph, space: StrategySpace, axis: int,
                   balanced: bool = False, experts: bool = False) -> None:
    """Context parallelism: on the cp ``axis``, keep the strategies that shard only dims as
    long as the sequence (or nothing: replicated, partial). The cp axis splits the sequence;
    splitting a hidden or head dim over it too would be tensor parallelism on the wrong axis,
    and those strategies multiply the (cp, tp) ILP's size several times over (20,087 against
    2,813 strategies for a Llama-7B layer on (cp=4, tp=2) at 32K tokens). Parameters stay whole
    on it (a parameter dim as long as the sequence is not the sequence: the balanced layout of
    ``autopar.sequence_layout`` arranges only the sequence). ``balanced``: the plan holds the
    sequence in chunk pairs, which a dim split on an axis before cp too (nested inside that
    axis's blocks) cannot follow: such strategies are dropped. A node left with none keeps all
    of its own. ``experts``: the axis is the ep axis too (the ep ranks taken from cp): the MoE
    experts ops and their weights keep their strategies (:func:`_pin_experts` splits them)."""
    seq = graph_sequence_length(traced)
    if seq is None:
        return
    params = {p.node for p in traced.params}
    free = set(expert_weight_params(traced.gm.graph.nodes)) | {
        n.name for n in traced.gm.graph.nodes if n.target in EXPERT_OPS} if experts else set()

    def ok(pl: Any, shape: tuple[int, ...] | None) -> bool:
        p = pl[axis]
        if balanced and isinstance(p, (Shard, _StridedShard)) and any(
                isinstance(q, (Shard, _StridedShard)) and q.dim == p.dim
                and (type(q) is not Shard or type(p) is not Shard) for q in pl[:axis]):
            return False  # (plain splits nest in whole sequences: arranged per block)
        if not isinstance(p, (Shard, _StridedShard)):
            return True
        # (a strided split: each of its parts as long as the sequence; a split nested in an
        # earlier axis's blocks: each of those blocks, batch and sequence merged, one sequence)
        outer = math.prod(space.mesh_shape[a] for a, q in enumerate(pl[:axis])
                          if type(q) is Shard and q.dim == p.dim)
        return shape is not None and p.dim < len(shape) and \
            shape[p.dim] == seq * getattr(p, "split_factor", 1) * outer

    for name, ns in space.nodes.items():
        if len(ns.strategies) <= 1 or name in free:
            continue
        outs = _shapes(traced.node(name).meta.get("val"))
        ins = [_shapes(traced.node(v[0]).meta.get("val"))[v[1]] for v in ns.inputs]
        keep = tuple(s for s in ns.strategies
                     if all(o is None or ok(o, sh) for o, sh in zip(s.outputs, outs))
                     and all(ok(i, sh) for i, sh in zip(s.inputs, ins))
                     and (name not in params or not any(
                         o is not None and isinstance(o[axis], (Shard, _StridedShard))
                         for o in s.outputs)))
        if keep:
            space.nodes[name] = dataclasses.replace(ns, strategies=keep)


def _keep(space: StrategySpace, node: str, pred: Callable[[Any], bool], error: str) -> None:
    """Keep the strategies of ``node`` that satisfy ``pred``; none left raises ``error``."""
    ns = space.nodes[node]
    keep = tuple(s for s in ns.strategies if pred(s))
    if not keep:
        raise PlanError(error)
    space.nodes[node] = dataclasses.replace(ns, strategies=keep)


def solve_candidate(traced: TracedGraph, mesh: Mesh, config: Config, cand: Candidate,
                    cost_passes: Sequence[Callable[..., SpaceCosts]], budget: float | None,
                    stage: int | None = None, fixed: dict[str, tuple[str, ...]] | None = None,
                    activation_scale: int = 1, microbatches: int = 1,
                    split_backward: bool = False) -> Plan:
    """Solve the intra-operator ILP of ``traced`` on the logical mesh ``cand``.

    Raises :class:`PlanError` when the graph cannot be placed on it and
    :class:`InfeasibleMemoryError` when nothing fits ``budget``. ``stage`` tags the collectives
    of a pipeline stage; a stage's program leaves its data- and context-parallel gradient
    reductions out
    (the stage reduces its gradients once a step, after its ``microbatches``:
    :func:`~autopar.planning.assembly.deferred_gradient`).
    ``split_backward``: the stage runs its input and weight gradients as two steps
    (zero-bubble), which changes what it holds (:class:`StageRun`). With ZeRO a stage's runtime
    gathers its parameters once a step, before its first forward, and reduce-scatters their
    gradients after its last backward (``runtime.pipeline``): the program computes with them as
    placed (replicated over dp), and they are stored as
    :func:`~autopar.cost_models.sharding.zero_once_placement` of that
    (``StageRun.zero_axes``); with ZeRO-3 it gathers them for every microbatch's forward and
    backward instead (``StageRun.regather``).
    """
    defer_grad_sync = stage is not None
    zero_once = defer_grad_sync and bool(config.zero)
    space, costs = _stage_space(traced, mesh, config, cand, cost_passes, stage, fixed,
                                activation_scale, microbatches)

    def solve(ilp_budget: float | None) -> tuple:  # the ILP again, not the prices
        res = solve_intra_op(traced, space, costs, ilp_budget, config.solver_time_limit_s)
        grads = {p.grad_output_index for p in traced.params if p.grad_output_index is not None}
        res = dataclasses.replace(res, choice=reduce_at_outputs(traced.gm, space, res.choice, grads))
        plan = build_plan(traced, mesh, config, cand, space, costs, res,
                          defer_axes=gradient_axes(cand) if defer_grad_sync else (),
                          stage=StageRun(activation_scale, microbatches,
                                         split_backward=split_backward,
                                         zero_axes=tuple(cand.zero_axes) if zero_once else (),
                                         regather=zero_once and config.zero == 3)
                          if stage is not None else None)
        return space, costs, res, plan

    space, costs, res, plan = _within_budget(solve, budget)
    attach(plan, ExplainContext(traced, space, costs, res.choice, budget,
                                ilp_groups(traced, space)[0]))
    if stage is not None:
        plan = replace_plan(plan, collectives=tuple(dataclasses.replace(c, stage=stage)
                                                for c in plan.collectives))
    return plan


def explain_context(traced: TracedGraph, mesh: Mesh, config: Config, cand: Candidate,
                    cost_passes: Sequence[Callable[..., SpaceCosts]], budget: float | None,
                    stage: int | None = None, fixed: dict[str, tuple[str, ...]] | None = None,
                    activation_scale: int = 1, microbatches: int = 1,
                    split_backward: bool = False, *, choice: dict[str, int]) -> ExplainContext:
    """The context :func:`solve_candidate` keeps with its plan, made again from its arguments
    and the ILP's ``choice`` (for a stage placed in a worker process: made when explained)."""
    space, costs = _stage_space(traced, mesh, config, cand, cost_passes, stage, fixed,
                                activation_scale, microbatches)
    return ExplainContext(traced, space, costs, choice, budget, ilp_groups(traced, space)[0])


def _stage_space(traced: TracedGraph, mesh: Mesh, config: Config, cand: Candidate,
                 cost_passes: Sequence[Callable[..., SpaceCosts]], stage: int | None,
                 fixed: dict[str, tuple[str, ...]] | None, activation_scale: int,
                 microbatches: int) -> tuple:
    defer_grad_sync = stage is not None
    return priced_space(traced, mesh, config, cand, cost_passes, fixed, activation_scale,
                        gradient_share=1 / microbatches if defer_grad_sync else 1.0,
                        zero_once=defer_grad_sync and bool(config.zero))


_BUDGET_RETRIES = 3  # ILP solves with a lowered budget when the plan's peak is over the budget


def _within_budget(solve: Callable[[float | None], tuple], budget: float | None) -> tuple:
    """``solve(budget)``'s ``(space, costs, res, plan)``, solved again with the ILP's budget
    lowered by the excess while the plan's predicted peak (the program's liveness, which holds
    the backward's buffers beside the saved values the ILP sums) is over ``budget``. Raises
    :class:`InfeasibleMemoryError` when no plan's peak fits, with the least-memory solution's
    peak as the program runs as its requirement (a budget of that much plans)."""
    try:
        out = solve(budget)
    except InfeasibleMemoryError as e:
        if budget is None or e.required_bytes is None:
            raise
        try:  # the ILP's least-memory solution, priced as the program's peak
            least = solve(e.required_bytes * (1 + 1e-6))[3].predicted["peak_memory_bytes"]
        except InfeasibleMemoryError:
            raise e from None
        except SolverTimeoutError as late:  # (the bound above stands; say why there is no more)
            raise InfeasibleMemoryError(
                f"{e} (The least-memory plan itself was not solved within the time limit, so "
                f"its peak as the program runs is not known: {late}; raise "
                f"Config.solver_time_limit_s to know it.)",
                required_bytes=e.required_bytes, budget_bytes=budget) from late
        raise InfeasibleMemoryError(
            f"{e} As the program runs (the backward's buffers beside the saved values), that "
            f"plan needs {format_bytes(least)} per device.",
            required_bytes=max(least, e.required_bytes), budget_bytes=budget) from e
    ilp_budget = budget
    for _ in range(_BUDGET_RETRIES if budget is not None else 0):
        over = out[3].predicted["peak_memory_bytes"] - budget
        if over <= 1e-9 * budget or ilp_budget - over <= 0:
            break
        ilp_budget -= over
        try:
            out = solve(ilp_budget)
        except (InfeasibleMemoryError, SolverTimeoutError):  # (the plan before stands)
            break
    peak = out[3].predicted["peak_memory_bytes"]
    if budget is not None and peak > budget * (1 + 1e-9):
        raise InfeasibleMemoryError(
            f"the best plan found needs {format_bytes(peak)} per device at the peak of its step, "
            f"over the {format_bytes(budget)} budget (its saved values fit; the backward's "
            f"buffers beside them do not). Raise Config.memory_bytes, use more devices or "
            f"recomputation.", required_bytes=peak, budget_bytes=budget)
    return out


def replace_plan(plan: Plan, **kw: Any) -> Plan:
    """``dataclasses.replace`` that keeps what ``plan.explain`` needs."""
    return carry(plan, dataclasses.replace(plan, **kw))


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
