"""Costs of a strategy space: compute per node strategy, resharding per edge, memory per device.

Compute: roofline on the *local* (per-rank) shapes a strategy gives, so a matmul sharded on an
axis of size n costs 1/n of the replicated one and a ``Partial`` output costs the full size
(:func:`autopar.cost_models.node_compute.compute_time`).
Communication: the collectives :func:`autopar.strategies.reshard.reshard_steps` emits, priced per
mesh axis with the alpha-beta model (:mod:`autopar.cost_models.reshard_prices`). Memory (DESIGN §5): parameter,
gradient and optimizer state of each parameter shard, plus every forward activation saved for the
backward, at its local size.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.cost_models.experts import expert_weight_params
from autopar.cost_models.node_compute import compute_time, is_free, numel, val_list
from autopar.cost_models.reshard_prices import edge_matrix, pricer, reshard_time
from autopar.cost_models.topology import Topology
from autopar.capture.layers import aten_ops, is_op
from autopar.capture.remat import gather_dtype
from autopar.graph import TracedGraph
from autopar.placements import from_str, to_str
from autopar.strategies.reshard import local_shape
from autopar.strategies.space import (
    Placements, Strategy, StrategySpace, tensor_inputs, boundary_placements,
)

__all__ = ["REGATHERED_LAYERS", "SpaceCosts", "StepEndBucket", "alias_root", "deferred_gradient_matrix",
           "deferred_placement", "price_space",
           "fused_edges",
           "recomputed_bytes", "state_bytes_per_element", "step_end_buckets",
           "stored_dim", "stored_placement", "zero_once_placement", "zero_placement"]

@dataclass(frozen=True)
class SpaceCosts:
    """Per node: compute seconds and memory bytes per strategy; edge cost matrices by consumer.

    ``edges[(consumer, k)]`` is a matrix [producer strategy, consumer strategy] in seconds for the
    consumer's k-th tensor input. ``outputs[i]`` prices graph output i: for the loss a vector over
    its producer's strategies (deliver it replicated), for a parameter's gradient a matrix
    [producer strategy, parameter strategy] (deliver it in the parameter's placement).
    ``recomputed[node]``: for a node recomputed in the backward, the bytes of its outputs per
    strategy (alive again while its block's backward runs; not in ``memory``).
    """

    compute: dict[str, np.ndarray]
    memory: dict[str, np.ndarray]
    edges: dict[tuple[str, int], np.ndarray]
    outputs: dict[int, tuple[tuple[str, int], str | None, np.ndarray]]
    recomputed: dict[str, np.ndarray] = field(default_factory=dict)


def state_bytes_per_element(optimizer: str, itemsize: int = 4) -> int:
    """Bytes per parameter element held across a step: param + grad + optimizer state.

    fp32 parameters (``itemsize`` 4): Adam keeps two fp32 moments (Kingma & Ba 2015):
    4 + 4 + 8 = 16 bytes; SGD (no momentum) 4 + 4 = 8. 16-bit parameters are trained in mixed
    precision as Megatron-LM does (megatron/training/theoretical_memory_usage.py, in
    benchmarks/data/calibration.json): 16-bit param 2 + fp32 gradient 4 + fp32 master 4, plus
    Adam's two fp32 moments 8 = 18 bytes; SGD 10.
    """
    if itemsize >= 4:
        return 16 if optimizer == "adam" else 8
    return 18 if optimizer == "adam" else 10


# layers whose gathered parameters ZeRO-3 holds at once: the one computing and the one whose
# gathers are issued ahead of it (FSDP2's default prefetch of one layer: Zhao et al., "PyTorch
# FSDP", VLDB 2023, sec. 3.3; autopar's runtime: passes.overlap.prefetch_gathers)
REGATHERED_LAYERS = 2


def price_space(traced: TracedGraph, space: StrategySpace, topology: Topology,
                optimizer: str = "adam", recompute: frozenset[str] = frozenset(),
                zero_axes: Sequence[int] = (), gathered_share: float = 1.0,
                expert_skew: float = 1.0, memo: dict | None = None,
                balanced_axis: int | None = None, ep_axes: Sequence[int] = ()) -> SpaceCosts:
    """Price every strategy and every edge of ``space`` on ``topology``.

    ``zero_axes``: the parameters are stored as :func:`zero_once_placement` over these axes and
    gathered once a step into the placement the strategy gives them (a pipeline stage with
    ZeRO-1: ``autopar.runtime.pipeline``); their state is priced at the stored size, plus the
    gathered copy. ``gathered_share``: the share of a parameter's gathered copy the step holds
    at its peak (1: held through the step, ZeRO-1/2; ZeRO-3 frees each copy after its last
    reader and gathers it again, so the copies of a few layers are held at once: the ILP's
    memory is linear, so each copy counts that share of its bytes, exact when the layers are
    alike; the plan's peak is the liveness walk, ``cost_models.liveness``).

    ``expert_skew``: the load skew of MoE experts split over ranks (``cost_models.experts``).
    ``ep_axes``: the expert-parallel axes, data axes on which the experts' weights stay split
    when the step computes (the copy ZeRO gathers of them is whole on the other data axes only).
    ``balanced_axis``: the cp axis whose sequence is held in chunk pairs
    (``autopar.sequence_layout``), where causal ring attention computes half a block a step.

    ``recompute``: forward nodes recomputed in the backward (``passes.recompute``); their compute
    is paid twice, their outputs are not saved (their inputs are), and ``recomputed`` holds the
    bytes they occupy again while their block's backward runs.

    Nodes that share a strategy list (identical layers) and have the same shapes share priced
    arrays, so pricing cost does not grow with depth. ``memo`` (a dict the caller keeps, empty
    at first) shares them between calls too: a node's strategy tuple is one object for every
    node of the same op, arguments, shapes and input candidates (``strategies.space``), in this
    space and the later ones of the same process, and the arrays are keyed on it and on every
    other argument of this function they depend on.
    """
    mesh_shape = tuple(space.mesh_shape)
    compute: dict[str, np.ndarray] = {}
    memory: dict[str, np.ndarray] = {}
    edges: dict[tuple[str, int], np.ndarray] = {}
    cache = _shared_cache(memo, space, topology, optimizer, tuple(zero_axes), gathered_share,
                          expert_skew, balanced_axis)
    saved = _saved_for_backward(traced, recompute)
    recomputed: dict[str, np.ndarray] = {}
    tied = {p.node for p in traced.params if p.tied_to is not None}
    params = {p.node for p in traced.params}
    experts = expert_weight_params(traced.gm.graph.nodes) if ep_axes else set()
    fusion = fused_edges(traced)
    for name, ns in space.nodes.items():
        n = traced.node(name)
        sig = _signature(n)
        fused = fusion.get(name, frozenset())
        again = name in recompute
        key = ("c", id(ns.strategies), sig, _fused_key(n, fused), again)
        if key not in cache:
            if n.op in ("placeholder", "get_attr"):
                cache[key] = np.zeros(len(ns.strategies))
            else:
                # a recomputed node runs twice: forward, and again before its backward
                cache[key] = np.array([compute_time(n, s, mesh_shape, topology, fused,
                                                    expert_skew, balanced_axis)
                                       for s in ns.strategies]) * (2.0 if again else 1.0)
            cache[key].flags.writeable = False  # (shared: docs/cost_passes.md)
        compute[name] = cache[key]
        if again:
            recomputed[name] = recomputed_bytes(n, ns.strategies, mesh_shape)
        split = tuple(ep_axes) if name in experts else ()
        mkey = ("m", id(ns.strategies), sig, name in params, name in tied, saved.get(name), split)
        if mkey not in cache:
            cache[mkey] = _memory(n, ns.strategies, mesh_shape, name in params, name in tied,
                                  saved.get(name, ()), optimizer, space.dp_axes,
                                  tuple(zero_axes), gathered_share, split)
            cache[mkey].flags.writeable = False
        memory[name] = cache[mkey]
        for k, (src, idx) in enumerate(ns.inputs):
            val = val_list(traced.node(src).meta["val"])[idx]
            ekey = ("e", id(space.nodes[src].strategies), idx, id(ns.strategies), k, tuple(val.shape),
                    val.element_size())
            if ekey not in cache:
                cache[ekey] = edge_matrix(space.nodes[src].strategies, idx, ns.strategies, k,
                                           val, mesh_shape, topology)
                cache[ekey].flags.writeable = False
            edges[(name, k)] = cache[ekey]
    outputs = _output_costs(traced, space, mesh_shape, topology)
    return SpaceCosts(compute, memory, edges, outputs, recomputed)


def _shared_cache(memo: dict | None, space: StrategySpace, topology: Topology, *settings: Any
                  ) -> dict[Any, np.ndarray]:
    """The cache of priced arrays for a space on ``topology`` with ``settings``: kept in ``memo``
    when given. Its keys hold objects' ids (strategy tuples), so ``memo`` keeps every object of
    its spaces alive while it lives: no later object takes one of those ids."""
    if memo is None:
        return {}
    keep = memo.setdefault("objects", {})
    for ns in space.nodes.values():
        keep[id(ns.strategies)] = ns.strategies
    keep[id(topology)] = topology
    return memo.setdefault((tuple(space.mesh_shape), tuple(space.dp_axes), id(topology))
                           + tuple(settings), {})


# Ops a fusing compiler (inductor; Megatron-LM's fused kernels) merges with the pointwise ops
# around them, besides those torch tags pointwise.
_FUSIBLE = aten_ops("native_dropout", "_softmax", "_softmax_backward_data", "native_layer_norm",
                    "native_layer_norm_backward", "_log_softmax", "_log_softmax_backward_data",
                    "sum", "_to_copy")


def _fusible(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    return is_op(n, _FUSIBLE) or torch.Tag.pointwise in getattr(n.target, "tags", ())


def fused_edges(traced: TracedGraph) -> dict[str, frozenset]:
    """Memory traffic a fusing compiler removes: per node, the names of the inputs it reads from
    a fused producer (``""`` stands for its own output, when every reader fuses it). A value
    passes between two fusible ops without a round trip to memory when its producer has that
    one reader, through views (Williams et al.'s roofline counts the traffic of the fused
    kernel; inductor and Megatron-LM's fused bias-GeLU, bias-dropout-add and scaled masked
    softmax kernels fuse exactly such chains)."""
    out: dict[str, set] = {}
    for n in traced.gm.graph.nodes:
        if not _fusible(n):
            continue
        for a in tensor_inputs(n):
            src, _ = alias_root(a)
            if _fusible(src) and len(_leaf_readers(src)) == 1:
                out.setdefault(n.name, set()).add(a.name)
                out.setdefault(src.name, set()).add("")
    return {k: frozenset(v) for k, v in out.items()}


def _leaf_readers(n: fx.Node) -> list[fx.Node]:
    """The nodes that read ``n``'s memory, looking through views and getitems."""
    out = []
    for u in n.users:
        out += _leaf_readers(u) if is_free(u) else [u]
    return out


def _fused_key(n: fx.Node, fused: frozenset) -> tuple:
    """The fused inputs by position (node names differ between identical layers)."""
    return tuple(i for i, a in enumerate(tensor_inputs(n)) if a.name in fused) + (
        ("out",) if "" in fused else ())


def _signature(n: fx.Node) -> tuple:
    vals = val_list(n.meta.get("val"))
    return (str(n.target), tuple(tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals))


def deferred_placement(grad: Placements, param: Placements, dp_axes: Sequence[int]
                       ) -> Placements:
    """Where a parameter's gradient goes when its reduction over ``dp_axes`` is deferred: the
    parameter's placement, except on those of ``dp_axes`` where the parameter is replicated and
    the gradient is a partial sum, which it stays (reduced later, once a step)."""
    return tuple(g if axis in dp_axes and isinstance(g, Partial) and isinstance(w, Replicate)
                 else w for axis, (g, w) in enumerate(zip(grad, param)))


def zero_placement(placements: Placements, shape: Sequence[int], mesh_shape: Sequence[int],
                   dp_axes: Sequence[int]) -> Placements:
    """A parameter's placement under ZeRO: on each data-parallel axis, ``Shard`` of the largest
    dim no other axis shards and whose shard divides evenly; ``Replicate`` stays where no dim
    qualifies (the parameter is then not sharded over that axis).

    A parameter stored this way is all-gathered for the compute and its gradient is
    reduce-scattered, as FSDP2 shards ``DTensor`` parameters; the optimizer, built on the
    parameters, then keeps its states sharded (ZeRO-1, Rajbhandari et al., SC'20, sec. 5.1).
    The dims sharded over different axes differ, so the shards commute: the local shard is the
    chunk, on the dp axis's dim, of the local tensor without the dp sharding.
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


def zero_once_placement(placements: Placements, shape: Sequence[int],
                        mesh_shape: Sequence[int], dp_axes: Sequence[int]) -> Placements:
    """A parameter's placement under ZeRO in a pipeline stage, which gathers its parameters
    once a step (or once a microbatch with ZeRO-3) and reduce-scatters their gradients once a
    step, one collective per mesh axis (:class:`StepEndBucket`): :func:`zero_placement` over one
    data axis only, the innermost of ``dp_axes`` where the program replicates the parameter and
    a dim divides (the rest of its gradient's reduction is an all-reduce over the other axes).
    With dp cut into (``dp``, ``ep``) a dense weight is so sharded over ep and replicated over
    dp, as FSDP2's hybrid sharding keeps a shard group inside consecutive ranks; an expert
    weight, split over ep by the program, is sharded over dp."""
    for axis in sorted(dp_axes, reverse=True):
        out = zero_placement(placements, shape, mesh_shape, (axis,))
        if out != tuple(placements):
            return out
    return tuple(placements)


def stored_placement(placements: Sequence[str], shape: Sequence[int], mesh_shape: Sequence[int],
                     zero_axes: Sequence[int]) -> tuple[str, ...]:
    """Where a parameter the program places at ``placements`` (text) is stored between steps:
    there, or with ZeRO gathered once a step (``zero_axes`` the dp axes) its
    :func:`zero_once_placement` (text)."""
    return tuple(to_str(p) for p in zero_once_placement(tuple(map(from_str, placements)), shape,
                                                           mesh_shape, zero_axes))


@dataclass(frozen=True)
class StepEndBucket:
    """Tensors of a pipeline stage moved over one mesh axis once a step, in one flat buffer and
    one collective (``kind``). ``params``: the stage's parameter names, in buffer order;
    ``shapes``: their local shapes in the stage's program; ``dtype``: theirs (a gather's: the
    dtype the program casts them to when it reads them only cast,
    ``capture.remat.gather_dtype``).

    ``"all_reduce"``: gradients the stage left partial over the axis
    (:func:`deferred_placement`), summed over the step's microbatches and all-reduced in place
    once the stage's last backward is done. ZeRO-1 once a step, parameters stored sharded over
    the axis (``dims[i]``: the dim of parameter ``i``, in ``parts`` even chunks, ``parts`` the
    axis's size): ``"all_gather"``, the parameters, gathered before the stage's first forward;
    ``"reduce_scatter"``, the partial gradients of such parameters, into their shards after the
    last backward. Their buffers are laid out rank-major (each rank's chunks of every tensor
    together: ``runtime.autograd.FlatBucket``). ``then``: further axes the gradients are
    partial over (hybrid sharding's ``dp_replicate``): after the collective, its result (the
    whole buffer, or this rank's part of a reduce-scatter) is all-reduced over each, in order
    (:attr:`then_bytes`)."""

    axis: int
    dtype: torch.dtype
    params: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dims: tuple[int, ...] = ()
    parts: int = 1
    kind: str = "all_reduce"
    then: tuple[int, ...] = ()

    @property
    def bytes(self) -> int:
        """Bytes of the buffer (per rank): the all-reduced buffer, the all-gather's output, the
        reduce-scatter's input."""
        return sum(math.prod(s) for s in self.shapes) * self.dtype.itemsize

    @property
    def then_bytes(self) -> int:
        """Bytes of each all-reduce over a ``then`` axis: the buffer, or a rank's part."""
        return self.bytes // self.parts


def step_end_buckets(traced: TracedGraph, output_placements: Sequence[Sequence[str] | None],
                     params: dict[str, Sequence[str]], mesh_shape: Sequence[int],
                     stored: dict[str, Sequence[str]] | None = None) -> list[StepEndBucket]:
    """The once-a-step buckets of a pipeline stage (:class:`StepEndBucket`), from its plan's
    text placements (``output_placements``; ``params``: the program's), one per (mesh axis,
    dtype, kind, further axes), parameters in the stage's order: its deferred gradient reductions, then the
    gathers of the parameters ``stored`` sharded where the program has them replicated
    (ZeRO-1; default: stored as the program places them). A gradient the program gives whole
    to such a parameter needs no collective: each rank keeps its chunk
    (:func:`stored_dim`). The runtime moves these buffers and the plan lists these
    collectives: one owner of both. A deferred gradient is a partial sum on axes where its
    parameter is replicated: reduce-scattered over the axis it is stored sharded on, if one of
    them (else all-reduced over the first, and chunked if stored sharded), then all-reduced
    over the others (``StepEndBucket.then``: hybrid sharding's replicas); anything else is an
    internal error."""
    stored = stored or {}
    placeholders = {n.name: n for n in traced.gm.graph.nodes if n.op == "placeholder"}
    groups: dict[tuple[int, torch.dtype, str, tuple[int, ...]], list[tuple[Any, int | None]]] = {}
    for p in traced.params:
        want = tuple(params[p.name])
        kept = stored_dim(p.name, want, tuple(stored.get(p.name, want)))
        if kept is not None:
            # (cast before the gather when the program only reads it cast: bf16 autocast)
            groups.setdefault((kept[0], gather_dtype(placeholders[p.node]), "all_gather", ()),
                              []).append((p, kept[1]))
        got = output_placements[p.grad_output_index] if p.grad_output_index is not None else None
        if got is None or tuple(got) == want:
            continue
        axes = [a for a, (g, w) in enumerate(zip(got, want)) if g != w]
        if any(not isinstance(from_str(got[a]), Partial) or want[a] != "R" for a in axes):
            raise ValueError(f"internal: the gradient of {p.name} moves {tuple(got)} -> {want} "
                             f"after the step, not all-reduces. Please report this with the model.")
        # stored sharded over an axis the gradient is partial on: reduce-scattered there;
        # else all-reduced (whole on the shard axis, each rank then keeps its chunk)
        scatter = kept is not None and kept[0] in axes
        first = kept[0] if scatter else axes[0]
        kind = "reduce_scatter" if scatter else "all_reduce"
        groups.setdefault((first, p.dtype, kind, tuple(a for a in axes if a != first)),
                          []).append((p, kept[1] if scatter else None))
    out = []
    # the reductions, then the gathers (each in the stage's order)
    for (axis, dtype, kind, then), ps in sorted(groups.items(), key=lambda kv: kv[0][2] == "all_gather"):
        shapes = tuple(local_shape(p.shape, tuple(map(from_str, params[p.name])), tuple(mesh_shape))
                       for p, _ in ps)
        sharded = kind != "all_reduce"
        out.append(StepEndBucket(axis, dtype, tuple(p.name for p, _ in ps), shapes,
                                 tuple(d for _, d in ps) if sharded else (),
                                 mesh_shape[axis] if sharded else 1, kind, then))
    return out


def stored_dim(name: str, program: tuple, stored: tuple) -> tuple[int, int] | None:
    """``(mesh axis, tensor dim)`` over which parameter ``name``, computed at the text
    placements ``program``, is stored sharded at ``stored`` (ZeRO-1 once a step: ``Shard`` on
    one axis where the program replicates it); ``None`` when stored as computed."""
    if stored == program:
        return None
    moved = [a for a, (s, p) in enumerate(zip(stored, program)) if s != p]
    kind = from_str(stored[moved[0]]) if len(moved) == 1 else None
    if not isinstance(kind, Shard) or program[moved[0]] != "R":
        raise ValueError(f"internal: parameter {name} is stored {stored} and computed with "
                         f"{program}; only a Shard on one mesh axis where the program replicates "
                         f"it is gathered once a step. Please report this.")
    return moved[0], kind.dim


def deferred_gradient_matrix(src: Sequence[Strategy], idx: int, params: Sequence[Strategy],
                             val: torch.Tensor, mesh_shape: tuple[int, ...], topo: Topology,
                             dp_axes: Sequence[int], share: float) -> np.ndarray:
    """[gradient strategy, parameter strategy] seconds of moving a parameter's gradient to the
    parameter's placement when the reduction over ``dp_axes`` is deferred: the gradient goes to
    its placement with the partial sums on those axes kept (where the parameter is replicated
    there), every run, and from there to the parameter's placement once every ``1 / share``
    runs (a pipeline stage's microbatches), priced at ``share`` of its time."""
    shape, item = tuple(val.shape), val.element_size()
    price = pricer(mesh_shape, topo)
    cache: dict[tuple, float] = {}
    out = np.zeros((len(src), len(params)))
    for a, s in enumerate(src):
        for b, t in enumerate(params):
            key = (s.outputs[idx], t.outputs[0])
            if key not in cache:
                got, want = key
                kept = deferred_placement(got, want, dp_axes)
                cache[key] = price(got, kept, shape, item) + share * price(kept, want, shape, item)
            out[a, b] = cache[key]
    return out


def _saved_for_backward(traced: TracedGraph, recompute: frozenset[str] = frozenset()
                        ) -> dict[str, tuple[int, ...]]:
    """Forward nodes (by value index) whose outputs a backward node reads, directly or through
    views (a view of a saved tensor keeps its base alive: the base is what is counted).

    A value in ``recompute`` is not saved: the backward recomputes it from its inputs, and
    those are saved instead (or recomputed in turn), as ``passes.recompute`` does.
    """
    saved: dict[str, set[int]] = {}
    seen: set[str] = set()

    def read(a: fx.Node) -> None:
        src, idx = alias_root(a)
        if src.op != "call_function" or src.meta.get("partitioner_tag") == "is_backward":
            return
        if src.name not in recompute:
            saved.setdefault(src.name, set()).add(idx)
        elif src.name not in seen:
            seen.add(src.name)
            for b in src.all_input_nodes:
                read(b)

    for n in traced.gm.graph.nodes:
        if n.op == "call_function" and n.meta.get("partitioner_tag") == "is_backward":
            for a in n.all_input_nodes:
                read(a)
    return {k: tuple(sorted(v)) for k, v in saved.items()}


def recomputed_bytes(n: fx.Node, strategies: Sequence[Strategy],
                     mesh_shape: tuple[int, ...]) -> np.ndarray:
    """Per strategy, the bytes a recomputed node's outputs occupy on one rank while its block's
    backward runs (nothing for a view or ``getitem``: its base holds the memory)."""
    outs = tuple(i for i, v in enumerate(val_list(n.meta.get("val")))
                 if isinstance(v, torch.Tensor)) if alias_root(n)[0] is n else ()
    return _memory(n, strategies, mesh_shape, False, False, outs, "sgd")


def alias_root(a: fx.Node) -> tuple[fx.Node, int]:
    """The node (and output index) that owns the memory ``a`` reads: ``a`` itself, or the base
    of the views, detaches and getitems that lead to it."""
    idx = 0
    while a.op == "call_function":
        if not is_free(a) or not a.all_input_nodes:
            return a, idx
        if a.target is operator.getitem:
            src = a.args[0]
            if src.op == "call_function" and not is_free(src):
                return src, a.args[1]
            a, idx = src, 0
            continue
        a = a.all_input_nodes[0]
    return a, idx


def _memory(n: fx.Node, strategies: Sequence[Strategy], mesh_shape: tuple[int, ...],
            is_param: bool, is_tied: bool, saved_outputs: Sequence[int], optimizer: str,
            dp_axes: Sequence[int] = (), zero_axes: Sequence[int] = (),
            gathered_share: float = 1.0, split_axes: Sequence[int] = ()) -> np.ndarray:
    out = np.zeros(len(strategies))
    vals = val_list(n.meta.get("val"))
    for j, s in enumerate(strategies):
        if n.op == "placeholder":
            v = vals[0]
            local = numel(local_shape(v.shape, s.outputs[0], mesh_shape))
            if is_param and not is_tied:
                # ZeRO once a step (``zero_axes``): stored as zero_once_placement, computed as placed
                stored = (zero_once_placement(s.outputs[0], v.shape, mesh_shape, zero_axes)
                          if zero_axes else s.outputs[0])
                out[j] = numel(local_shape(v.shape, stored, mesh_shape)) * state_bytes_per_element(
                    optimizer, v.element_size())
                # (whole on the data axes, but the experts' split over ep, ``split_axes``)
                gathered = tuple(Replicate() if a in dp_axes and a not in split_axes else p
                                 for a, p in enumerate(s.outputs[0]))
                if gathered != tuple(stored):  # ZeRO: the step computes with a gathered copy
                    out[j] += (numel(local_shape(v.shape, gathered, mesh_shape)) * v.element_size()
                               * gathered_share)
            elif not is_param:
                out[j] = local * v.element_size()
            continue
        for i in saved_outputs:
            v, p = vals[i], s.outputs[i]
            if isinstance(v, torch.Tensor) and p is not None:
                out[j] += numel(local_shape(v.shape, p, mesh_shape)) * v.element_size()
    return out


def _output_costs(traced: TracedGraph, space: StrategySpace, mesh_shape: tuple[int, ...],
                  topo: Topology) -> dict[int, tuple[tuple[str, int], str | None, np.ndarray]]:
    out_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    outs = out_node.args[0]
    res: dict[int, tuple[tuple[str, int], str | None, np.ndarray]] = {}
    rep = tuple(Replicate() for _ in mesh_shape)
    fixed = {i: rep for i in ([traced.loss_output_index] if traced.loss_output_index is not None else [])}
    fixed.update({i: boundary_placements(tuple(outs[i].meta["val"].shape), mesh_shape, space.dp_axes,
                                         space.cp_axes)
                  for i in (*traced.boundary_outputs, *traced.boundary_grad_outputs)})
    for i, target in fixed.items():  # the loss (replicated) and a pipeline stage's boundary values
        value = space.value_of(outs[i].name)
        v = outs[i].meta["val"]
        res[i] = (value, None, np.array([
            reshard_time(s.outputs[value[1]], target, tuple(v.shape), v.element_size(), mesh_shape, topo)
            for s in space.nodes[value[0]].strategies]))
    for p in traced.params:
        if p.grad_output_index is None or outs[p.grad_output_index] is None:
            continue
        g = outs[p.grad_output_index]
        value = space.value_of(g.name)
        gv = g.meta["val"]
        target = [(s.outputs[0],) for s in space.nodes[p.node].strategies]
        m = edge_matrix(space.nodes[value[0]].strategies, value[1],
                         [Strategy((), t) for t in target], 0, gv, mesh_shape, topo)
        res[p.grad_output_index] = (value, p.node, m)
    return res
