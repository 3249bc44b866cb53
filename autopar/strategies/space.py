"""The strategy space: every node's candidate placements on a mesh, from DTensor's rules.

For each node of the joint graph the space lists strategies; a strategy gives the placement of
every output and the placement every tensor input must have. Inputs are *values*
``(producer, output index)``: ``getitem`` nodes are aliases, not nodes of their own.
Placeholders (parameters, user inputs, the loss tangent) get all even shardings, restricted on a
data-parallel axis to ``Replicate`` for parameters and batch ``Shard(0)`` for inputs.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field, replace
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar import _torch_private as private
from autopar._torch_private import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    TensorMeta,
    TupleStrategy,
    _StridedShard,
)
from autopar.errors import PlanError, UnsupportedOpError
from autopar.graph import TracedGraph
from autopar.placements import is_kind
from autopar.strategies import fused
from autopar.strategies.expansion import ExpansionError, expand, is_even
from autopar.strategies.nested_views import VIEW_OPS, nested_view_strategies
from autopar.strategies import rules as _rules  # noqa: F401  (registers autopar's own rules)

__all__ = ["boundary_placements", "build_space", "clear_enumerations",
           "share_equal_strategies", "NodeSpace", "Placements", "representatives", "Strategy",
           "StrategySpace", "tensor_inputs", "Value"]

Placements = tuple[Placement, ...]
Value = tuple[str, int]


@dataclass(frozen=True)
class Strategy:
    """Placements of a node's outputs (``None`` for non-tensors) and required input placements."""

    outputs: tuple[Placements | None, ...]
    inputs: tuple[Placements, ...]


@dataclass(frozen=True)
class NodeSpace:
    """Candidate strategies of one node; ``inputs`` are the values its tensor inputs read;
    ``op`` the aten op overload it calls (``torch.ops.aten.addmm.default``; ``None`` for a
    placeholder or a constant): what a cost pass matches on (``ns.op.overloadpacket is
    torch.ops.aten.addmm``)."""

    node: str
    strategies: tuple[Strategy, ...]
    inputs: tuple[Value, ...]
    source: str
    op: Any = None


@dataclass(frozen=True)
class StrategySpace:
    """Strategies of every node of a :class:`TracedGraph` on one mesh shape.

    ``alias`` maps each ``getitem`` node to the value it reads; ``dp_axes`` are mesh axes forced
    to data parallelism; ``warnings`` lists ops that fell back to replication.
    """

    mesh_shape: tuple[int, ...]
    axis_names: tuple[str, ...]
    nodes: dict[str, NodeSpace] = field(repr=False)
    alias: dict[str, Value] = field(repr=False)
    dp_axes: tuple[int, ...]
    warnings: tuple[str, ...]
    cp_axes: tuple[int, ...] = ()

    def value_of(self, node: str) -> Value:
        """The value (producer, output index) a node name stands for."""
        return self.alias.get(node, (node, 0))

    def output_candidates(self, value: Value) -> list[Placements]:
        """Distinct placements the producer of ``value`` may give it, in strategy order."""
        return _distinct_outputs(self.nodes[value[0]].strategies, value[1])

    @property
    def num_strategies(self) -> int:
        """Total strategies over all nodes (before linking identical layers)."""
        return sum(len(ns.strategies) for ns in self.nodes.values())


def boundary_placements(shape: Sequence[int], mesh_shape: Sequence[int], dp_axes: Sequence[int],
                        cp_axes: Sequence[int] = ()) -> Placements:
    """Placement of a value of ``shape`` crossing a pipeline cut (or its gradient): split on
    the batch (dim 0) over the data axes; over a cp axis split on the first dim after the batch
    with more than one element that the axis divides (the sequence of a ``[batch, seq,
    hidden]`` activation, the query rows of a ``[batch, 1, seq, seq]`` mask), so each cp rank
    sends and receives its own part of the sequence; replicated otherwise."""
    out: list[Placement] = []
    for axis, size in enumerate(mesh_shape):
        dim = None
        if axis in cp_axes:
            dim = next((d for d in range(1, len(shape)) if shape[d] > 1 and shape[d] % size == 0),
                       None)
        out.append(Shard(0) if axis in dp_axes else Shard(dim) if dim is not None else Replicate())
    return tuple(out)


def _distinct_outputs(strategies: Sequence[Strategy], idx: int) -> list[Placements]:
    """Distinct placements of output ``idx`` over ``strategies``, in strategy order."""
    return list(dict.fromkeys(s.outputs[idx] for s in strategies if s.outputs[idx] is not None))


def _meta(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(tuple(val.shape), tuple(val.stride()), val.dtype)


def _placeholder_strategies(
    shape: Sequence[int], mesh_shape: Sequence[int], role: str, dp_axes: Sequence[int],
    fused: tuple[int, int] | None = None, cp_axes: Sequence[int] = (),
) -> list[Strategy]:
    """All even placements of a placeholder; on dp axes params replicate, inputs shard batch;
    on cp axes params replicate, inputs shard the sequence (dim 1; a 1-d input replicates).

    A pipeline boundary activation (or its tangent) has one placement, :func:`boundary_placements`.

    A fused projection parameter (``fused = (dim, k)``) may also be strided-sharded on ``dim``.
    """
    if role == "boundary":
        edge = boundary_placements(shape, mesh_shape, dp_axes, cp_axes)
        return [Strategy((edge,), ())] if is_even(shape, edge, mesh_shape) else []
    per_axis: list[list[Placement]] = []
    for axis in range(len(mesh_shape)):
        if role == "tangent":
            opts: list[Placement] = [Replicate()]
        elif axis in cp_axes:
            opts = [Shard(1)] if role == "input" and len(shape) >= 2 else [Replicate()]
        elif axis in dp_axes:
            opts = [Replicate()] if role == "param" else [Shard(0)]
        else:
            opts = [Replicate()] + [Shard(d) for d in range(len(shape))]
            if fused is not None:
                opts.append(_StridedShard(fused[0], split_factor=fused[1]))
        per_axis.append(opts)
    combos: list[Placements] = [()]
    for opts in per_axis:
        combos = [c + (p,) for c in combos for p in opts]
    ks = frozenset([fused[1]]) if fused else frozenset()
    return [Strategy((c,), ()) for c in combos if is_even(shape, c, mesh_shape, ks)]


def _mixes_strided(strategy: Strategy) -> bool:
    """Whether a placement of ``strategy`` shards one dim both with a strided shard on one axis
    and a plain shard on another, e.g. ``(S(2), SS(2,3))`` for a fused QKV output on (dp, tp).
    Such strategies are left out of the space: a plan with them (found by the fuzz test: GPT
    dim 48, 4 heads, 4 layers, untied, free on 4 gloo processes with ``slow-compute`` costs,
    which chose dp=2 x tp=2 sharding the heads on both axes) ran the collectives it planned
    but computed a loss 3.7e-3 off and gradients off by their own size; without them it equals
    one process. Which of DTensor's view rule or the lowering's reshard misreads the pair is
    not known yet (docs/architecture.md, "Not yet")."""
    for pl in (*strategy.outputs, *strategy.inputs):
        if pl is None:
            continue
        strided = {p.dim for p in pl if is_kind(p, _StridedShard)}
        if strided and strided & {p.dim for p in pl if is_kind(p, Shard)}:
            return True
    return False


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    """The nodes ``node`` reads, in order: those among its positional arguments (inside lists,
    tuples and dicts too), then its keyword arguments that are nodes."""
    out: list[fx.Node] = []
    _collect_nodes(node.args, out)
    return out + [v for v in node.kwargs.values() if isinstance(v, fx.Node)]


def _collect_nodes(a: Any, out: list[fx.Node]) -> None:
    # (as pytree's flatten orders the leaves, without its cost: this runs for every node of
    # every space priced)
    if isinstance(a, fx.Node):
        out.append(a)
    elif isinstance(a, (list, tuple)):
        for x in a:
            _collect_nodes(x, out)
    elif isinstance(a, dict):
        for x in a.values():
            _collect_nodes(x, out)


def _out_meta(val: Any) -> Any:
    if isinstance(val, torch.Tensor):
        return _meta(val)
    if isinstance(val, (tuple, list)):
        return tuple(_meta(v) if isinstance(v, torch.Tensor) else None for v in val)
    return None


def _num_outputs(val: Any) -> int:
    return len(val) if isinstance(val, (tuple, list)) else 1


def _replicate_strategy(node: fx.Node, ndim: int) -> Strategy:
    val = node.meta.get("val")
    rep = tuple(Replicate() for _ in range(ndim))
    if isinstance(val, (tuple, list)):
        outs = tuple(rep if isinstance(v, torch.Tensor) else None for v in val)
    else:
        outs = (rep if isinstance(val, torch.Tensor) else None,)
    return Strategy(outs, tuple(rep for _ in tensor_inputs(node)))


# Enumerations shared between the spaces built in one process: the setup search builds one space
# per microbatch size and (cp, tp) submesh, and many nodes recur in them with the same shapes and
# input candidates (parameters' chains, nodes whose shapes do not depend on the microbatch).
# Keyed by everything the enumeration reads (_Builder._enumeration_key), rules included: a rule
# registered later for an op changes its key (a rule must depend on its arguments only:
# docs/adding_an_op.md). Bounded (DeepSeek-V3's search makes about 6,000); the oldest go first.
_ENUMERATED: dict[tuple, tuple[tuple[Strategy, ...], str, tuple]] = {}
_ENUMERATED_SIZE = 20_000


def clear_enumerations() -> None:
    """Forget the enumerations kept for the process (after changing what a registered rule
    returns for the same arguments, or to free their memory)."""
    _ENUMERATED.clear()


def _tensor_key(val: Any) -> Any:
    """A node value's metadata as a hashable key (shape, strides, dtype), or its repr."""
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), val.dtype)
    return repr(val)


class _Builder:
    """Walks the graph once, asking DTensor (or autopar's rules) for each node's strategies."""

    def __init__(self, traced: TracedGraph, mesh: Any, axis_names: Sequence[str],
                 dp_axes: Sequence[int], unknown_op: str, cp_axes: Sequence[int] = ()):
        self.traced, self.mesh, self.dp_axes, self.unknown_op = traced, mesh, tuple(dp_axes), unknown_op
        self.cp_axes = tuple(cp_axes)
        self.axis_names = tuple(axis_names)
        self.mesh_shape = tuple(mesh.shape)
        self.nodes: dict[str, NodeSpace] = {}
        self.alias: dict[str, Value] = {}
        self.warnings: list[str] = []
        self.prop = private.sharding_propagator()
        self._cands: dict[Value, list[Placements]] = {}
        self.fused = fused.fused_params(traced.gm, {p.node for p in traced.params})
        self.strided_ok = frozenset(k for _, k in self.fused.values())

    def value(self, n: fx.Node) -> Value:
        return self.alias.get(n.name, (n.name, 0))

    def candidates(self, value: Value) -> list[Placements]:
        if value not in self._cands:
            self._cands[value] = _distinct_outputs(self.nodes[value[0]].strategies, value[1])
        return self._cands[value]

    def _require(self, n: fx.Node, strategies: list, what: str) -> None:
        if not strategies:
            raise PlanError(
                f"{what} {n.name} of shape {tuple(n.meta['val'].shape)} cannot be placed on a mesh "
                f"{dict(zip(self.axis_names, self.mesh_shape))}: no dim divides evenly (on a data "
                f"parallel axis the batch dim must be divisible by the axis size). Use a batch "
                f"divisible by the data-parallel degree or another Config(dp=..., tp=...).")

    def placeholder(self, n: fx.Node) -> None:
        params = {p.node for p in self.traced.params}
        buffers = {b.node for b in self.traced.buffers}
        boundary = set(self.traced.boundary_inputs) | set(self.traced.boundary_tangents)
        role = "param" if n.name in params else "boundary" if n.name in boundary else (
            "tangent" if n.name in self.traced.tangent_nodes or n.name in buffers else "input")
        shape = tuple(n.meta["val"].shape)
        strategies = _placeholder_strategies(shape, self.mesh_shape, role, self.dp_axes,
                                             self.fused.get(n.name), self.cp_axes)
        self._require(n, strategies, role)
        self.nodes[n.name] = NodeSpace(n.name, tuple(strategies), (), role)

    def op(self, n: fx.Node) -> None:
        inputs = tensor_inputs(n)
        values = tuple(self.value(a) for a in inputs)
        strategies, source = self._enumerate(n, inputs)
        self.nodes[n.name] = NodeSpace(n.name, tuple(strategies), values, source, n.target)

    def _enumerate(self, n: fx.Node, inputs: list[fx.Node]) -> tuple[Sequence[Strategy], str]:
        if not inputs:
            return [_replicate_strategy(n, len(self.mesh_shape))], "factory"
        if all(d == 1 for d in self.mesh_shape):  # one device: every placement is the whole
            return [_replicate_strategy(n, len(self.mesh_shape))], "one device"
        key = self._enumeration_key(n, inputs)
        if key in _ENUMERATED:
            strategies, source, _ = _ENUMERATED[key]
            return strategies, source  # (the same tuple: prices keyed on it are shared)
        listed, source = self._ask_rules(n, inputs)
        strategies = tuple(listed)
        if source != "fallback-replicate":  # (its warning names the node: asked again)
            while len(_ENUMERATED) >= _ENUMERATED_SIZE:
                _ENUMERATED.pop(next(iter(_ENUMERATED)))
            _ENUMERATED[key] = (strategies, source, (
                self.prop.op_strategy_funcs.get(n.target),
                self.prop.op_single_dim_strategy_funcs.get(n.target)))
        return strategies, source

    def _enumeration_key(self, n: fx.Node, inputs: list[fx.Node]) -> tuple:
        """Everything :meth:`_ask_rules` reads: the op and the rule objects registered for it,
        every argument (a tensor's shape, strides and dtype with its producer's candidate
        placements; any other argument by value), the outputs' metadata, the mesh's shape and
        device type, and the builder's settings. ``inputs``: ``tensor_inputs(n)``."""
        def arg(a: Any) -> Any:
            if isinstance(a, fx.Node):
                return (_tensor_key(a.meta.get("val")), tuple(self.candidates(self.value(a))))
            if isinstance(a, (list, tuple)):
                return (type(a).__name__, tuple(arg(x) for x in a))
            if isinstance(a, dict):
                return ("dict", tuple((k, arg(v)) for k, v in a.items()))
            return (type(a).__name__, repr(a))

        val = n.meta.get("val")
        outs = tuple(_tensor_key(v) for v in val) if isinstance(val, (tuple, list)) else _tensor_key(val)
        # (rule objects by identity, some are unhashable; each entry holds its rules, so that
        # no later rule can take the id of one that was replaced)
        rules = (id(self.prop.op_strategy_funcs.get(n.target)),
                 id(self.prop.op_single_dim_strategy_funcs.get(n.target)))
        # (which inputs are one node: mul(x, x) is not mul(x, y))
        same = tuple(inputs.index(a) for a in inputs)
        return (n.target, rules, arg(n.args), tuple((k, arg(v)) for k, v in n.kwargs.items()),
                same, outs, self.mesh_shape, getattr(self.mesh, "device_type", None), self.strided_ok,
                self.unknown_op)

    def _ask_rules(self, n: fx.Node, inputs: list[fx.Node]) -> tuple[list[Strategy], str]:
        op = n.target
        if op in fused.FUSED_OPS:
            try:
                return self._convert(n, fused.fused_strategy(op, self._schema(n)), len(inputs)), "dtensor+fused"
            except Exception as e:
                return self._fallback(n, f"split/cat rule failed ({type(e).__name__}: {e})")
        if not private.has_rule(op):
            return self._fallback(n, f"no sharding rule for {op}")
        out_meta = _out_meta(n.meta.get("val"))
        try:
            strategies = self._expanded(n, self._schema(n), out_meta, len(inputs))
            strided = self._strided_rep(inputs)
            if strided is not None and op in self.prop.op_single_dim_strategy_funcs:
                # single-axis rules expand shard placeholders only to the shard types they see
                strategies = list(dict.fromkeys(strategies + self._expanded(
                    n, self._schema(n, single_rep=strided), out_meta, len(inputs))))
        except ExpansionError:  # (autopar's own expansion failing is a bug, not a rule's refusal)
            raise
        except Exception as first:  # some rules assume one candidate per secondary input
            # ... or fail on one candidate placement: ask per candidate, keep those that work
            strategies, errors = [], []
            for pos, a in enumerate(inputs):
                for lead in self.candidates(self.value(a)):
                    try:
                        schema = self._schema(n, lead, lead_pos=pos)
                        result = private.enumerate_op_strategy(op, schema, out_meta, self.mesh)
                    except Exception as e:
                        errors.append(f"{type(e).__name__}: {e}")
                        continue
                    strategies += self._convert(n, result, len(inputs))
            if not strategies:
                return self._fallback(
                    n, f"DTensor's rule for {op} failed ({type(first).__name__}: {first}; "
                       f"{'; '.join(errors[:2])})")
            strategies = list(dict.fromkeys(strategies))
        if op in VIEW_OPS and len(inputs) == 1:  # (DTensor's rule keeps one split of a merge)
            strategies = list(dict.fromkeys(strategies + self._nested_views(n, inputs[0])))
        strategies = [st for st in strategies if not _mixes_strided(st)]  # (see there)
        if not strategies:
            return self._fallback(n, f"no even sharding of {op} fits the shapes")
        return strategies, "dtensor"

    def _nested_views(self, n: fx.Node, source: fx.Node) -> list[Strategy]:
        """The view's strategies that keep two nested splits (:mod:`.nested_views`)."""
        in_shape, out_shape = tuple(source.meta["val"].shape), tuple(n.meta["val"].shape)
        pairs = nested_view_strategies(in_shape, out_shape, self.candidates(self.value(source)),
                                       self.mesh_shape)
        return [Strategy((o,), (i,)) for i, o in pairs
                if is_even(in_shape, i, self.mesh_shape) and is_even(out_shape, o, self.mesh_shape)]

    def _strided_rep(self, inputs: list[fx.Node]) -> Placements | None:
        for a in inputs:
            for c in self.candidates(self.value(a)):
                for p in c:
                    if is_kind(p, _StridedShard):
                        # a plain shard next to the strided one, so that a rule expanding the
                        # shard types it sees also pairs a batch-sharded axis with a strided one
                        rest = (p,) * (len(self.mesh_shape) - 1)
                        return (Shard(0), *rest) if rest else (p,)
        return None

    def _schema(self, n: fx.Node, lead: Placements | None = None,
                single_rep: Placements | None = None, lead_pos: int = 0) -> OpSchema:
        # Single-axis rules need one spec per input and only read which shard types occur
        # (a plain Shard makes them expand to every Shard(dim)); full rules derive candidates
        # from every placement the producer may give.
        single = n.target in self.prop.op_single_dim_strategy_funcs
        rep = single_rep or tuple(Shard(0) for _ in self.mesh_shape)
        first = tensor_inputs(n)[lead_pos]
        replicate = tuple(Replicate() for _ in self.mesh_shape)

        def wrap(a: Any) -> Any:
            if isinstance(a, fx.Node):
                meta = _meta(a.meta["val"])
                if single:
                    cands = [rep]
                elif lead is not None:  # one candidate each: ``lead`` for the leading input
                    cands = [lead if a is first else replicate]
                else:
                    cands = self.candidates(self.value(a))
                specs = [OpSpec(DTensorSpec(self.mesh, p, meta)) for p in cands]
                return OpStrategy(specs)
            if isinstance(a, (list, tuple)) and a and all(isinstance(x, fx.Node) for x in a):
                return TupleStrategy(tuple(wrap(x) for x in a))
            return a

        args = tuple(wrap(a) for a in n.args)
        kwargs = {k: wrap(v) for k, v in n.kwargs.items()}
        return OpSchema(n.target, args, kwargs, schema_info=self.prop.op_to_schema_info.get(n.target))

    def _expanded(self, n: fx.Node, schema: OpSchema, out_meta: Any, n_inputs: int) -> list[Strategy]:
        """DTensor's strategies for ``n`` on ``schema``, even ones only: a single-dim rule's
        expanded over the mesh by :func:`~autopar.strategies.expansion.expand` where it can
        (the same strategies, without building DTensor's specs), by DTensor otherwise."""
        result = private.enumerate_op_strategy(n.target, schema, out_meta, self.mesh, capture=True)
        if isinstance(result, private.MeshExpansion):
            val = n.meta.get("val")
            out_shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None
                          for v in (val if isinstance(val, (tuple, list)) else [val])]
            in_shapes = [tuple(a.meta["val"].shape) for a in tensor_inputs(n)]
            try:
                pairs = expand(result, out_shapes, in_shapes, self.mesh_shape, self.strided_ok)
            except Exception as e:
                raise ExpansionError(
                    f"internal: expanding the single-dim strategies of {n.target} (node {n.name}) "
                    f"over the mesh {self.mesh_shape} failed ({type(e).__name__}: {e}). Please "
                    f"report this with the model.") from e
            if pairs is not None:
                return [Strategy(o, i) for o, i in pairs]
            result = private.enumerate_op_strategy(n.target, schema, out_meta, self.mesh)
        return self._convert(n, result, n_inputs)

    def _convert(self, n: fx.Node, result: Any, n_inputs: int) -> list[Strategy]:
        if not isinstance(result, OpStrategy):
            return []
        val = n.meta.get("val")
        out_shapes = [tuple(v.shape) if isinstance(v, torch.Tensor) else None
                      for v in (val if isinstance(val, (tuple, list)) else [val])]
        in_shapes = [tuple(a.meta["val"].shape) for a in tensor_inputs(n)]
        seen: dict[Strategy, None] = {}
        for spec in result.strategies:
            outs = spec.output_specs if isinstance(spec.output_specs, (tuple, list)) else (spec.output_specs,)
            if len(outs) != len(out_shapes):
                continue
            # DTensor gives no spec for the tensors that CUDA attention returns empty (flash
            # attention's cum_seq_q/k outside varlen): nothing to move, so they are replicated
            outs_p = tuple(o.placements if isinstance(o, DTensorSpec)
                           else (Replicate(),) * len(self.mesh_shape) if shape is not None else None
                           for o, shape in zip(outs, out_shapes))
            ins = spec.input_specs if spec.input_specs is not None else [outs[0]] * n_inputs
            if len(ins) != n_inputs or any(not isinstance(s, DTensorSpec) for s in ins):
                continue
            ins_p = tuple(s.placements for s in ins)
            ok = all(p is None or s is None or is_even(s, p, self.mesh_shape, self.strided_ok)
                     for p, s in zip(outs_p, out_shapes))
            ok = ok and all(is_even(s, p, self.mesh_shape, self.strided_ok) for p, s in zip(ins_p, in_shapes))
            if ok:
                seen.setdefault(Strategy(outs_p, ins_p), None)
        return list(seen)

    def _fallback(self, n: fx.Node, why: str) -> tuple[list[Strategy], str]:
        if self.unknown_op == "error":
            raise UnsupportedOpError(
                f"{why} (node {n.name}, from {_where(n)}). Register a rule with "
                f"@autopar.register_op_rule({n.target}) or set Config(unknown_op='replicate')."
            )
        self.warnings.append(f"{n.name} ({n.target}): {why}; replicated")
        return [_replicate_strategy(n, len(self.mesh_shape))], "fallback-replicate"


def _where(n: fx.Node) -> str:
    stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack") or {}
    paths = [v[0] for v in stack.values() if isinstance(v, tuple)]
    return paths[-1] if paths else "the top-level module"


def build_space(
    traced: TracedGraph, mesh: Any, axis_names: Sequence[str], dp_axes: Sequence[int] = (),
    unknown_op: str = "replicate", cp_axes: Sequence[int] = (),
) -> StrategySpace:
    """Enumerate every node's strategies on ``mesh`` (a DeviceMesh, real or for planning only).

    Identical layers (equal fingerprints) reuse the first one's strategies node for node, so the
    cost of enumeration does not grow with depth.
    """
    with private.no_redistribute_costs():
        return _build(traced, mesh, axis_names, dp_axes, unknown_op, cp_axes)


def _build(traced: TracedGraph, mesh: Any, axis_names: Sequence[str], dp_axes: Sequence[int],
           unknown_op: str, cp_axes: Sequence[int] = ()) -> StrategySpace:
    b = _Builder(traced, mesh, axis_names, dp_axes, unknown_op, cp_axes)
    rep_of = representatives(traced)
    built: dict[str, str] = {}
    for n in traced.gm.graph.nodes:
        if n.op == "placeholder":
            b.placeholder(n)
        elif n.op == "get_attr":  # a constant captured in the graph: replicated
            rep = tuple(Replicate() for _ in b.mesh_shape)
            b.nodes[n.name] = NodeSpace(n.name, (Strategy((rep,), ()),), (), "constant")
        elif n.op == "call_function" and n.target is operator.getitem:
            src = b.value(n.args[0])
            b.alias[n.name] = (src[0], n.args[1])
        elif n.op == "call_function":
            # identical layers: the first node built of each class gives the strategies
            key = rep_of.get(n.name, n.name)
            if key in built:
                first = b.nodes[built[key]]
                values = tuple(b.value(a) for a in tensor_inputs(n))
                b.nodes[n.name] = NodeSpace(n.name, first.strategies, values, first.source,
                                            n.target)
            else:
                b.op(n)
                built[key] = n.name
    return StrategySpace(tuple(mesh.shape), tuple(axis_names), b.nodes, b.alias,
                         tuple(dp_axes), tuple(b.warnings), tuple(cp_axes))


def share_equal_strategies(space: StrategySpace, base: StrategySpace) -> StrategySpace:
    """``space`` (``base`` pinned) with one tuple object for the strategies of the nodes that
    had one in ``base`` (the same op, arguments, shapes and input candidates: the enumeration's
    key) and still list the same strategies. Pinning gives each node a tuple of its own, and
    prices are shared between nodes by that object with their output shapes
    (``cost_models.sharding.price_space``): without this each of a stage's identical layers is
    priced again. Equal lists alone are not enough: two matmuls with the same output and
    strategies but other inputs differ in time. The nodes keep their strategies in order."""
    seen: dict[tuple, tuple[Strategy, ...]] = {}
    nodes = {}
    for name, ns in space.nodes.items():
        if ns.strategies is base.nodes[name].strategies:
            nodes[name] = ns  # (not pinned: shared as enumerated)
            continue
        same = seen.setdefault((id(base.nodes[name].strategies), ns.strategies), ns.strategies)
        nodes[name] = ns if same is ns.strategies else replace(ns, strategies=same)
    return replace(space, nodes=nodes)


def representatives(traced: TracedGraph) -> dict[str, str]:
    """Node name -> the same-position node of the first layer with the same fingerprint."""
    first: dict[str, tuple[str, ...]] = {}
    rep: dict[str, str] = {}
    for layer in traced.layers:
        if not layer.name:
            continue
        if layer.fingerprint not in first:
            first[layer.fingerprint] = layer.nodes
            continue
        for a, b in zip(layer.nodes, first[layer.fingerprint]):
            rep[a] = b
    return rep
