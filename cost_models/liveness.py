"""Peak memory of one rank's training step: a liveness walk of the program the plan lowers to.

The per-node memory the ILP sums (``cost_models.sharding``) counts every saved forward value at
its producer's placement, alive at the end of the forward. The program that runs
(``passes.lower`` walking the joint graph with the plan's placements, then
``passes.recompute`` and ``passes.overlap``) holds other bytes at its peak, measured with
``autopar.runtime.memory`` on the test GPT (dim 256, 4 layers, tp=2 / dp=2):

- a value read in another placement than its producer's is moved into a new buffer (a
  collective's output, or a local slice, which DTensor clones); the lowering keeps one moved copy
  per (value, placement) and the backward reads that copy, so a saved matmul input is held
  gathered (tp times its sequence-sharded size) and the sharded original is freed after the move;
- the backward's own buffers (input and weight gradients, gathered gradients) are alive beside
  the saved values at its start;
- the step's gradients are program outputs, alive from where they are computed to the end of
  the step, beside the ``p.grad`` buffers (kept allocated between steps; the runtime adds each
  output into its ``p.grad`` after the program, one new tensor at a time);
- a collective is issued right after its input is computed (``passes.overlap``), so its output
  is alive from there; one collective's output may outlive its last reader (it is freed once
  its wait has run, which races with what runs next: seen as a 1 MiB difference between runs of
  the same dp=2 x tp=2 ZeRO step on 4 ranks), so the largest one is added to the peak;
- with recomputation, a recomputed value's forward copy dies after its last forward reader and
  its copy is made right before its first backward reader (with the values it needs that are
  recomputed too); a collective's output is never recomputed but saved (``capture.remat``);
- with ZeRO-3 a backward reader of a parameter, or of a view or cast of one, reads a copy made
  again from the shard right before it (with its gathers), so the forward's gathered copy dies
  after its last forward reader (``passes.lower``'s ``_regathered``); a recomputed op reading
  one reads that copy too, made before its recomputation (``passes.recompute``), once per
  value and placement in the backward; each layer's gathers are issued while the layer before
  it computes (``passes.overlap.prefetch_gathers``, ``capture.remat.GatherRuns``), so their
  outputs are alive from there.

:func:`step_memory` walks the joint graph in program order with these rules and returns the
peak of the live bytes plus the persistent training state. The joint graph's order is the
program's, up to the overlap pass moving waits (no memory) and collectives (modelled here).
Not modelled: buffers inside one op (kernel workspaces), a reshard's short-lived intermediate
copies (e.g. the flat all-gather output before its ``cat``), and the optimizer's temporaries
(they are alive after the program, when the activations are freed).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx
from torch.distributed.tensor import Shard

from autopar.capture.layers import is_backward
from autopar.capture.remat import GatherRuns, is_random
from autopar.cost_models.rank_bytes import persistent_bytes, weight_stash_bytes
from autopar.cost_models.ring import ring_workspace_bytes
from autopar.graph import output_moves
from autopar.placements import from_str
from autopar.strategies.reshard import local_shape, reshard_steps
from autopar.strategies.rules import SEQUENCE_ATTENTION_QUERY
from autopar.strategies.space import tensor_inputs

__all__ = ["StageRun", "StepMemory", "step_memory"]


@dataclass(frozen=True)
class StageRun:
    """How a pipeline stage runs its program (``autopar.runtime.pipeline``), which changes
    what it holds. ``in_flight``: microbatches whose forward it has run and whose backward it
    has not, at most (each further one holds its saved values); ``microbatches``: a step's.
    The forward and backward are two graphs (``runtime.autograd.JointFunction``): the saved
    values a backward reads are held until it returns, not freed at their last reader; and
    over a step's microbatches the stage's gradients are summed into a second copy
    (``runtime.autograd.GradSink``, or its flat buckets) beside the one the backward makes.
    ``split_backward`` (zero-bubble, ``runtime.autograd.split_weight_backward``): the input
    gradients run first and the weight gradients later, so a microbatch in flight (counted up
    to its weight step) also holds the values the weight step reads from the input step
    (:func:`~autopar.cost_models.rank_bytes.weight_stash_bytes`); its weight step adds them into
    the same sum. ``zero_axes`` (ZeRO-1 once a step): the parameters
    are stored as ``cost_models.sharding.zero_once_placement`` over these axes of the placement the
    program computes with, with their gradients and optimizer states; the stage gathers them
    before its first forward (the gathered flat buffer and the parameters made from it, both
    alive then) and computes with the gathered copy through the step. ``regather`` (ZeRO-3):
    it gathers them for every microbatch's forward and again for its backward and frees them
    in between, so what it holds while another stage of its rank runs has no gathered copy."""

    in_flight: int = 1
    microbatches: int = 1
    split_backward: bool = False
    zero_axes: tuple[int, ...] = ()
    regather: bool = False


@dataclass(frozen=True)
class StepMemory:
    """Bytes per rank of one training step.

    ``peak_bytes``: ``persistent_bytes`` + the most program buffers alive at once;
    ``persistent_bytes``: what lives across steps (parameters, gradients and optimizer states of
    the local shards, inputs and buffers); ``saved_bytes``: the buffers alive from the forward
    into the backward (what each further microbatch in flight adds in a pipeline);
    ``held_bytes``: what a pipeline stage holds while another stage of its rank runs (the
    persistent bytes, the saved values of its microbatches in flight, its gradient sum);
    ``peak_node``: the joint-graph node at the peak; ``ahead_bytes``: a ZeRO-3 pipeline
    stage's (``StageRun.regather``) gather in flight while the action before it computes
    (``runtime.prefetch``: the flat buffer it fills and the packed shards it reads), which
    ``peak_bytes`` holds beside the stage's own gathered copy, else 0.
    """

    peak_bytes: float
    persistent_bytes: float
    saved_bytes: float
    held_bytes: float
    peak_node: str
    ahead_bytes: float = 0.0


@dataclass
class _Op:
    """The buffers one program op writes (one per tensor output). ``recipe``: the references
    it reads, for a recomputed op (``tagged``); ``copy``: its recomputed copy once made."""

    buffers: list[int]
    tagged: bool = False
    recipe: list[tuple[int, int]] = field(default_factory=list)
    copy: int | None = None
    # ZeRO-3: the (parameter chain node, placement, layer) its recomputed copy reads gathered
    # again (for a reader in that layer)
    regathered: list[tuple[fx.Node, tuple[str, ...], str]] = field(default_factory=list)
    # bytes it holds only while it runs (ring attention's blocks in flight and accumulators),
    # again when its recomputed copy runs
    workspace: float = 0.0


class _Walk:
    """Buffers (bytes, birth, last read) of the lowered program, in joint-graph steps."""

    def __init__(self, traced: Any, mesh_shape: Sequence[int], nodes: dict, tagged: frozenset,
                 stage: StageRun | None = None, regather: frozenset = frozenset(),
                 prefetch: frozenset = frozenset()):
        self.traced, self.mesh_shape, self.nodes, self.tagged = traced, tuple(mesh_shape), nodes, tagged
        self.regather = regather
        self.prefetch = prefetch | regather  # the ZeRO chains whose gathers are prefetched
        self.stage = stage
        self.size: list[float] = []
        self.born: list[int] = []
        self.last: list[int] = []
        self.ops: list[_Op] = []
        self.env: dict[str, Any] = {}
        self.moved: dict[tuple, tuple[int, int]] = {}
        self.step = 0
        self.forward_end = -1
        self.last_collective = 0
        self.largest_output = 0.0  # of a collective (not a bucket's, reduced in place)
        self.is_input: set[int] = set()
        self.placement_cache: dict[tuple[str, ...], tuple] = {}
        self.layer = ""  # of the node being walked
        self.runs = {False: GatherRuns(), True: GatherRuns()}  # ZeRO-3's prefetch, per part
        # ZeRO-3's flat gather buckets: per (part, run, axis, dtype), the gathered copies'
        # buffers with the step each is issued at, the run's first step and the group size
        self.gather_buckets: dict[tuple, list[tuple[int, int, int, int]]] = {}
        self.scattering: int | None = None  # the packed buffer of a reduce-scatter bucket

    # -- buffers and references -------------------------------------------------------------
    def new_op(self, sizes: Sequence[float], born: int, tagged: bool = False,
               recipe: Sequence[tuple[int, int]] = ()) -> int:
        """A new op writing one buffer per entry of ``sizes``, first alive at step ``born``."""
        ids = []
        for s in sizes:
            ids.append(len(self.size))
            self.size.append(float(s))
            self.born.append(born)
            self.last.append(born)
        self.ops.append(_Op(ids, tagged, list(recipe)))
        return len(self.ops) - 1

    def read(self, ref: tuple[int, int], at: int, backward: bool) -> None:
        """Keep the buffer ``ref`` points to alive until step ``at``. A backward read of a
        recomputed op reads its copy (``passes.recompute`` redirects exactly these reads)."""
        op_id, idx = ref
        if backward and self.ops[op_id].tagged:
            op_id = self.recomputed(op_id, at)
        b = self.ops[op_id].buffers[idx]
        self.last[b] = max(self.last[b], at)

    def recomputed(self, op_id: int, at: int) -> int:
        """The copy of a recomputed op, made at step ``at`` (right before its first backward
        reader) with its recomputed inputs copied too and its saved inputs read there."""
        op = self.ops[op_id]
        if op.copy is None:
            for r in op.recipe:
                self.read(r, at, True)
            for a, dst, layer in op.regathered:  # (ZeRO-3: passes.recompute's regather)
                self.read(self.regathered(a, dst, layer), at, True)
            op.copy = self.new_op([self.size[b] for b in op.buffers], at)
            if op.workspace:  # (at its first backward reader's step: erring high when that
                # reader is the ring's backward, whose own workspace comes after it at run time)
                self.new_op([op.workspace], at)
        return op.copy

    def placements(self, text: Sequence[str]) -> tuple:
        key = tuple(text)
        if key not in self.placement_cache:
            self.placement_cache[key] = tuple(from_str(t) for t in key)
        return self.placement_cache[key]

    def local_bytes(self, val: torch.Tensor, placements: Sequence[str]) -> float:
        """Bytes of ``val``'s local shard under ``placements`` (text form)."""
        shape = local_shape(tuple(val.shape), self.placements(placements), self.mesh_shape)
        return float(np.prod(shape, dtype=np.float64)) * val.element_size()

    # -- moves (passes.lower's ``_get``: one moved copy per value and placement) ---------------
    def move(self, a: fx.Node, dst: Sequence[str], tagged: bool, backward: bool) -> tuple[int, int]:
        """The reference a consumer reads ``a`` through in placement ``dst``: ``a`` itself, or
        a new buffer made once per (value, placement) by the reshard steps. ``tagged``: the
        consumer (whose metadata the move's ops carry) is recomputed, so the move's local ops
        are too, while its collective's output is saved."""
        key = (a.name, tuple(dst))
        if key not in self.moved:
            gather = self.layer if a.name in self.prefetch else None
            self.moved[key] = self._reshard(a, tuple(dst), tagged, backward, gather=gather)
        return self.moved[key]

    def regathered(self, a: fx.Node, dst: Sequence[str], layer: str) -> tuple[int, int]:
        """ZeRO-3: the reference a backward reader in ``layer`` reads ``a`` through, made
        again from its parameter's shard (``passes.lower``'s ``_regathered``): its chain's
        buffers and moves new at this step, once per value and placement in the backward."""
        key = ("backward", a.name, tuple(dst))
        if key not in self.moved:
            ref = self.env[a.name] if a.op == "placeholder" else self._remade(a, layer)
            self.moved[key] = self._reshard(a, tuple(dst), False, True, ref, gather=layer)
        return self.moved[key]

    def _remade(self, a: fx.Node, layer: str) -> tuple[int, int]:
        """A chain node of ZeRO-3 (a view or cast of a parameter) run again in the backward."""
        key = ("backward", a.name)
        if key not in self.moved:
            reads = [self.regathered(i, d, layer)
                     for i, d in zip(tensor_inputs(a), self.nodes[a.name].inputs)]
            for r in reads:
                self.read(r, self.step, True)
            if _is_view(a) and reads:
                self.moved[key] = reads[0]
            else:
                size = self.local_bytes(a.meta["val"], self.nodes[a.name].outputs[0])
                self.moved[key] = (self.new_op([size], self.step), 0)
        return self.moved[key]

    def _reshard(self, a: fx.Node, dst: tuple[str, ...], tagged: bool, backward: bool,
                 ref: tuple[int, int] | None = None, gather: str | None = None
                 ) -> tuple[int, int]:
        """The moves of ``a`` to ``dst`` (``ref``: the buffer moved, ``a``'s own by default);
        ``gather``: a ZeRO-3 parameter gather for a reader in that layer, issued as
        :class:`~autopar.capture.remat.GatherRuns` says."""
        src = self.nodes[a.name].outputs[0]
        ref = self.env[a.name] if ref is None else ref
        val = a.meta["val"]
        if src is None or tuple(src) == dst or not isinstance(val, torch.Tensor):
            return ref
        steps = reshard_steps(self.placements(src), self.placements(dst), tuple(val.shape),
                              val.element_size(), self.mesh_shape)
        comm = [i for i, s in enumerate(steps) if s.kind != "local"]
        final = self.local_bytes(val, dst)
        if not comm:  # local slices: DTensor clones the shard (a new buffer at the consumer)
            out = (self.new_op([final], self.step, tagged, [ref]), 0)
            self.read(ref, self.step, backward)
            return out
        k = comm[-1]
        issued = (self.issue_point(ref, backward) if gather is None
                  else self.prefetched(gather, backward))
        coll = (self.new_op([self._bytes_after(val, steps[k].after)], issued), 0)
        if gather is not None and steps[k].kind == "all_gather":
            run, start = self.runs[backward].run
            self.gather_buckets.setdefault((backward, run, steps[k].axis, val.dtype), []).append(
                (self.ops[coll[0]].buffers[0], issued, start, self.mesh_shape[steps[k].axis]))
        self.read(ref, issued, backward)
        self.largest_output = max(self.largest_output, self.size[self.ops[coll[0]].buffers[0]])
        before = steps[k - 1].after if k else self.placements(src)
        if k == len(steps) - 1 and not _gathers_inner_dim(steps[k], before):
            return coll
        # local ops after the collective (a slice, or the cat of a gather on a dim > 0): a new
        # buffer at the consumer, recomputed with it; the collective's output is read there
        out = (self.new_op([final], self.step, tagged, [coll]), 0)
        self.read(coll, self.step, backward)
        return out

    def issue_point(self, ref: tuple[int, int], backward: bool) -> int:
        """The step a collective reading ``ref`` is issued at (``passes.overlap``): right after
        its input is computed, not before the previous collective (they keep their order) nor
        out of its part of the step; a program input's (a ZeRO parameter's) stays where used,
        and so does one reading a value recomputed right before its backward reader."""
        op = self.ops[ref[0]]
        if ref[0] in self.is_input or (backward and op.tagged):
            issued = self.step
        else:
            floor = self.forward_end + 1 if backward else 0
            issued = min(max(self.born[op.buffers[ref[1]]], floor, self.last_collective), self.step)
        self.last_collective = issued
        return issued

    def flat_buckets(self) -> None:
        """ZeRO's flat gather buckets (``passes.gather_buckets``): a run of two or more
        gathers with one key holds its packed shards until its collective is waited for and
        its flat buffer until its first step, where the gathered copies are made (copied out);
        one issued ahead (prefetched) is issued after the copy-out of the run before it."""
        for members in self.gather_buckets.values():
            if len(members) < 2:
                continue
            issued, start, group = members[0][1], members[0][2], members[0][3]
            issued = min(issued + 1, start) if issued < start else issued
            total = sum(self.size[b] for b, *_ in members)
            packed, flat = self.ops[self.new_op([total / group, total], issued)].buffers
            self.last[packed], self.last[flat] = max(issued, start - 1), start
            for b, *_ in members:
                self.born[b] = max(self.born[b], start)

    def prefetched(self, layer: str, backward: bool) -> int:
        """The step a ZeRO-3 parameter gather for a reader in ``layer``, made at this step, is
        issued at (``passes.overlap.prefetch_gathers``)."""
        issued, _ = self.runs[backward].issue(layer, self.step)
        self.last_collective = max(self.last_collective, issued)
        return issued

    def _bytes_after(self, val: torch.Tensor, placements: tuple) -> float:
        shape = local_shape(tuple(val.shape), placements, self.mesh_shape)
        return float(np.prod(shape, dtype=np.float64)) * val.element_size()

    # -- the program, node by node (passes.lower's walk) ---------------------------------------
    def run(self, outputs: Sequence, buckets: Sequence[Sequence[int]]) -> None:
        """Walk the joint graph: placeholders, ops with their moves, the graph outputs' moves
        (the loss in the forward, each gradient where it is computed or with its bucket)."""
        early, late = output_moves(self.traced.gm)
        self.outputs, self.final = outputs, {}
        self.bucket_of = {i: tuple(b) for b in buckets for i in b}
        self.pending: dict[int, tuple[int, int]] = {}
        self.node_at: list[str] = []
        for n in self.traced.gm.graph.nodes:
            if n.op in ("placeholder", "get_attr"):
                self.env[n.name] = (self.new_op([0.0], 0), 0)  # counted as persistent
                self.is_input.add(self.env[n.name][0])
            elif n.op == "call_function" and n.target is operator.getitem:
                self.env[n.name] = self.env[n.args[0].name][n.args[1]]
                if n.name in late:
                    self.output_move(n, late[n.name], step=self.step - 1)
            elif n.op == "call_function":
                self.run_node(n)
                if n.name in early:
                    self.final[early[n.name]] = self.move(n, outputs[early[n.name]], False, False)
                elif n.name in late:
                    self.output_move(n, late[n.name], step=self.step)
                self.node_at.append(n.name)
                self.step += 1
            elif n.op == "output":
                self.finish(n)

    def run_node(self, n: fx.Node) -> None:
        """One op: its inputs moved to the placements it reads them in and read now; its
        outputs new buffers of their local size, or views of its first input."""
        backward = is_backward(n)
        if backward and self.forward_end < 0:
            self.forward_end = self.step - 1
        plan, tagged = self.nodes[n.name], n.name in self.tagged
        self.layer = self.traced.node_layer.get(n.name, "")
        reads, recipe, regathered = [], [], []
        for a, dst in zip(tensor_inputs(n), plan.inputs):
            ref = (self.regathered(a, dst, self.layer) if backward and a.name in self.regather
                   else self.move(a, dst, tagged, backward))
            self.read(ref, self.step, backward)
            reads.append(ref)
            if tagged and a.name in self.regather:  # recomputed from a gathered-again copy
                regathered.append((a, tuple(dst), self.layer))
            else:
                recipe.append(ref)
        vals = n.meta.get("val")
        many = isinstance(vals, (tuple, list))
        if _is_view(n) and reads:
            self.env[n.name] = [reads[0]] * len(vals) if many else reads[0]
            return
        vals = list(vals) if many else [vals]
        sizes = [self.local_bytes(v, p) if isinstance(v, torch.Tensor) and p is not None else 0.0
                 for v, p in zip(vals, plan.outputs)]
        op = self.new_op(sizes, self.step, tagged, recipe)
        self.ops[op].regathered = regathered
        self.env[n.name] = [(op, i) for i in range(len(sizes))] if many else (op, 0)
        if n.target in SEQUENCE_ATTENTION_QUERY:  # (ring attention's buffers, while it runs)
            ins = tensor_inputs(n)
            work = ring_workspace_bytes(n.target, [tuple(map(from_str, p)) for p in plan.inputs],
                                        [tuple(a.meta["val"].shape) for a in ins],
                                        ins[0].meta["val"].element_size(), self.mesh_shape)
            if work:
                self.new_op([work], self.step)
                self.ops[op].workspace = work

    def output_move(self, n: fx.Node, index: int, step: int) -> None:
        """A gradient, moved where it is computed: to its parameter's placement, or into its
        bucket's flat buffer once the bucket's last gradient is computed (all-reduced in
        place, one gradient that nothing else reads in its own memory; or reduce-scattered
        into a new buffer of the rank's shards, the packed one held until the next
        reduce-scatter bucket is issued: ``passes.grad_buckets``)."""
        bucket = self.bucket_of.get(index)
        if bucket is None:
            self.final[index] = self.move(n, self.outputs[index], False, True)
            return
        self.pending[index] = self.env[n.name]
        if index != bucket[-1]:
            return
        refs = [self.pending.pop(i) for i in bucket]
        for r in refs:
            self.read(r, step, True)
        total = sum(self.size[self.ops[o].buffers[i]] for o, i in refs)
        scatter = _scatter_axis(self.nodes[n.name].outputs[0], self.outputs[index])
        if scatter is not None:
            if self.scattering is not None:  # (waited for now)
                self.last[self.scattering] = step
            packed = self.ops[self.new_op([total], step)].buffers[0]
            self.scattering = packed
            self.last[packed] = step  # (to the end, unless another one is issued: finish)
            flat = (self.new_op([total / self.mesh_shape[scatter]], step), 0)
        elif len(bucket) == 1 and _owned(n):
            flat = refs[0]
        else:
            flat = (self.new_op([total], step), 0)
        self.last_collective = step
        self.final.update({i: flat for i in bucket})

    def finish(self, out: fx.Node) -> None:
        """The program's outputs alive to its end and through the runtime adding each gradient
        into its ``p.grad`` (``ParallelModule.step``: one new gradient at a time, the old one
        freed when replaced), which the last step here holds."""
        end = self.step + 1
        if self.scattering is not None:  # the last reduce-scatter bucket, waited for at the end
            self.last[self.scattering] = end
        for i, a in enumerate(out.args[0]):
            if a is None:
                continue
            ref = self.final[i] if i in self.final else self.move(a, self.outputs[i], False, True)
            self.read(ref, end, False)
        of_params = {p.grad_output_index for p in self.traced.params}
        grads = [self.size[self.ops[o].buffers[k]] for i, (o, k) in self.final.items()
                 if i in of_params]
        self.new_op([max(grads, default=0.0)], end)
        self.sink_bytes = 0.0
        stage = self.stage
        if stage and stage.microbatches > 1 and self.forward_end >= 0:
            # the sum of the earlier microbatches' gradients, alive through the backward
            self.sink_bytes = sum(grads)
            self.new_op([self.sink_bytes], self.forward_end + 1)
            self.last[-1] = end
        self.node_at += ["<outputs>", "<gradient accumulation>"]
        self.step = end

    def peak(self) -> tuple[float, str, float]:
        """The most bytes alive at one step, the node computed there, and the bytes alive from
        the forward into the backward."""
        delta = np.zeros(self.step + 2)
        size, born, last = (np.asarray(x, dtype=np.float64) for x in (self.size, self.born, self.last))
        if self.stage is not None and self.forward_end >= 0:  # saved values held to the end
            crossing = (born <= self.forward_end) & (last > self.forward_end)
            last = np.where(crossing, np.maximum(last, self.step), last)
        np.add.at(delta, np.asarray(self.born, dtype=np.int64), size)
        np.add.at(delta, last.astype(np.int64) + 1, -size)
        live = np.cumsum(delta)[:self.step + 1]
        at = int(np.argmax(live))
        boundary = self.forward_end
        saved = float(size[(born <= boundary) & (last > boundary)].sum()) if boundary >= 0 else 0.0
        return float(live[at]), self.node_at[at] if at < len(self.node_at) else "", saved


def _scatter_axis(src: Sequence[str] | None, dst: Sequence[str] | None) -> int | None:
    """The mesh axis a gradient bucket reduce-scatters over (``Partial`` becoming ``Shard``:
    ``planning.buckets.single_reduction``), or ``None`` for an all-reduce bucket."""
    if src is None or dst is None:
        return None
    return next((a for a, (s, d) in enumerate(zip(src, dst))
                 if s.startswith("P") and d.startswith("S")), None)


def _gathers_inner_dim(step: Any, before: tuple) -> bool:
    """Whether an all-gather step gathers a dim other than 0, which DTensor does by gathering
    dim 0 and concatenating the chunks on the dim (a second buffer, made after the wait)."""
    p = before[step.axis]
    # (a _StridedShard is put back in order by a reshape and transpose: a copy too)
    return step.kind == "all_gather" and (type(p) is not Shard or p.dim != 0)


def _is_view(n: fx.Node) -> bool:
    """Whether op ``n`` returns a view of (or writes into) its first input, as its schema
    says (``Tensor(a)``); ``_unsafe_view`` is a view its schema does not annotate."""
    if n.target is torch.ops.aten._unsafe_view.default:
        return True
    schema = getattr(n.target, "_schema", None)
    return bool(schema is not None and schema.returns and schema.returns[0].alias_info is not None)


def _owned(n: fx.Node) -> bool:
    """Whether gradient ``n`` and what it views are read by nothing else, so that a bucket of
    it alone is reduced in its own memory (``passes.lower.GradientBuckets``)."""
    while len(n.users) == 1 and n.op == "call_function":
        if not _is_view(n):
            return True
        if not n.args or not isinstance(n.args[0], fx.Node):
            return False
        n = n.args[0]
    return False


def step_memory(traced: Any, mesh_shape: Sequence[int], nodes: dict, outputs: Sequence,
                buckets: Sequence[Sequence[int]] = (), recompute: frozenset[str] = frozenset(),
                optimizer: str = "adam", stage: StageRun | None = None,
                regather: frozenset[str] = frozenset(),
                prefetch: frozenset[str] = frozenset()) -> StepMemory:
    """Peak bytes per rank of the step the plan lowers to (module docstring).

    ``nodes``: the plan's placements per joint-graph node (``NodePlan``, text form, ``getitem``
    nodes included); ``outputs``: each graph output's placement; ``buckets``: the gradient
    buckets (output indices); ``recompute``: the joint nodes recomputed in the backward
    (``capture.remat.recompute_nodes``). ``stage``: the program is a pipeline stage's
    (:class:`StageRun`); each microbatch in flight beyond one holds its saved values
    (``saved_bytes``) beside the step of the one at its peak. ``regather``: ZeRO-3's chains
    (``capture.remat.regathered_nodes``), made again for their backward readers; ``prefetch``:
    ZeRO-1/2's, whose gathers are issued a layer ahead and bucketed as ZeRO-3's are.
    """
    tagged = frozenset(n.name for n in traced.gm.graph.nodes if n.name in recompute
                       and n.op == "call_function" and not is_backward(n) and not is_random(n))
    walk = _Walk(traced, mesh_shape, nodes, tagged, stage, regather, prefetch)
    walk.run(outputs, buckets)
    walk.flat_buckets()
    live, at, saved = walk.peak()
    persistent, gathered = persistent_bytes(traced, nodes, tuple(mesh_shape), optimizer,
                                            stage.microbatches if stage is not None else 1,
                                            stage.zero_axes if stage is not None else ())
    in_flight = stage.in_flight if stage is not None else 1
    stash = weight_stash_bytes(traced, mesh_shape, nodes) if stage and stage.split_backward else 0.0
    peak = persistent + live + (in_flight - 1) * (saved + stash) + stash + walk.largest_output
    # a ZeRO stage's gather before its first forward: the flat buffer beside the parameters
    peak = max(peak, persistent + gathered)
    held = persistent + in_flight * (saved + stash) + walk.sink_bytes
    if stage is not None and stage.regather:
        # ZeRO-3: while the stage computes, the next action's gather is in flight, its flat
        # buffer and the packed shards it reads (runtime.prefetch: taken as this stage's own
        # size; planning.pipeline takes the rank's largest); each backward's copy is made from
        # its flat buffer while every microbatch in flight holds its saved values and the sink
        # its sums; between the stage's computations no gathered copy of its own is held
        # (each parameter's shard is over one of the axes: the smallest taken)
        ahead = gathered * (1 + 1 / min((mesh_shape[a] for a in stage.zero_axes), default=1))
        peak = max(peak + ahead,
                   persistent + gathered + in_flight * (saved + stash) + walk.sink_bytes)
        held -= gathered
        return StepMemory(peak, persistent, saved + stash, min(held, peak), at, ahead)
    return StepMemory(peak, persistent, saved + stash, min(held, peak), at)
