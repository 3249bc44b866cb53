"""Lowering pass: the joint graph + a Plan -> one local joint program per rank.

``lower_to_local(gm, plan, mesh)`` interprets the joint graph over DTensors whose placements are
the Plan's, moving every value to the placement its consumer's chosen strategy needs with the
exact single-axis steps of :func:`autopar.strategies.reshard.reshard_steps`, and retraces the
whole interpretation with ``make_fx`` under ``FakeTensorMode``. The result is a plain FX graph on
local shards in which every collective is an explicit ``_c10d_functional`` node.

Requires: ``gm`` is the TracedGraph's joint graph and ``plan`` was made for it; ``mesh`` is a
DeviceMesh of ``plan.mesh_shape`` in the running job. Guarantees: the local program's inputs are
the local shards of the placeholders (same order), its outputs the local loss (replicated) and the
local gradient shards in their parameter's placement; it issues exactly ``plan.collectives``.
Every output is moved to its placement as soon as it is computed (the loss in the forward, each
gradient where the backward produces it), so an unreduced gradient dies at its reduction.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.fx.experimental.proxy_tensor import make_fx

from autopar import _torch_private as private
from autopar._torch_private import DTensorSpec, FakeTensorMode, _StridedShard
from autopar.graph import output_moves
from autopar.placements import from_str
from autopar.passes.gather_buckets import bucket_gathers
from autopar.passes.grad_buckets import GradientBuckets
from autopar.passes.overlap import overlap_collectives, prefetch_gathers
from autopar.capture.layers import is_backward
from autopar.capture.remat import REGATHER, TAG, marked
from autopar.passes.recompute import recompute_pass
from autopar.passes import experts as expert_ops, ring_attention, seq_attention
from autopar.plan import Plan
from autopar.sequence_layout import SequenceLayout, layout_of_plan
from autopar.strategies import fused
from autopar.strategies.nested_views import VIEW_OPS
from autopar.strategies.rules import NEW_FACTORIES
from autopar.strategies.reshard import local_shape, reshard_steps

__all__ = ["lower_to_local", "placements_of", "reshard"]


def placements_of(text: Sequence[str]) -> tuple:
    """Placement tuple from the plan's text form."""
    return tuple(from_str(t) for t in text)


def reshard(x: DTensor, dst: tuple, mesh: Any, layout: SequenceLayout | None = None) -> DTensor:
    """Move ``x`` to ``dst`` placements with the planned single-axis steps; with a balanced cp
    ``layout``, a dim split on the cp axis is arranged before the split and restored after the
    gather (:mod:`autopar.sequence_layout`)."""
    shape = tuple(x.shape)
    for step in reshard_steps(tuple(x.placements), dst, shape, x.element_size(), tuple(mesh.shape)):
        before = x.placements[step.axis]
        moves = layout is not None and step.axis == layout.axis and before != step.after[step.axis]
        if moves and layout.follows(step.after[step.axis], shape):
            x = layout.arrange(x, step.after[step.axis])
        x = _step(x, step, mesh)
        if moves and layout.follows(before, shape):
            x = layout.restore(x, before)
    return x


def _step(x: DTensor, step: Any, mesh: Any) -> DTensor:
    """One single-axis step of :func:`reshard`."""
    if step.kind == "local" and isinstance(step.after[step.axis], Partial) and \
            not isinstance(x.placements[step.axis], Partial):
        # Replicate -> Partial is refused by DTensor.redistribute: do it locally
        local = private.redistribute_local(x.to_local(), x._spec, _spec_like(x, step.after))
        x = DTensor.from_local(local, mesh, step.after, run_check=False, shape=x.shape, stride=x.stride())
    elif step.kind == "all_gather" and isinstance(x.placements[step.axis], _StridedShard):
        x = _gather_strided(x, step.axis, step.after, mesh)
    elif step.kind == "local" and isinstance(step.after[step.axis], _StridedShard) and \
            isinstance(x.placements[step.axis], Replicate):
        x = _slice_strided(x, step.axis, step.after, mesh)
    else:
        x = x.redistribute(mesh, step.after)
    return x


def _gather_strided(x: DTensor, axis: int, after: tuple, mesh: Any) -> DTensor:
    """All-gather a ``_StridedShard(dim, k)`` axis: gather, then put the k parts back in order.

    DTensor's own path computes shard offsets with ``.tolist()``, which cannot be traced with
    fake tensors. Rank r holds parts ``[p_0^r, ..., p_{k-1}^r]``; gathering gives them rank-major
    and a reshape/transpose makes them part-major, the global order.
    """
    from autopar._torch_private import funcol

    p = x.placements[axis]
    dim, k, n = p.dim, p.split_factor, mesh.shape[axis]
    local = x.to_local()
    full = funcol.all_gather_tensor(local.contiguous(), dim, (mesh, axis))
    shape = list(full.shape)
    c = shape[dim] // (n * k)
    full = full.reshape(shape[:dim] + [n, k, c] + shape[dim + 1:]).transpose(dim, dim + 1)
    full = full.reshape(shape)
    return DTensor.from_local(full, mesh, after, run_check=False, shape=x.shape, stride=x.stride())


def _slice_strided(x: DTensor, axis: int, after: tuple, mesh: Any) -> DTensor:
    """Replicate -> ``_StridedShard(dim, k)`` on ``axis``, locally: of each of the k parts of
    ``dim``, this rank's chunk (the inverse of :func:`_gather_strided`; DTensor 2.11's
    redistribution cannot plan a move into a strided shard)."""
    p = after[axis]
    n, rank = mesh.shape[axis], mesh.get_local_rank(axis)
    parts = x.to_local().chunk(p.split_factor, p.dim)
    local = torch.cat([part.chunk(n, p.dim)[rank] for part in parts], p.dim)
    return DTensor.from_local(local, mesh, after, run_check=False, shape=x.shape, stride=x.stride())


def _spec_like(x: DTensor, placements: tuple) -> Any:
    return DTensorSpec(x.device_mesh, placements, tensor_meta=x._spec.tensor_meta)


class _Interpreter:
    """Runs the joint graph over DTensors with the Plan's placements."""

    def __init__(self, gm: fx.GraphModule, plan: Plan, mesh: Any,
                 regather: frozenset[str] = frozenset(), prefetch: frozenset[str] = frozenset()
                 ) -> None:
        self.gm, self.plan, self.mesh, self.regather = gm, plan, mesh, regather
        self.prefetch = prefetch | regather  # the chains whose gathers are marked
        self.layer = ""  # the layer of the node being lowered (which a ZeRO-3 gather serves)
        self.placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.layout = layout_of_plan(plan)  # the sequence's chunk pairs over cp, if balanced
        # (values whose dims hold no sequence though split over cp: the experts' weights)
        self.unsequenced = expert_ops.weight_values(list(gm.graph.nodes)) if self.layout else ()

    def run(self, *locals_: torch.Tensor) -> list[torch.Tensor | None]:
        moved: dict[tuple, DTensor] = {}
        # forward outputs (the loss, a pipeline stage's activations) are moved to their output
        # placement as soon as they exist, in the forward: a backward consumer may share the
        # move. The other outputs (gradients) too: a gradient is reduced as soon as it is
        # computed, so its unreduced copy dies there (with ZeRO, the reduce-scatter frees the
        # full one); the plan's gradient buckets are reduced together (GradientBuckets).
        early, late = output_moves(self.gm)
        buckets = GradientBuckets(self.plan.grad_buckets, self.mesh)
        env: dict[str, Any] = _LazyInputs(self, dict(zip((n.name for n in self.placeholders), locals_)))
        for n in self.gm.graph.nodes:
            if n.op == "get_attr":
                env[n.name] = DTensor.from_local(getattr(self.gm, n.target), self.mesh,
                                                 tuple(Replicate() for _ in self.mesh.shape),
                                                 run_check=False)
            elif n.op == "call_function" and n.target is operator.getitem:
                env[n.name] = env[n.args[0].name][n.args[1]]
                if n.name in late:
                    with torch.fx.traceback.set_current_meta(n):
                        self._move_late(n, late[n.name], env, moved, buckets)
            elif n.op == "call_function":
                try:
                    # the local nodes (and the collectives feeding them) keep the joint node's
                    # metadata, "partitioner_tag" included: the forward/backward split needs it
                    self.layer = self.plan.nodes[n.name].layer
                    with torch.fx.traceback.set_current_meta(n), \
                            marked(REGATHER, self.layer if n.name in self.prefetch else None):
                        env[n.name] = self._call(n, env, moved)
                        if n.name in early:
                            self._get(n, placements_of(self.plan.output_placements[early[n.name]]), env, moved)
                        elif n.name in late:
                            self._move_late(n, late[n.name], env, moved, buckets)
                except Exception as e:
                    choice = self.plan.nodes[n.name]
                    raise RuntimeError(
                        f"lowering node {n.name} ({n.target}) with inputs {choice.inputs} and "
                        f"outputs {choice.outputs} failed: {type(e).__name__}: {e}") from e
            elif n.op == "output":
                return self._outputs(n, env, moved, buckets)
        raise AssertionError("graph without output")

    def _move_late(self, n: fx.Node, index: int, env: dict, moved: dict,
                   buckets: "GradientBuckets") -> None:
        dst = placements_of(self.plan.output_placements[index])
        if index in buckets:
            buckets.add(index, env[n.name], dst, _owned(n))
        else:
            self._get(n, dst, env, moved)

    def _get(self, a: fx.Node, dst: tuple, env: dict, moved: dict) -> DTensor:
        key = (a.name, dst)
        if key not in moved:
            with marked(REGATHER, self.layer if a.name in self.prefetch else None):  # ZeRO's copy
                moved[key] = reshard(env[a.name], dst, self.mesh, self._layout(a))
        return moved[key]

    def _regathered(self, a: fx.Node, dst: tuple, env: dict, moved: dict) -> DTensor:
        """ZeRO-3 (``regather``, :func:`autopar.capture.remat.regathered_nodes`): ``a`` made
        again for a backward reader, from its parameter's shard, with its own moves (the
        forward's gathered copy is not read, so it dies after its last forward reader); once
        per (value, placement) in the backward."""
        key = ("backward", a.name, dst)
        if key in moved:
            return moved[key]
        with marked(REGATHER, self.layer):
            if a.op == "placeholder":
                value = env[a.name]
            elif ("backward", a.name) in moved:
                value = moved[("backward", a.name)]
            else:
                value = moved[("backward", a.name)] = self._call(a, env, moved, backward=True)
            moved[key] = reshard(value, dst, self.mesh, self._layout(a))
        return moved[key]

    def _layout(self, a: fx.Node) -> SequenceLayout | None:
        """The balanced layout, for the values ``a`` whose split over cp is a sequence's."""
        return None if a.name in self.unsequenced else self.layout

    def _call(self, n: fx.Node, env: dict, moved: dict, backward: bool | None = None) -> Any:
        choice = self.plan.nodes[n.name]
        tensor_inputs = [a for a in _tensor_leaves(n)]
        targets = {id_: placements_of(p) for id_, p in zip(range(len(tensor_inputs)), choice.inputs)}
        counter = iter(range(len(tensor_inputs)))
        again = self.regather if (is_backward(n) if backward is None else backward) else ()

        def fetch(a: Any) -> Any:
            if isinstance(a, fx.Node):
                if a.name in again:
                    return self._regathered(a, targets[next(counter)], env, moved)
                return self._get(a, targets[next(counter)], env, moved)
            return a

        args = _map_tensor_args(n.args, fetch)
        kwargs = {k: fetch(v) if isinstance(v, fx.Node) else v for k, v in n.kwargs.items()}
        if fused.needs_local(n.target, [placements_of(p) for p in choice.inputs],
                             [placements_of(o) if o is not None else None for o in choice.outputs]):
            outs = [placements_of(o) for o in choice.outputs]
            return fused.run_local(n.target, args, outs, self.mesh, n.meta["val"])
        if expert_ops.needs_local(n.target, [placements_of(p) for p in choice.inputs]):
            return expert_ops.run_local(n, args, [placements_of(o) for o in choice.outputs],
                                        self.mesh)
        if ring_attention.needs_ring(n.target, [placements_of(p) for p in choice.inputs]):
            return ring_attention.run_ring(n, args, kwargs, _out_placements(choice), self.mesh,
                                           self.layout)
        if seq_attention.needs_local(n.target, [placements_of(p) for p in choice.inputs], n.args):
            return seq_attention.run_local(n, args, kwargs, _out_placements(choice), self.mesh,
                                           self.layout)
        if not tensor_inputs or not private.has_rule(n.target):
            # factory ops and ops without a rule: the plan replicates them; run on full tensors
            return _run_replicated(n, args, kwargs, self.mesh)
        if n.target in VIEW_OPS:
            return _local_view(n, args[0], placements_of(choice.outputs[0]), self.mesh, self.layout)
        if n.target is torch.ops.aten.expand.default and _strided(choice.outputs[0]):
            return _local_expand(n, args[0], placements_of(choice.outputs[0]), self.mesh)
        if n.target in NEW_FACTORIES:  # (new_empty_strided: DTensor's, its strides global)
            return _local_factory(n, args, kwargs, placements_of(choice.outputs[0]), self.mesh)
        if _all_replicated(choice) and not _seeded(n.target):
            # nothing to move and nothing sharded: the op on the full tensors, without DTensor's
            # dispatch (whose rules give no spec to some outputs, such as CUDA attention's RNG
            # state, and none to its backward's inputs). Random ops stay with DTensor, which
            # keeps a replicated tensor's random numbers equal on every rank.
            return _run_replicated(n, args, kwargs, self.mesh)
        out = n.target(*args, **kwargs)
        return self._check(n, out, choice.outputs)

    def _check(self, n: fx.Node, out: Any, planned: tuple) -> Any:
        """``out`` in the plan's placements. Where DTensor's dispatch chose another placement
        than the plan (a rule whose choice the plan could not foresee), the output is moved to
        the plan's with the cheapest legal steps, and a warning names the node and the move: the
        program runs, with a collective more than the plan counts."""
        outs = out if isinstance(out, (tuple, list)) else [out]
        fixed = list(outs)
        for i, (o, p) in enumerate(zip(outs, planned)):
            if type(o) is not DTensor and isinstance(o, torch.Tensor) and p is not None and \
                    all(isinstance(q, Replicate) for q in placements_of(p)):
                # DTensor returns a tensor it gives no spec as it is (CUDA attention's RNG state
                # and empty cum_seq outputs); the plan replicates them (strategies.space)
                fixed[i] = DTensor.from_local(o, self.mesh, placements_of(p), run_check=False)
            elif isinstance(o, DTensor) and p is not None and tuple(o.placements) != placements_of(p):
                dst = placements_of(p)
                if self.layout is not None and o.placements[self.layout.axis] != dst[self.layout.axis]:
                    # DTensor's own moves on cp did not arrange: the values would be wrong
                    raise NotImplementedError(
                        f"lowering {n.name} ({n.target}): DTensor placed output {i} as "
                        f"{tuple(o.placements)} on its own, the plan as {p}, and the plan holds "
                        f"the sequence in balanced chunk pairs over cp, which DTensor's moves do "
                        f"not follow. Use Config(cp_layout='contiguous'), and please report this "
                        f"with the model.")
                steps = reshard_steps(tuple(o.placements), dst, tuple(o.shape), o.element_size(),
                                      tuple(self.mesh.shape))
                warnings.warn(
                    f"lowering {n.name} ({n.target}): DTensor placed output {i} as "
                    f"{tuple(o.placements)}, the plan as {p}; moved to the plan's placement with "
                    f"{[s.kind for s in steps]}, which the plan's collectives do not count. "
                    f"Please report this with the model.", RuntimeWarning, stacklevel=2)
                fixed[i] = reshard(o, dst, self.mesh, self.layout)
        if not isinstance(out, (tuple, list)):
            return fixed[0]
        return out if all(a is b for a, b in zip(fixed, outs)) else type(out)(fixed)

    def _outputs(self, n: fx.Node, env: dict, moved: dict,
                 buckets: "GradientBuckets") -> list[torch.Tensor | None]:
        res: list[torch.Tensor | None] = []
        for i, a in enumerate(n.args[0]):
            if a is None:
                res.append(None)
                continue
            if i in buckets:
                with torch.fx.traceback.set_current_meta(a):  # (a backward node's tags)
                    res.append(buckets.result(i))
                continue
            target = placements_of(self.plan.output_placements[i])
            res.append(self._get(a, target, env, moved).to_local())
        return res


def _owned(n: fx.Node) -> bool:
    """Whether joint-graph node ``n`` (a graph output) and every tensor it views are read by
    nothing but the next in that chain (and ``n`` by the output alone): the ops' schemas say
    which outputs alias an input (views: ``Tensor(a)``); any other op makes a new tensor."""
    while len(n.users) == 1 and n.op == "call_function":
        schema = getattr(n.target, "_schema", None)
        if schema is None or not schema.returns:
            return False
        if schema.returns[0].alias_info is None and not schema.is_mutable \
                and n.target is not torch.ops.aten._unsafe_view.default:  # (a view, unannotated)
            return True  # a new tensor
        if not n.args or not isinstance(n.args[0], fx.Node):
            return False
        n = n.args[0]
    return False


class _LazyInputs(dict):
    """The interpreter's values; an input becomes a DTensor where it is first read.

    Wrapping every input up front would put the wrapping of the loss's tangent before the
    forward, where the forward/backward partitioner (which splits by position) takes it for
    forward work that depends on the tangent.
    """

    def __init__(self, interp: "_Interpreter", inputs: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.interp, self.inputs = interp, inputs
        self.nodes = {n.name: n for n in interp.placeholders}

    def __missing__(self, name: str) -> DTensor:
        if name not in self.inputs:
            raise KeyError(name)
        n = self.nodes[name]
        p = placements_of(self.interp.plan.nodes[name].outputs[0])
        val = n.meta["val"]
        self[name] = DTensor.from_local(self.inputs[name], self.interp.mesh, p, run_check=False,
                                        shape=val.shape, stride=val.stride())
        return self[name]


def _strided(placements: Sequence[str] | None) -> bool:
    return placements is not None and any(p.startswith("SS(") for p in placements)


def _local_expand(n: fx.Node, x: DTensor, out_placements: tuple, mesh: Any) -> DTensor:
    """``expand`` of a strided-sharded tensor on the local shard (the plan keeps the strided
    dims as they are: only whole size-1 dims grow). DTensor 2.12's dispatch computes a strided
    shard's local shape with ``.tolist()``, which the lowering's fake tensors cannot give."""
    out = n.meta["val"]
    shape = local_shape(out.shape, out_placements, tuple(mesh.shape))
    return DTensor.from_local(x.to_local().expand(list(shape)), mesh, out_placements,
                              run_check=False, shape=out.shape, stride=out.stride())


def _local_view(n: fx.Node, x: DTensor, out_placements: tuple, mesh: Any,
                layout: SequenceLayout | None = None) -> DTensor:
    """A view executed on the local shard with the planned output placement.

    The strategy came from DTensor's own view rule when planning; at run time DTensor's dispatch
    may prefer another one (e.g. reduce a ``Partial`` first), which would add a collective the
    plan does not have. The local shape follows from the global output shape and the planned
    placement; ``reshape`` copies only if the local layout cannot be viewed (after a reshard).
    """
    out = n.meta["val"]
    if layout is not None:  # a dim split on cp keeps its chunk pairs if both sides divide
        layout.follows(x.placements[layout.axis], x.shape)
        layout.follows(out_placements[layout.axis], out.shape)
    shape = local_shape(out.shape, out_placements, tuple(mesh.shape))
    local = torch.ops.aten.reshape.default(x.to_local(), list(shape))
    return DTensor.from_local(local, mesh, out_placements, run_check=False,
                              shape=out.shape, stride=out.stride())


def _local_factory(n: fx.Node, args: Any, kwargs: dict, out_placements: tuple, mesh: Any) -> DTensor:
    """A ``new_*`` op made locally in the planned output placement (no communication).

    DTensor's rule offers a replicated output or the input's placement, and its dispatch picks
    the input's whenever that is sharded, whichever the plan chose (an encoder-decoder's
    ``shift_tokens_right`` makes its ``new_zeros`` from batch-sharded ids). The values do not
    depend on the input, so the local block of the planned placement is made directly; a
    ``Partial`` output holds only for zeros (and uninitialised memory), whose sum is zeros.
    """
    partial = [p for p in out_placements if isinstance(p, Partial)]
    if partial and n.target not in (torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default):
        raise RuntimeError(f"internal: {n.name} ({n.target}) planned as {out_placements}: a "
                           f"Partial output of a filled tensor would sum its fill value over the "
                           f"ranks. Please report this with the model.")
    out = n.meta["val"]
    shape = local_shape(out.shape, out_placements, tuple(mesh.shape))
    x = args[0].to_local() if isinstance(args[0], DTensor) else args[0]
    local = n.target(x, list(shape), *args[2:], **kwargs)
    return DTensor.from_local(local, mesh, out_placements, run_check=False, shape=out.shape,
                              stride=out.stride())


def _out_placements(choice: Any) -> list[tuple | None]:
    """A node's planned output placements, ``None`` for an output without one."""
    return [placements_of(o) if o is not None else None for o in choice.outputs]


def _all_replicated(choice: Any) -> bool:
    """Whether a node's every input and output is replicated on every axis."""
    return all(all(t == "R" for t in p) for p in (*choice.inputs, *choice.outputs) if p is not None)


def _seeded(target: Any) -> bool:
    return isinstance(target, private.OpOverload) and \
        torch.Tag.nondeterministic_seeded in target.tags


def _run_replicated(n: fx.Node, args: Any, kwargs: dict, mesh: Any) -> Any:
    from autopar._torch_private import tree_map

    rep = tuple(Replicate() for _ in mesh.shape)
    unwrap = lambda x: x.to_local() if isinstance(x, DTensor) else x  # noqa: E731
    out = n.target(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    wrap = lambda t: DTensor.from_local(t, mesh, rep, run_check=False) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return tree_map(wrap, out)


def _tensor_leaves(n: fx.Node) -> list[fx.Node]:
    from autopar._torch_private import tree_flatten

    leaves, _ = tree_flatten(n.args)
    return [a for a in leaves if isinstance(a, fx.Node)] + [v for v in n.kwargs.values() if isinstance(v, fx.Node)]


def _map_tensor_args(args: Any, fn: Any) -> Any:
    if isinstance(args, (list, tuple)):
        return type(args)(_map_tensor_args(a, fn) for a in args)
    return fn(args)


def lower_to_local(gm: fx.GraphModule, plan: Plan, mesh: Any,
                   recompute: frozenset[str] = frozenset(),
                   regather: frozenset[str] = frozenset(),
                   prefetch: frozenset[str] = frozenset()) -> fx.GraphModule:
    """Trace the plan's per-rank program (see module docstring).

    ``recompute``: joint-graph nodes to recompute in the backward
    (:func:`autopar.passes.recompute.recompute_nodes` of the plan's policy); their local nodes
    are tagged while tracing and :func:`~autopar.passes.recompute.recompute_pass` rewrites the
    program. ``regather``: ZeRO-3's parameters and their views and casts
    (:func:`autopar.capture.remat.regathered_nodes`), made again from the shards, with their
    gathers, for their backward readers. ``prefetch``: ZeRO-1/2's chains, whose gathers are
    issued a layer ahead and bucketed as ZeRO-3's are (``capture.remat.zero_gathers``). Last, :func:`~autopar.passes.overlap.overlap_collectives` issues each collective
    as soon as its input exists and waits for it where its result is first needed, and
    :func:`~autopar.passes.gather_buckets.bucket_gathers` merges each layer's ZeRO-3 gathers
    into one flat all-gather.
    """
    tagged = [n for n in gm.graph.nodes if n.name in recompute]
    for n in tagged:
        n.meta[TAG] = True
    try:
        local = _trace_local(gm, plan, mesh, regather, prefetch)
    finally:
        for n in tagged:
            n.meta.pop(TAG, None)
    local = recompute_pass(local, bool(regather)) if tagged else local
    if not regather and not prefetch:
        return overlap_collectives(local)
    return bucket_gathers(overlap_collectives(prefetch_gathers(local)))


def _trace_local(gm: fx.GraphModule, plan: Plan, mesh: Any,
                 regather: frozenset[str] = frozenset(), prefetch: frozenset[str] = frozenset()
                 ) -> fx.GraphModule:
    interp = _Interpreter(gm, plan, mesh, regather, prefetch)
    mesh_shape = tuple(mesh.shape)
    with FakeTensorMode(allow_non_fake_inputs=True):
        fakes = []
        for n in interp.placeholders:
            val = n.meta["val"]
            p = placements_of(plan.nodes[n.name].outputs[0])
            fakes.append(torch.empty(local_shape(val.shape, p, mesh_shape), dtype=val.dtype,
                                     device=val.device))
        with torch.fx.traceback.preserve_node_meta():
            local = make_fx(interp.run)(*fakes)
    # DTensor's first dispatch of an op may run it on fake tensors of its own to learn the
    # output's metadata (torch 2.11, CUDA attention), which the trace records: pure aten calls
    # whose results nothing reads go (the collectives stay, read or not)
    local.graph.eliminate_dead_code(is_impure_node=_kept)
    local.recompile()
    return local


def _kept(n: fx.Node) -> bool:
    """Whether dead-code elimination keeps ``n`` although nothing reads it: anything but a pure
    aten call or an item of one's results (a random op nothing reads goes too: the attention
    kernels are tagged random for their dropout)."""
    pure = n.target is operator.getitem or \
        (isinstance(n.target, private.OpOverload) and n.target.namespace == "aten")
    return n.is_impure(impure_random=False) or not pure
