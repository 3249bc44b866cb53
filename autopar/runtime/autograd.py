"""Forward with autograd for a lowered plan: the local joint program split in two.

The per-rank joint program (forward and backward with explicit collectives) is partitioned into
a forward graph, which returns the loss and the tensors saved for backward, and a backward graph,
which turns the saved tensors and the loss's gradient into parameter gradients. Both run inside
one ``torch.autograd.Function``, so ``loss = pmodel(...); loss.backward()`` works as in eager
PyTorch and gradients reach the DTensor parameters through ``DTensor.to_local``.
"""

from __future__ import annotations

import copy
import operator
import time
from typing import Any, Sequence

import torch
import torch.fx as fx

from autopar import _torch_private as private
from autopar.capture.remat import is_wait
from autopar.passes.gather_buffers import compilable, gather_into_buffers
from autopar.runtime.faults import collective_failures

__all__ = ["split_forward_backward", "split_weight_backward", "WeightSplit", "JointFunction", "FlatBucket",
           "GradSink", "LazyCompiled", "Labelled"]



def split_forward_backward(local: fx.GraphModule, placeholder_names: Sequence[str],
                           num_fwd_outputs: int = 1) -> tuple[fx.GraphModule, fx.GraphModule]:
    """Partition ``local`` (the lowered joint program) into forward and backward graphs.

    ``placeholder_names`` are the joint graph's placeholder names (``primals_i``/``tangents_i``)
    in order; the partitioner tells forward inputs from tangents by these names. The first
    ``num_fwd_outputs`` outputs are computed by the forward (the loss, or a pipeline stage's
    boundary activations); the rest are gradients.
    """
    gm = copy.deepcopy(local)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, name in zip(placeholders, placeholder_names):
        n.target = name
        n.name = name
    gm.recompile()
    fwd, bwd = private.partition_joint(gm, num_fwd_outputs=num_fwd_outputs)
    # (each part's all-gathers into buffers of its own: passes.gather_buffers)
    return (gather_into_buffers(_drop_dead_code(fwd, "is_backward")),
            gather_into_buffers(_drop_dead_code(bwd, "is_forward")))


def _drop_dead_code(gm: fx.GraphModule, other_part: str) -> fx.GraphModule:
    """Remove the computations whose results nothing uses. The partitioner's own clean-up keeps
    every op but the collectives (in torch 2.13 it treats the rest as impure), so a backward
    graph could recompute a forward op (an attention) whose outputs it was given saved. It
    also copies into each graph every collective of the other part that the graph's inputs can
    compute (a collective is impure to it), with the ops feeding it: a backward graph
    re-ran forward matmuls and their tensor-parallel reduce-scatters whose results it never
    read (HF Llama stages, 2026-11-25). An unused functional collective (or wait) whose
    ``partitioner_tag`` is ``other_part`` is such a copy: the other graph runs it, on every
    rank alike, so it is dropped here."""
    changed = True
    while changed:
        changed = False
        for n in reversed(list(gm.graph.nodes)):
            if n.op != "call_function" or n.users or (_keeps(n) and not _copied(n, other_part)):
                continue
            gm.graph.erase_node(n)
            changed = True
    gm.recompile()
    return gm


def _keeps(n: fx.Node) -> bool:
    """A node that must run even when unused: a collective, a wait, an op that mutates (not
    ``getitem``, which only picks an output)."""
    if n.target is operator.getitem:
        return False
    if getattr(n.target, "namespace", None) in ("c10d", "_c10d_functional"):
        return True
    schema = getattr(n.target, "_schema", None)
    return schema is None or schema.is_mutable


def _copied(n: fx.Node, other_part: str) -> bool:
    """A functional (not in-place) collective or wait of the joint program's ``other_part``."""
    schema = getattr(n.target, "_schema", None)
    return (getattr(n.target, "namespace", None) == "_c10d_functional" and schema is not None
            and not schema.is_mutable and n.meta.get("partitioner_tag") == other_part)


class WeightSplit(torch.nn.Module):
    """A backward graph cut in two (zero-bubble pipelines, Qi et al., ICLR'24, section 2):
    ``input_part`` computes the gradients of the positions in ``input_positions`` and the
    ``num_stash`` values the rest needs; ``weight_part`` takes the backward's inputs and those
    values and computes every other gradient; it takes only the backward's inputs it reads,
    those at ``weight_inputs`` (so the others need not be kept for it), then the values."""

    def __init__(self, input_part: fx.GraphModule, weight_part: fx.GraphModule,
                 input_positions: tuple[int, ...], num_outputs: int, num_stash: int,
                 weight_inputs: tuple[int, ...]) -> None:
        super().__init__()
        self.input_part, self.weight_part = input_part, weight_part
        self.input_positions, self.num_outputs, self.num_stash = input_positions, num_outputs, num_stash
        self.weight_inputs = weight_inputs


def _ancestors(roots: Sequence[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = list(roots)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def split_weight_backward(bwd: fx.GraphModule, input_positions: Sequence[int]) -> WeightSplit:
    """Cut ``bwd`` into the part computing the outputs at ``input_positions`` (the gradients of
    a stage's boundary inputs) and the part computing the others (weight gradients).

    Every node runs once: nodes the input gradients need go to the first part (a collective's
    wait goes with it), the rest to the second, and the values the second reads from the first
    are passed on. The two parts together compute exactly ``bwd``.
    """
    out = next(n for n in bwd.graph.nodes if n.op == "output")
    outs = list(out.args[0])
    in_pos = tuple(i for i in input_positions if outs[i] is not None)
    first = _ancestors([outs[i] for i in in_pos])
    for n in list(first):  # a collective's wait stays with the collective
        first.update(u for u in n.users if is_wait(u))
    w_roots = [o for i, o in enumerate(outs) if o is not None and i not in in_pos]
    second = _ancestors(w_roots)
    order = [n for n in bwd.graph.nodes if n.op != "output"]
    stash = [n for n in order if n in first and n.op != "placeholder" and n in second and
             (any(u in second and u not in first for u in n.users) or n in w_roots)]
    g1, env1 = fx.Graph(), {}
    for n in order:
        if n in first or n.op == "placeholder":
            env1[n] = g1.node_copy(n, lambda a: env1[a])
    g1.output(tuple(env1[outs[i]] for i in in_pos) + tuple(env1[n] for n in stash))
    g2, env2 = fx.Graph(), {}
    for n in order:
        if n.op == "placeholder":
            env2[n] = g2.node_copy(n, lambda a: env2[a])
    for k, n in enumerate(stash):
        env2[n] = g2.placeholder(f"stash_{k}")
        env2[n].meta = dict(n.meta)
    for n in order:
        if n in second and n not in first and n.op != "placeholder":
            env2[n] = g2.node_copy(n, lambda a: env2[a])
    g2.output(tuple(env2[o] if o is not None and i not in in_pos else None for i, o in enumerate(outs)))
    inputs = [env2[n] for n in order if n.op == "placeholder"]
    for x in inputs:  # (an input only the input gradients read is not kept for the weights)
        if not x.users:
            g2.erase_node(x)
    reads = tuple(i for i, x in enumerate(inputs) if x.users)
    return WeightSplit(fx.GraphModule(bwd, g1), fx.GraphModule(bwd, g2), in_pos, len(outs),
                       len(stash), reads)


class LazyCompiled(torch.nn.Module):
    """An FX graph compiled with inductor at its first call, for that call's shapes (a
    pipeline stage's forward and backward run on every microbatch with the same shapes)."""

    def __init__(self, gm: fx.GraphModule, timings: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.gm = gm
        self._compiled: Any = None
        self._timings = timings  # the compile's seconds are added to its "compile_s"

    def forward(self, *args: Any) -> Any:
        """Run the compiled graph (compiling it first, on the first call)."""
        if self._compiled is None:
            t0 = time.perf_counter()
            self._compiled = private.inductor_compile(compilable(self.gm), list(args))
            if self._timings is not None:
                self._timings["compile_s"] = self._timings.get("compile_s", 0.0) + time.perf_counter() - t0
        return self._compiled(*args)


class Labelled(torch.nn.Module):
    """A graph (module) called under a ``torch.profiler`` range named ``label``, and timed
    into ``times`` while that is a list (:func:`autopar.runtime.profile.profile_step`)."""

    def __init__(self, graph: torch.nn.Module, label: str) -> None:
        super().__init__()
        self.graph, self.label = graph, label
        self.times: list[float] | None = None

    def forward(self, *args: Any) -> Any:
        """Call the graph."""
        with torch.profiler.record_function(self.label):
            if self.times is None:
                return self.graph(*args)
            t0 = time.perf_counter()
            out = self.graph(*args)
            self.times.append(time.perf_counter() - t0)
            return out


class FlatBucket:
    """Gradients a :class:`GradSink` sums in one flat buffer (each a view of it), so that the
    buffer can be reduced with one collective once the step's last backward is in.
    ``names`` / ``shapes``: the gradients (local shapes) in buffer order; ``dtype``: theirs.

    ``dims`` (ZeRO-1 once a step, ``cost_models.sharding.StepEndBucket``): tensor ``i`` is
    stored in ``parts`` even chunks on its dim ``dims[i]``, one per rank of the axis, and the
    buffer is laid out rank-major: part ``r`` holds chunk ``r`` of every tensor, in order, so
    that a reduce-scatter leaves each rank its chunks (:meth:`chunks`) and an all-gather of
    each rank's chunks (:meth:`pack`) gives every tensor whole (:meth:`unpack`). A gradient is
    then summed into a strided view: ``(parts, *chunk shape)`` (:meth:`view`, :meth:`arrange`)."""

    def __init__(self, names: Sequence[str], shapes: Sequence[Sequence[int]], dtype: torch.dtype,
                 dims: Sequence[int] = (), parts: int = 1) -> None:
        self.names, self.dtype = tuple(names), dtype
        self.shapes = tuple(tuple(int(d) for d in s) for s in shapes)
        self.dims, self.parts = tuple(dims), parts if dims else 1
        if self.dims and (len(self.dims) != len(self.shapes) or any(
                s[d] % parts for s, d in zip(self.shapes, self.dims))):
            raise ValueError(f"FlatBucket: shapes {self.shapes} do not split evenly in {parts} "
                             f"chunks on dims {self.dims}")
        sizes = [int(torch.Size(s).numel()) // self.parts for s in self.shapes]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.numel = sum(sizes) * self.parts
        self._sizes = sizes

    def chunk_shape(self, i: int) -> tuple[int, ...]:
        """Tensor ``i``'s chunk on one rank (its whole shape without ``dims``)."""
        if not self.dims:
            return self.shapes[i]
        shape = list(self.shapes[i])
        shape[self.dims[i]] //= self.parts
        return tuple(shape)

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Where tensor ``i`` lives in ``flat``: its shape, or ``(parts, *chunk shape)``."""
        start, n = self.offsets[i], self._sizes[i]
        if not self.dims:
            return flat[start:start + n].view(self.shapes[i])
        return flat.view(self.parts, -1)[:, start:start + n].view(self.parts, *self.chunk_shape(i))

    def arrange(self, tensor: torch.Tensor, i: int) -> torch.Tensor:
        """Tensor ``i`` (whole) as :meth:`view` holds it (a view of it)."""
        if not self.dims:
            return tensor
        d = self.dims[i]
        return tensor.unflatten(d, (self.parts, -1)).movedim(d, 0)

    def chunks(self, part: torch.Tensor) -> list[torch.Tensor]:
        """Views of one rank's part (``numel / parts`` elements) as each tensor's chunk."""
        return [part[o:o + n].view(self.chunk_shape(i))
                for i, (o, n) in enumerate(zip(self.offsets, self._sizes))]

    def pack(self, chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        """This rank's chunks of every tensor, in one flat part of the bucket's dtype (a
        chunk of another dtype is cast: a parameter gathered in bf16)."""
        return torch.cat([c.reshape(-1).to(self.dtype) for c in chunks])

    def unpack(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Every tensor whole (contiguous, new memory) from the all-gathered parts."""
        return [self.view(flat, i).movedim(0, d).flatten(d, d + 1).contiguous()
                for i, d in enumerate(self.dims)]


class GradSink:
    """Gradients of inputs that bypass autograd, summed over calls: a pipeline stage's
    parameters, fed to :class:`JointFunction` as plain local tensors, get their gradients here
    over the microbatches of a step (one plain add each) instead of through autograd into the
    DTensor parameters (a DTensor dispatch per parameter and microbatch).

    ``buckets``: gradients summed into flat buffers instead (:class:`FlatBucket`); after
    ``calls`` backward passes (:meth:`end_backward`; a step's microbatches) each buffer is given
    to ``on_ready(index, buffer)``, which may reduce it in place while other stages still run
    their backward.

    A split backward (zero-bubble) hands its weight part here (:meth:`defer`) when its input
    part is done; the schedule's weight step takes it (:meth:`take_deferred`) and runs it,
    which adds that microbatch's weight gradients and ends its backward."""

    def __init__(self, buckets: Sequence[FlatBucket] = (), calls: int = 0,
                 on_ready: Any = None) -> None:
        self.grads: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()
        self.buckets, self.calls, self.on_ready = tuple(buckets), calls, on_ready
        self._where = {name: (b, i) for b, bucket in enumerate(self.buckets)
                       for i, name in enumerate(bucket.names)}
        self._flat: dict[int, torch.Tensor] = {}
        self._count = 0
        self._deferred: Any = None

    def defer(self, weight_step: Any) -> None:
        """Keep a split backward's weight step (a callable) until :meth:`take_deferred`."""
        if self._deferred is not None:
            raise RuntimeError("GradSink: a weight step is already waiting; the schedule must "
                               "take each microbatch's right after its input step.")
        self._deferred = weight_step

    def take_deferred(self) -> Any:
        """The weight step :meth:`defer` kept (torch pipelining's ``dw_builder``)."""
        step, self._deferred = self._deferred, None
        if step is None:
            raise RuntimeError("GradSink: the schedule asked for a weight step, but no "
                               "backward deferred one (its input step did not run).")
        return step

    def add(self, name: str, grad: torch.Tensor | None) -> None:
        """Add ``grad`` to the sum of ``name``'s gradients (the first one is kept as given, so
        the sum is done in place only on a tensor made here; a bucketed one in its buffer)."""
        if grad is None:
            return
        if name in self._where:
            self._add_flat(name, grad)
        elif name not in self.grads:
            self.grads[name] = grad
        elif name in self._owned:
            self.grads[name].add_(grad)
        else:
            self.grads[name] = self.grads[name] + grad
            self._owned.add(name)

    def _add_flat(self, name: str, grad: torch.Tensor) -> None:
        b, i = self._where[name]
        bucket = self.buckets[b]
        if b not in self._flat:
            self._flat[b] = torch.zeros(bucket.numel, dtype=bucket.dtype, device=grad.device)
        if name not in self.grads:
            self.grads[name] = bucket.view(self._flat[b], i)
        self.grads[name].add_(bucket.arrange(grad, i))

    def end_backward(self) -> None:
        """One backward pass is in; after the step's last, hand each bucket to ``on_ready``."""
        self._count += 1
        if self._count == self.calls and self.on_ready is not None:
            for b in range(len(self.buckets)):
                if b not in self._flat:  # (no gradient reached it: reduce zeros, as planned)
                    device = next(iter(self._flat.values())).device if self._flat else None
                    self._flat[b] = torch.zeros(self.buckets[b].numel, dtype=self.buckets[b].dtype,
                                                device=device)
                self.on_ready(b, self._flat[b])

    def take(self) -> dict[str, torch.Tensor]:
        """The sums so far, and start again."""
        grads, self.grads, self._owned = self.grads, {}, set()
        self._flat, self._count, self._deferred = {}, 0, None
        return grads


def _regathered_views(saved: list, primals: Sequence[Any], sink: tuple | None
                      ) -> dict[int, tuple[str, tuple, tuple, int]]:
    """The saved values of :class:`JointFunction` that its ``regather`` makes again: each one
    a gathered parameter or a view of one, by position, with the parameter's name and the
    view's size, stride and storage offset from the parameter's own. The gathered parameters
    are contiguous and may share one storage (:meth:`FlatBucket.unpack` returns views of the
    gathered buffer where it can): a view belongs to the one whose elements its first element
    lies in."""
    if sink is None or sink[2] is None:
        return {}
    names, gathered = sink[1], sink[2][1]
    spans: dict[int, list[tuple[int, int, str]]] = {}  # storage -> (start, end, name)
    for p, name in zip(primals[1:], names):
        if name in gathered and isinstance(p, torch.Tensor) and p.is_contiguous():
            start = p.storage_offset()
            spans.setdefault(p.untyped_storage().data_ptr(), []).append(
                (start, start + p.numel(), name))
    out = {}
    for i, s in enumerate(saved):
        if not isinstance(s, torch.Tensor):
            continue
        offset = s.storage_offset()
        owner = [(start, name) for start, end, name in spans.get(s.untyped_storage().data_ptr(), ())
                 if start <= offset < end or (start == offset == end)]
        if len(owner) == 1:
            start, name = owner[0]
            out[i] = (name, tuple(s.size()), tuple(s.stride()), offset - start)
    return out


class JointFunction(torch.autograd.Function):
    """Runs the forward graph; its backward runs the backward graph.

    ``forward(ctx, fwd, bwd, grad_slots, num_outputs, split_backward, sink, *primals)``
    returns the forward's first ``num_outputs`` results (one tensor when ``num_outputs == 1``).
    ``grad_slots[j]`` is the position of primal ``j``'s gradient among the backward graph's
    outputs, or ``None``. ``sink``: ``None``, or ``(GradSink, names, regather)`` with
    ``names[j]`` the name under which primal ``j``'s gradient goes to the sink instead of to
    autograd (``None`` for the primals whose gradient autograd takes); then the first primal is
    an anchor, a scalar that requires grad and that the graphs do not read, so that the outputs
    require grad even when no other primal does (a first pipeline stage). ``regather`` (ZeRO-3
    in a pipeline, or ``None``): ``(gather, names)``, a callable gathering the named primals
    (parameters) again and those names, called once before every backward (as the plan
    counts it); a saved value that is one of them, or a view of one, is not kept from the
    forward but made again from the new copy (``torch.as_strided``: the same layout), so the
    forward's copy is freed after the forward.

    The backward computes every gradient at once, unless ``bwd`` is a :class:`WeightSplit`
    (``split_backward``, a zero-bubble pipeline; a sink is required): autograd's backward then
    runs the input-gradient part only and hands the weight part, bound to what it reads, to
    the sink (:meth:`GradSink.defer`); the schedule's weight step runs it later
    (``torch.distributed.pipelining.PipelineStage``'s ``dw_builder``), adding the weight
    gradients to the sink.
    """

    @staticmethod
    def forward(ctx: Any, fwd: fx.GraphModule, bwd: fx.GraphModule, grad_slots: tuple,
                num_outputs: int, split_backward: bool, sink: tuple | None,
                *primals: torch.Tensor) -> Any:
        if split_backward and sink is None:
            raise ValueError("JointFunction: a split (zero-bubble) backward needs a gradient "
                             "sink to receive its weight step's gradients.")
        outs = fwd(*(primals[1:] if sink is not None else primals))
        results, saved = outs[:num_outputs], list(outs[num_outputs:])
        ctx.remade = _regathered_views(saved, primals, sink)
        for i in ctx.remade:
            saved[i] = None  # (made again in the backward: the gathered copy is not kept)
        tensors = [s for s in saved if isinstance(s, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.saved_layout = [isinstance(s, torch.Tensor) for s in saved]
        ctx.others = [s for s in saved if not isinstance(s, torch.Tensor)]
        ctx.bwd, ctx.grad_slots = bwd, grad_slots
        ctx.split_backward, ctx.sink = split_backward, sink
        if num_outputs == 1:
            return results[0].detach()
        return tuple(r.detach() for r in results)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        saved = [next(tensors) if is_t else next(others) for is_t in ctx.saved_layout]
        if ctx.sink is not None and ctx.sink[2] is not None:
            # (gathered even when no saved value is remade from it, as the plan counts: a
            # stage's backward that reads no parameter is rare; it wastes one gather)
            fresh = ctx.sink[2][0]()
            for i, (name, size, stride, offset) in ctx.remade.items():
                base = fresh[name]
                saved[i] = torch.as_strided(base, size, stride, base.storage_offset() + offset)
        if ctx.split_backward:
            return JointFunction._input_step(ctx, saved, grad_outputs)
        with collective_failures("the backward", None):
            grads = ctx.bwd(*saved, *grad_outputs)
        if ctx.sink is not None:
            sink, names, _ = ctx.sink
            for k, name in zip(ctx.grad_slots, names):
                if k is not None and name is not None:
                    sink.add(name, grads[k])
            out = (None,) * 7 + tuple(grads[k] if k is not None and name is None else None
                                      for k, name in zip(ctx.grad_slots, names))
            del grads  # (the summed ones freed before the step's last reduces the sums)
            sink.end_backward()
            return out
        return (None,) * 6 + tuple(grads[k] if k is not None else None for k in ctx.grad_slots)

    @staticmethod
    def _input_step(ctx: Any, saved: list, grad_outputs: tuple) -> tuple:
        """A split backward's first part (the input gradients, returned to autograd); its
        weight part is deferred to the sink with the values it reads."""
        split: WeightSplit = ctx.bwd
        sink, names, _ = ctx.sink
        with collective_failures("the backward (input gradients)", None):
            res = split.input_part(*saved, *grad_outputs)
        grads: list[Any] = [None] * split.num_outputs
        for pos, g in zip(split.input_positions, res):
            grads[pos] = g
        stash = res[len(split.input_positions):]
        slots = ctx.grad_slots
        # (what the weight step does not read is not kept for it: activations only the input
        # gradients needed, and a ZeRO-3 stage's gathered parameters)
        every = (*saved, *grad_outputs)
        kept = [every[i] for i in split.weight_inputs]
        del saved, grad_outputs, every

        def weight_step() -> None:
            with collective_failures("the backward (weight gradients)", None):
                wgrads = split.weight_part(*kept, *stash)
            for k, name in zip(slots, names):
                if k is not None and name is not None and k not in split.input_positions:
                    sink.add(name, wgrads[k])
            del wgrads
            sink.end_backward()

        sink.defer(weight_step)
        return (None,) * 7 + tuple(grads[k] if k is not None and name is None else None
                                   for k, name in zip(slots, names))
