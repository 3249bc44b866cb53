"""The collectives of a plan, listed by walking the graph as the lowering runs it, with their
times and where each is issued and needed (for the overlapped step time)."""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch.fx as fx

from autopar.cost_models.comm import axis_collective_time, axis_strides
from autopar.cost_models.experts import experts_exchanges
from autopar.cost_models.ring import ring_exchanges
from autopar.cost_models.overlap import Comm
from autopar.cost_models.sharding import step_end_buckets
from autopar.graph import TracedGraph, output_moves
from autopar.mesh import Mesh
from autopar.placements import from_str
from autopar.plan import Collective, NodePlan
from autopar.capture.layers import node_phase
from autopar.capture.remat import GatherRuns, gather_bucket_key, is_random
from autopar.strategies.rules import EXPERT_OPS, SEQUENCE_ATTENTION_QUERY
from autopar.strategies.space import tensor_inputs
from autopar.strategies.reshard import reshard_steps

__all__ = ["StepCollectives", "step_collectives", "step_end_reductions"]


@dataclass
class StepCollectives:
    """What :func:`step_collectives` finds: the collectives in execution order, their total and
    forward seconds, the seconds each node needs (a graph output's move counts for the node
    computing it) and one :class:`Comm` per collective."""

    collectives: list[Collective] = field(default_factory=list)
    total_s: float = 0.0
    forward_s: float = 0.0
    per_node: dict[str, float] = field(default_factory=dict)
    comms: list[Comm] = field(default_factory=list)


class _Walk:
    def __init__(self, traced: TracedGraph, shape: Sequence[int], names: Sequence[str],
                 nodes: dict[str, NodePlan], outputs: Sequence, mesh: Mesh,
                 regather: frozenset[str] = frozenset(), tagged: frozenset[str] = frozenset(),
                 prefetch: frozenset[str] = frozenset()) -> None:
        self.traced, self.shape, self.names, self.nodes = traced, tuple(shape), names, nodes
        self.outputs, self.mesh = outputs, mesh
        self.chains, self.tagged = regather, tagged  # ZeRO-3's chains; recomputed nodes
        self.prefetch = prefetch | regather  # the chains whose gathers are prefetched
        self.strides = axis_strides(self.shape)
        self.done: set[tuple[str, tuple]] = set()
        self.res = StepCollectives()
        self.previous: str | None = None  # the node computed last
        # ZeRO-3's prefetch of parameter gathers, per part (capture.remat.GatherRuns), and the
        # order of each collective on the channel: (index it is issued at, after that index's
        # own, index made)
        self.runs = {"forward": GatherRuns(), "backward": GatherRuns()}
        self.order: list[tuple[int, int, int]] = []
        # per collective: its flat-bucket key (a ZeRO-3 gather's, else None), who needs it, seconds
        self.merge: list[tuple[tuple | None, str, float]] = []
        self.after_comm: set = set()  # ZeRO chain values made from a collective's result

    def steps(self, arg: fx.Node, dst: tuple[str, ...]) -> list:
        val = arg.meta["val"]
        return reshard_steps(tuple(map(from_str, self.nodes[arg.name].outputs[0])),
                             tuple(map(from_str, dst)), tuple(val.shape), val.element_size(),
                             self.shape)

    def add(self, kind: str, axis: int, nbytes: float, phase: str, layer: str, consumer: str,
            who: str, start_after: str | None, gather: Any = None, bucket: bool = False,
            priced: bool = True) -> None:
        """One collective; ``gather``: the dtype of a ZeRO parameter gather, issued where
        :class:`~autopar.capture.remat.GatherRuns` says; ``bucket``: merged with the gathers
        next to it by :func:`~autopar.capture.remat.gather_bucket_key` (:func:`_merge_buckets`:
        a gather reading no other collective's result, as ``passes.gather_buckets`` merges);
        ``priced`` False: one an op runs inside itself, whose time its node's compute holds."""
        index = len(self.res.comms)
        key = (index, 0, index)
        if gather is not None:
            (at, start_after), ahead = self.runs[phase].issue(layer, (index, start_after))
            key = (at, int(ahead), index)
        self.order.append(key)
        self.res.collectives.append(Collective(kind, self.names[axis], int(nbytes), phase, layer,
                                               consumer))
        t = axis_collective_time(kind, nbytes, self.shape[axis], self.strides[axis],
                                 self.mesh.topology) if priced else 0.0
        self.res.total_s += t
        self.res.forward_s += t if phase == "forward" else 0.0
        self.res.per_node[who] = self.res.per_node.get(who, 0.0) + t
        self.res.comms.append(Comm(start_after, None if consumer == "output" else consumer, t))
        merged = (gather_bucket_key(phase, layer, axis, gather)
                  if gather is not None and bucket and kind == "all_gather" else
                  _CUT if gather is not None else None)
        self.merge.append((merged, who, t))

    def _add_steps(self, arg: fx.Node, dst: tuple[str, ...], phase: str, layer: str,
                   consumer: str, who: str, start: str | None, after_comm: bool) -> None:
        """The collectives of ``arg``'s move to ``dst``; of a ZeRO chain's, the first is a
        bucketed gather unless ``after_comm`` (the value moved was made from a collective's)."""
        chain = arg.name in self.prefetch
        for s in self.steps(arg, dst):
            if s.kind != "local":
                self.add(s.kind, s.axis, s.nbytes, phase, layer, consumer, who, start,
                         arg.meta["val"].dtype if chain else None, chain and not after_comm)
                after_comm = True

    def note_chain(self, n: fx.Node) -> None:
        """ZeRO chain node ``n`` (a view or cast of a parameter) is computed: whether its value
        is made from a collective's result (then its own gathers are not bucketed)."""
        for a, dst in zip(tensor_inputs(n), self.nodes[n.name].inputs):
            if a.name in self.after_comm or (a.name in self.prefetch
                                             and self.communicates(a, tuple(dst))):
                self.after_comm.add(n.name)

    def move(self, arg: fx.Node, dst: tuple[str, ...], phase: str, layer: str,
             consumer: str) -> None:
        """The collectives moving ``arg`` to ``dst`` for ``consumer``; issued (as the overlap
        pass does) right after ``arg`` is computed when it is an op of the same part of the
        step, else right before the consumer."""
        if (arg.name, dst) in self.done:
            return
        self.done.add((arg.name, dst))
        same_part = arg.op == "call_function" and node_phase(arg) == phase
        start = arg.name if same_part else self.previous
        who = arg.name if consumer == "output" else consumer
        self._add_steps(arg, dst, phase, layer, consumer, who, start, arg.name in self.after_comm)

    def regather(self, a: fx.Node, dst: tuple[str, ...], layer: str, consumer: str) -> None:
        """ZeRO-3: ``a`` made again for backward reader ``consumer`` from its parameter's
        shard (``passes.lower``'s ``_regathered``: the chain's own moves, then ``a``'s to
        ``dst``, once per value and placement in the backward), issued before the reader."""
        key = ("backward", a.name, dst)
        if key in self.done:
            return
        self.done.add(key)
        if a.op != "placeholder" and ("backward", a.name) not in self.done:
            self.done.add(("backward", a.name))
            for inp, src_dst in zip(tensor_inputs(a), self.nodes[a.name].inputs):
                self.regather(inp, src_dst, layer, consumer)
                if ("backward", inp.name) in self.after_comm or self.communicates(inp, tuple(src_dst)):
                    self.after_comm.add(("backward", a.name))
        self._add_steps(a, dst, "backward", layer, consumer, consumer, self.previous,
                        ("backward", a.name) in self.after_comm)

    def recompute(self, x: fx.Node, layer: str, consumer: str) -> None:
        """ZeRO-3 under recomputation: the gathers of recomputed ``x``'s copy, made right
        before backward ``consumer`` (``passes.recompute``): a parameter it reads is gathered
        again (shared with the backward's readers), a recomputed input whose move is local is
        recomputed too; an input moved by a collective is read as saved."""
        if ("recomputed", x.name) in self.done:
            return
        self.done.add(("recomputed", x.name))
        if x.target is operator.getitem:  # an output of its source, which is recomputed
            if x.args[0].name in self.tagged:
                self.recompute(x.args[0], layer, consumer)
            return
        for inp, dst in zip(tensor_inputs(x), self.nodes[x.name].inputs):
            if inp.name in self.chains:  # (marked with x's layer, as the copy of x's move)
                self.regather(inp, tuple(dst), self.traced.node_layer.get(x.name, ""), consumer)
            elif inp.name in self.tagged and not self.communicates(inp, tuple(dst)):
                self.recompute(inp, layer, consumer)

    def communicates(self, arg: fx.Node, dst: tuple[str, ...]) -> bool:
        """Whether moving ``arg`` to ``dst`` takes a collective."""
        return any(s.kind != "local" for s in self.steps(arg, dst))

    def bucket(self, members: Sequence[int], args: dict[int, fx.Node], layer: str) -> None:
        """A gradient bucket's one all-reduce or reduce-scatter, issued when its last gradient
        is computed."""
        first = None
        nbytes = 0
        for i in members:
            self.done.add((args[i].name, self.outputs[i]))
            (step,) = self.steps(args[i], self.outputs[i])
            first, nbytes = step if first is None else first, nbytes + step.nbytes
        last = args[members[-1]].name
        self.add(first.kind, first.axis, nbytes, "backward", layer, "output", last, last)


def _ring_messages(walk: _Walk, n: fx.Node, phase: str, layer: str, recomputed: bool) -> None:
    """Ring attention's sends and receives, which the op runs inside itself (none for the other
    forms); a recomputed forward runs them again in the backward (``passes.recompute`` copies
    the op)."""
    ins = tensor_inputs(n)
    messages = ring_exchanges(n.target, [tuple(map(from_str, p)) for p in walk.nodes[n.name].inputs],
                              [tuple(a.meta["val"].shape) for a in ins],
                              ins[0].meta["val"].element_size(), walk.shape)
    for again in ((phase, "backward") if recomputed else (phase,)):
        for kind, axis, nbytes in messages:
            walk.add(kind, axis, nbytes, again, layer, n.name, n.name, walk.previous,
                     priced=False)


def step_collectives(traced: TracedGraph, shape: Sequence[int], names: Sequence[str],
                     nodes: dict[str, NodePlan], outputs: Sequence, mesh: Mesh,
                     buckets: tuple[tuple[int, ...], ...] = (),
                     regather: frozenset[str] = frozenset(),
                     recompute: frozenset[str] = frozenset(),
                     prefetch: frozenset[str] = frozenset()) -> StepCollectives:
    """Walk the graph as the lowering does and list every collective (deduplicated moves);
    the gradients of a bucket (:mod:`autopar.planning.buckets`) make one all-reduce, where the
    last of them is computed. ``regather``: ZeRO-3's chains
    (:func:`autopar.capture.remat.regathered_nodes`), gathered again for backward readers and
    for the copies of the ``recompute`` nodes that read them (``capture.remat.recompute_nodes``);
    ``prefetch``: ZeRO-1/2's chains, whose gathers are issued a layer ahead and bucketed as
    ZeRO-3's are (``capture.remat.zero_gathers``)."""
    tagged = frozenset(n.name for n in traced.gm.graph.nodes if n.name in recompute
                       and n.op == "call_function" and not is_random(n)) if regather else frozenset()
    walk = _Walk(traced, shape, names, nodes, outputs, mesh, regather, tagged, prefetch)
    out_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
    early, late = output_moves(traced.gm)
    bucket_of = {i: b for b in buckets for i in b}
    args = dict(enumerate(out_node.args[0]))
    for n in traced.gm.graph.nodes:
        layer = traced.node_layer.get(n.name, "")
        if n.op == "call_function" and n.target is not operator.getitem:
            phase = node_phase(n)
            if phase == "backward" and tagged:  # the recomputed copies made before n
                for a, dst in zip(tensor_inputs(n), nodes[n.name].inputs):
                    if a.name in tagged and not ((a.name, tuple(dst)) in walk.done
                                                 and walk.communicates(a, tuple(dst))):
                        walk.recompute(a, layer, n.name)
            for a, dst in zip(tensor_inputs(n), nodes[n.name].inputs):
                if phase == "backward" and a.name in regather:
                    walk.regather(a, tuple(dst), layer, n.name)
                else:
                    walk.move(a, dst, phase, layer, n.name)
            if n.target in EXPERT_OPS:  # (its all-to-alls, inside it, priced as its compute)
                val = tensor_inputs(n)[0].meta["val"]
                for kind, axis, nbytes in experts_exchanges(
                        n.target, [tuple(map(from_str, p)) for p in nodes[n.name].inputs],
                        [tuple(a.meta["val"].shape) for a in tensor_inputs(n)],
                        val.element_size(), walk.shape):
                    walk.add(kind, axis, nbytes, phase, layer, n.name, n.name, walk.previous,
                             priced=False)
            if n.target in SEQUENCE_ATTENTION_QUERY:  # (ring attention's sends, inside it too)
                _ring_messages(walk, n, phase, layer, n.name in recompute and not is_random(n))
            if n.name in walk.prefetch and phase == "forward":
                walk.note_chain(n)
            if n.name in early:
                walk.move(n, outputs[early[n.name]], "forward", layer, "output")
        if n.op == "call_function" and n.name in late:
            bucket = bucket_of.get(late[n.name])
            if bucket is None:
                walk.move(n, outputs[late[n.name]], "backward", layer, "output")
            elif bucket[-1] == late[n.name]:
                walk.bucket(bucket, args, layer)
        elif n.op == "output":
            for i, a in enumerate(n.args[0]):
                if a is not None:
                    is_fwd = i == traced.loss_output_index or i in traced.boundary_outputs
                    walk.move(a, outputs[i], "forward" if is_fwd else "backward",
                              traced.node_layer.get(a.name, ""), "output")
        if n.op == "call_function":
            walk.previous = n.name
    order = sorted(range(len(walk.order)), key=walk.order.__getitem__)  # the channel's order
    walk.res.comms = [walk.res.comms[i] for i in order]
    walk.res.collectives = [walk.res.collectives[i] for i in order]
    walk.merge = [walk.merge[i] for i in order]
    return _merge_buckets(walk.res, walk.merge, shape, mesh)


# the merge key of a ZeRO chain's later step (it reads a gather's result): the runtime has
# waited for that gather before issuing it, so no gather after it joins the run before it
_CUT = ("cut",)


def _merge_buckets(res: StepCollectives, merge: list[tuple[tuple | None, str, float]],
                   shape: Sequence[int], mesh: Mesh) -> StepCollectives:
    """ZeRO's flat gather buckets (the runtime's ``passes.gather_buckets``): consecutive
    bucketed gathers (in the channel's order; the other collectives between them do not
    count) with one bucket key become one all-gather of their bytes, listed where the first
    was, needed by the first of them (its node waits for all of them), priced as one
    collective. A chain's later step (a parameter sharded over two data axes, gathered over
    one then the other) ends the run: it reads the run's gather, which the runtime waits for
    first, and the runtime cuts a run at a member's first wait."""
    strides = axis_strides(shape)
    out = StepCollectives(per_node=dict(res.per_node))
    last_key, first, first_who = None, 0, ""
    for c, comm, (key, who, t) in zip(res.collectives, res.comms, merge):
        out.per_node[who] -= t
        if key is _CUT:
            last_key, key = None, None
        if key is not None and key == last_key:
            prev = out.collectives[first]
            axis = key[2]  # (the mesh axis: the gather's process group)
            t = axis_collective_time("all_gather", prev.bytes + c.bytes, shape[axis],
                                     strides[axis], mesh.topology)
            out.per_node[first_who] += t - out.comms[first].seconds
            out.collectives[first] = dataclasses.replace(prev, bytes=prev.bytes + c.bytes)
            out.comms[first] = dataclasses.replace(out.comms[first], seconds=t)
            continue
        out.per_node[who] += t
        out.collectives.append(c)
        out.comms.append(comm)
        if key is not None:
            last_key, first, first_who = key, len(out.collectives) - 1, who
    out.total_s = sum(c.seconds for c in out.comms)
    out.forward_s = sum(m.seconds for c, m in zip(out.collectives, out.comms)
                        if c.phase == "forward")
    return out


def step_end_reductions(stages: list, plans: list, pp: int, cand: Any, mesh: Mesh,
                        stored: Sequence[dict[str, tuple[str, ...]]] | None = None,
                        regathers: int = 0) -> tuple[list[Collective], float, list[float]]:
    """The data-parallel collectives a pipeline runs once a step per stage and bucket of the
    gradients the stage left unreduced (:func:`autopar.cost_models.sharding.step_end_buckets`,
    the runtime's buckets): an all-reduce issued when the stage's last backward is done; with
    ZeRO-1 (a stage's parameters ``stored`` sharded where its program replicates them) a
    reduce-scatter there, and an all-gather of the parameters before the stage's first forward.
    With ZeRO-3 (``regathers``: the step's microbatches) the parameters are gathered for every
    microbatch's forward and again for its backward instead: ``regathers`` of each, whose
    seconds are in the stage's time (the third value, per stage: one gather's), not the
    step end's. Also the seconds of the busiest pipeline rank's step-end collectives, one after
    another (an upper bound: a rank's earlier stages' buckets overlap its later backward).
    ``stages``: ``(StageGraph, TracedGraph)`` pairs, ``plans`` their plans, ``stored`` their
    parameters' placements between steps (default: as the plans place them), ``cand`` the
    stage mesh."""
    collectives: list[Collective] = []
    seconds = [0.0] * pp
    per_gather = [0.0] * len(stages)
    strides = [math.prod(cand.shape[a + 1:]) for a in range(len(cand.shape))]
    for j, ((st, traced), plan) in enumerate(zip(stages, plans)):
        kept = stored[j] if stored is not None else None
        for bucket in step_end_buckets(traced, plan.output_placements, plan.params, cand.shape, kept):
            gather = bucket.kind == "all_gather"
            what = f"{len(bucket.params)} {'parameters' if gather else 'gradients'}"
            t = axis_collective_time(bucket.kind, bucket.bytes, cand.shape[bucket.axis],
                                     strides[bucket.axis], mesh.topology)
            if gather and regathers:
                for phase in ("forward", "backward"):
                    collectives += [Collective("all_gather", cand.names[bucket.axis], bucket.bytes,
                                               phase, "", what, st.index)] * regathers
                per_gather[j] += t
                continue
            collectives.append(Collective(bucket.kind, cand.names[bucket.axis], bucket.bytes,
                                          "forward" if gather else "backward", "", what, st.index))
            seconds[st.index % pp] += t
            for axis in bucket.then:  # (hybrid sharding: the shard summed across the replicas)
                collectives.append(Collective("all_reduce", cand.names[axis], bucket.then_bytes,
                                              "backward", "", what, st.index))
                seconds[st.index % pp] += axis_collective_time(
                    "all_reduce", bucket.then_bytes, cand.shape[axis], strides[axis], mesh.topology)
    return collectives, max(seconds), per_gather
