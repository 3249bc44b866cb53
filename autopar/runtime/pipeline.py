"""``PipelineModule``: runs a pipelined Plan with ``torch.distributed.pipelining``.

Every rank holds the stages ``j`` with ``j % pp == its pipeline rank``. A stage is a
:class:`StageModule`: its lowered joint program (explicit tp/dp collectives on the stage's
(dp, tp) submesh) split into forward and backward graphs inside :class:`JointFunction`, with the
stage's parameters as DTensors. Between stages travel the local shards of the boundary
activations (batch-sharded on dp, replicated on tp), over the ``pp`` axis's process group of this
rank's (dp, tp) coordinate.

User inputs do not travel through the pipeline: :meth:`PipelineModule.step` cuts the global batch
into microbatches and every stage reads the microbatch it is computing from a shared feeder
(torch's schedules run one stage's forwards in microbatch order; the first stage checks this
against the microbatch index the schedule hands it).

Gradients: each microbatch's loss is scaled by ``1/m`` before its backward, so parameters receive
the gradient of the mean loss and ``step`` accumulates into ``p.grad`` like the unpipelined
module. A parameter used by two stages on different ranks (a tied embedding and LM head) gets
the sum of both gradients by an all-reduce over the ``pp`` axis after the schedule.

Data parallelism: a stage sums the gradients its program leaves partial over dp in flat buckets over the step's
microbatches and reduces each bucket once, when its last backward is done. With ZeRO-1 a
parameter is stored sharded over dp (``plan.params``; the stage's program computes with it as
``plan.pipeline.stages[j].params`` places it, replicated there): the stage all-gathers its
parameters in one bucket before its first forward of the step, and reduce-scatters the
gradients' bucket, laid out rank-major, into the shards (``cost_models.sharding.
step_end_buckets``, one owner of the buckets for the plan and the runtime). With ZeRO-3 it
gathers them for every microbatch's forward and again for its backward, each gather issued
while the rank's action before it computes (``runtime.prefetch``).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch
from autopar._torch_private import funcol
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from autopar._torch_private import tree_flatten

from autopar.cost_models.pipeline import TORCH_SCHEDULE_CLASSES, action_order
from autopar.errors import InputMismatchError, PlanError
from autopar.graph import TracedGraph
from autopar.passes.gather_buffers import all_gather_into_buffer
from autopar.passes.lower import placements_of
from autopar.capture.layers import set_module_attr
from autopar.capture.stages import StageGraph
from autopar.sequence_layout import SequenceLayout, layout_of_plan
from autopar.plan import Plan
from autopar.runtime.faults import collective_failures
from autopar.runtime.prefetch import GatherAhead, Issue, gathering_stages
from autopar.runtime.state import StateDictMixin, model_state
from autopar.runtime.autograd import (FlatBucket, GradSink, JointFunction, Labelled, LazyCompiled,
                                      split_forward_backward, split_weight_backward)
from autopar.cost_models.sharding import step_end_buckets, stored_dim
from autopar.strategies.reshard import local_shape

__all__ = ["PipelineModule", "StageModule", "SCHEDULE_CLASSES"]

SCHEDULE_CLASSES = TORCH_SCHEDULE_CLASSES  # schedule name -> torch.distributed.pipelining class
_MULTI_STAGE = ("interleaved-1f1b", "zero-bubble")
_Stages = Sequence[tuple[StageGraph, TracedGraph, Any]]


class _Feeder:
    """Each stage's local user inputs for every microbatch of the current step."""

    def __init__(self) -> None:
        self.inputs: dict[int, list[list[torch.Tensor]]] = {}
        self.next: dict[int, int] = {}

    def take(self, stage: int) -> tuple[int, list[torch.Tensor]]:
        mb = self.next[stage]
        self.next[stage] = mb + 1
        return mb, self.inputs[stage][mb]


class StageModule(nn.Module):
    """One pipeline stage on this rank (see module docstring).

    ``params`` maps the model's parameter name to the DTensor Parameter shared with the other
    stages of this rank; ``canonical`` maps the stage's parameter names to the model's.
    """

    def __init__(self, stage: StageGraph, traced: TracedGraph, local_program: fx.GraphModule,
                 params: dict[str, nn.Parameter], canonical: dict[str, str], feeder: _Feeder,
                 split_backward: bool, buffers: dict[str, torch.Tensor],
                 compile: bool = False, timings: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.stage, self.traced = stage, traced
        self.feeder, self.split_backward = feeder, split_backward
        order = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
        nfwd = traced.num_forward_outputs
        self.fwd, self.bwd = split_forward_backward(local_program, order, nfwd)
        self.local_program = local_program
        by_node = {p.node: canonical.get(p.name, p.name) for p in traced.params}
        self._order = [name for name in order if name not in traced.tangent_nodes]
        self._param_names = [by_node.get(name) for name in self._order]
        grad_of = {p.node: p.grad_output_index for p in traced.params}
        grad_of.update(zip(traced.boundary_inputs, traced.boundary_grad_outputs))
        self._slots = tuple(grad_of[n] - nfwd if grad_of.get(n) is not None else None
                            for n in self._order)
        if split_backward:  # zero-bubble: input and weight gradients as two steps
            positions = [slot for name, slot in zip(self._order, self._slots)
                         if name in traced.boundary_inputs and slot is not None]
            self.bwd = split_weight_backward(self.bwd, positions)
        if compile:  # each graph compiled with inductor on its first microbatch
            self.fwd = LazyCompiled(self.fwd, timings)
            if split_backward:
                self.bwd.input_part = LazyCompiled(self.bwd.input_part, timings)
                self.bwd.weight_part = LazyCompiled(self.bwd.weight_part, timings)
            else:
                self.bwd = LazyCompiled(self.bwd, timings)
        self._label_graphs()
        self._params = params
        # ZeRO-1 once a step: a callable gathering the stage's parameters (by model name),
        # called at the stage's first forward of a step; what it gave, until the step ends.
        # ZeRO-3 (``regather``): called for every microbatch's forward and again for its
        # backward, the copy freed in between (JointFunction's ``regather``)
        self.gather: Any = None
        self.gathered: dict[str, torch.Tensor] | None = None
        self.regather = False
        # the parameters' gradients, summed over the microbatches as local tensors (GradSink)
        # and set once per step; a split backward's weight step (zero-bubble) is deferred to
        # the sink by the input step and run by the schedule through ``weight_step``
        self.sink = GradSink()
        self._anchor = torch.zeros((), requires_grad=True)
        # registered too, so that the stage's module holds its weights (state, pipelining)
        for i, name in enumerate(dict.fromkeys(n for n in self._param_names if n is not None)):
            self.register_parameter(f"param_{i}", params[name])
        # buffers are replicated (as planned): every rank feeds the whole tensor; constants that
        # export lifted out of the code (``lifted_tensor_N``) live in the stage graph itself
        self._buffers_by_node = {b.node: _buffer(b.name, buffers, stage.gm) for b in traced.buffers}

    def _label_graphs(self) -> None:
        """Each graph under a profiler range (and timed on demand: :meth:`graphs`)."""
        name = f"autopar stage {self.stage.index}"
        self.fwd = Labelled(self.fwd, f"{name} forward")
        if self.split_backward:
            self.bwd.input_part = Labelled(self.bwd.input_part, f"{name} backward (inputs)")
            self.bwd.weight_part = Labelled(self.bwd.weight_part, f"{name} backward (weights)")
        else:
            self.bwd = Labelled(self.bwd, f"{name} backward")

    def graphs(self) -> dict[str, list[Labelled]]:
        """The stage's graphs by phase (``"forward"``, ``"backward"``: one, or the two parts of
        a split backward)."""
        bwd = [self.bwd.input_part, self.bwd.weight_part] if self.split_backward else [self.bwd]
        return {"forward": [self.fwd], "backward": bwd}

    def forward(self, *args: torch.Tensor) -> Any:
        """The stage's forward on one microbatch: boundary shards in, boundary shards (or the
        loss) out. The first stage receives the microbatch index instead of activations."""
        mb, user = self.feeder.take(self.stage.index)
        if self.stage.index == 0 and int(args[0].reshape(-1)[0]) != mb:
            raise RuntimeError(
                f"pipeline stage 0 ran microbatch {int(args[0].reshape(-1)[0])} when microbatch "
                f"{mb} was due; autopar needs schedules that run each stage's forwards in order.")
        boundary = iter(args if self.stage.index > 0 else ())
        users = iter(user)
        primals = [self._anchor]
        if self.regather:  # (this microbatch's copy, not kept: ZeRO-3)
            gathered = self.gather()
        else:
            if self.gathered is None and self.gather is not None:
                self.gathered = self.gather()
            gathered = self.gathered or {}
        for name, pname in zip(self._order, self._param_names):
            if pname in gathered:
                primals.append(gathered[pname])
            elif pname is not None:
                local = self._params[pname].to_local()
                primals.append(local.detach())
            elif name in self.traced.boundary_inputs:
                primals.append(next(boundary))
            elif name in self._buffers_by_node:
                primals.append(self._buffers_by_node[name])
            else:
                primals.append(next(users))
        regather = (self.gather, frozenset(gathered)) if self.regather else None
        sink = (self.sink, tuple(self._param_names), regather)
        return JointFunction.apply(self.fwd, self.bwd, self._slots, self.traced.num_forward_outputs,
                                   self.split_backward, sink, *primals)

    def weight_step(self) -> Any:
        """The weight step the last input step deferred (``PipelineStage``'s ``dw_builder``)."""
        return self.sink.take_deferred()


def _buffer(name: str, buffers: dict[str, torch.Tensor], stage_gm: fx.GraphModule) -> torch.Tensor:
    if name in buffers:
        return buffers[name].detach()
    obj: Any = stage_gm
    for part in ("model." + name).split("."):
        if not hasattr(obj, part):
            raise PlanError(f"a pipeline stage reads the tensor {name!r}, which is neither a buffer "
                            f"of the model nor a constant of its graph; please report it.")
        obj = getattr(obj, part)
    return obj.detach()


def _local(shape: Sequence[int], placements: Sequence[str], mesh: Any) -> tuple[int, ...]:
    return tuple(local_shape(tuple(shape), placements_of(placements), tuple(mesh.shape)))


class PipelineModule(StateDictMixin, nn.Module):
    """A model run as a pipeline by a Plan with ``degrees["pp"] > 1``.

    Holds only this rank's stages' parameters (DTensors on its (dp, tp) submesh), under the
    model's own names; a tied parameter appears on every rank that uses it. ``stages`` lists
    every stage's ``(StageGraph, TracedGraph, local program)``, the program ``None`` for stages
    of other ranks.
    """

    def __init__(self, model: nn.Module, plan: Plan, device_mesh: Any, stages: _Stages,
                 canonical: dict[str, str], input_spec: Any, timeout_s: float | None = None,
                 compile: bool = False) -> None:
        super().__init__()
        pipe = plan.pipeline
        if pipe is None:
            raise PlanError("PipelineModule needs a plan with a pipeline; use ParallelModule.")
        self.plan, self.device_mesh = plan, device_mesh
        layout_of_plan(plan)  # (checks that every stage holds the sequence as the plan does)
        self._timeout_s = timeout_s
        # seconds of each start-up phase (autopar.parallelize fills it; compile_s: the stages'
        # graphs, compiled on the first step)
        self.startup: dict[str, Any] = {}
        self._pp = plan.degrees["pp"]
        self.pp_rank = device_mesh.get_local_rank("pp")
        self._submesh = device_mesh[tuple(plan.axis_names[1:])]
        self._pp_group = device_mesh.get_group("pp")
        self._spec = input_spec
        self._feeder = _Feeder()
        originals = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers(remove_duplicate=False))
        self._params: dict[str, nn.Parameter] = {}
        self._stage_modules: dict[int, StageModule] = {}
        for st, traced, local in stages:
            if st.index % self._pp != self.pp_rank:
                continue
            for p in traced.params:  # stored as the plan stores them (ZeRO-1: sharded over dp)
                name = canonical.get(p.name, p.name)
                self._add_param(name, originals[name], plan.params[name])
            self._stage_modules[st.index] = StageModule(
                st, traced, local, self._params, canonical, self._feeder,
                pipe.schedule == "zero-bubble", buffers, compile, self.startup)
        self._traced = {st.index: traced for st, traced, _ in stages}
        # per stage of this rank, the gradients it leaves partial over dp: summed over the
        # step's microbatches in flat buffers, each reduced once the stage's last backward is
        # done, while the other stages still run (the plan lists the same buckets); with
        # ZeRO-1 the stage's parameters are gathered at its first forward
        self._issued: dict[int, dict[int, torch.Tensor]] = {}
        self._then: dict[int, list[list[str]]] = {}
        # per stage, parameter -> (dim, chunks, this rank's): stored sharded, its gradient
        # computed whole by the stage
        self._chunked: dict[int, dict[str, tuple[int, int, int]]] = {}
        self._issues: dict[int, Issue] = {}  # ZeRO-3: per stage, its gather (_gatherer)
        for j in self._stage_modules:
            self._once_a_step(j, canonical)
        self._ahead = self._gather_ahead()
        self._tied = self._tied_params(stages, canonical)
        self._held, self._owner = self._params, self._owners(stages, canonical)
        self._state = model_state(model, set(self._owner))
        self._schedule = self._build_schedule(stages)

    def _once_a_step(self, j: int, canonical: dict[str, str]) -> None:
        """Set stage ``j``'s once-a-step work from the plan's step-end buckets
        (``cost_models.sharding.step_end_buckets``): its gradient sink, whose buckets are
        all-reduced in place or (ZeRO-1) reduce-scattered into a new buffer when its last
        backward is done; its parameters' gather (ZeRO-1); and the parameters stored sharded
        whose whole gradient the program computes, of which this rank keeps its chunk."""
        splan, traced = self.plan.pipeline.stages[j], self._traced[j]
        stored = {p.name: self.plan.params[canonical.get(p.name, p.name)] for p in traced.params}
        buckets = step_end_buckets(traced, splan.output_placements, splan.params,
                                   tuple(self._submesh.shape), stored)
        flat = [FlatBucket([canonical.get(n, n) for n in b.params], b.shapes, b.dtype, b.dims,
                           b.parts) for b in buckets]
        groups = [self._submesh.get_group(b.axis).group_name for b in buckets]
        reduced = [i for i, b in enumerate(buckets) if b.kind != "all_gather"]
        ops = torch.ops._c10d_functional

        def issue(b: int, buffer: torch.Tensor) -> None:
            bucket, group = flat[reduced[b]], groups[reduced[b]]
            self._issued.setdefault(j, {})[b] = (
                ops.reduce_scatter_tensor.default(buffer, "sum", bucket.parts, group)
                if bucket.dims else ops.all_reduce_.default(buffer, "sum", group))

        # (hybrid sharding: each reduced part then all-reduced across the replicas, once the
        # step's waits come: _set_sunk_grads)
        self._then[j] = [[self._submesh.get_group(a).group_name for a in buckets[i].then]
                         for i in reduced]
        stage = self._stage_modules[j]
        stage.sink = GradSink([flat[i] for i in reduced], self.plan.pipeline.microbatches, issue)
        gathers = [(flat[i], groups[i]) for i, b in enumerate(buckets) if b.kind == "all_gather"]
        issue = self._gatherer(gathers) if gathers else None
        stage.gather = (lambda: issue()()) if issue is not None else None
        stage.regather = issue is not None and self.plan.techniques.get("zero") == 3
        if stage.regather:  # (issued one action ahead: _gather_ahead)
            self._issues[j] = issue
        scattered = {n for b in buckets if b.kind == "reduce_scatter" for n in b.params}
        for p in traced.params:
            kept = stored_dim(p.name, tuple(splan.params[p.name]), tuple(stored[p.name]))
            if kept is not None and p.name not in scattered:
                axis, dim = kept
                self._chunked.setdefault(j, {})[canonical.get(p.name, p.name)] = (
                    dim, self._submesh.size(axis), self._submesh.get_local_rank(axis))

    def _gatherer(self, buckets: Sequence[tuple[FlatBucket, str]]) -> Issue:
        """A callable that issues the all-gathers (ZeRO) of the parameters of ``buckets``
        (each with its process group), one collective per bucket, and returns the callable
        that waits for them and gives the whole local tensors by name."""

        def issue() -> Callable[[], dict[str, torch.Tensor]]:
            # (detached: the gradients come through the stage's sink, not autograd; the packed
            # shard lives until the gather is waited for, as the plan's memory counts it)
            flats = [(bucket, all_gather_into_buffer(
                bucket.pack([self._params[n].to_local().detach() for n in bucket.names]),
                bucket.parts, group)) for bucket, group in buckets]

            def wait() -> dict[str, torch.Tensor]:
                out: dict[str, torch.Tensor] = {}
                for bucket, flat in flats:
                    out.update(zip(bucket.names, bucket.unpack(funcol.wait_tensor(flat))))
                flats.clear()  # (the flat buffers: held by the parameters made from them only)
                return out

            return wait

        return issue

    def _gather_ahead(self) -> GatherAhead | None:
        """ZeRO-3: this rank's stage gathers, each issued one action ahead in the schedule's
        order (:class:`~autopar.runtime.prefetch.GatherAhead`), or ``None`` without ZeRO-3."""
        if not self._issues:
            return None
        pipe = self.plan.pipeline
        order = action_order(pipe.schedule, self._pp, pipe.virtual_stages,
                             pipe.microbatches)[self.pp_rank]
        ahead = GatherAhead(gathering_stages(order, set(self._issues)), self._issues)
        for j in self._issues:
            self._stage_modules[j].gather = functools.partial(ahead.take, j)
        return ahead

    def _add_param(self, name: str, original: torch.Tensor, placements: Sequence[str]) -> None:
        if name in self._params:
            if tuple(self._params[name].placements) != placements_of(placements):
                raise PlanError(f"parameter {name!r} is used by two stages of one rank with "
                                f"different placements; this is not supported yet.")
            return
        dt = distribute_tensor(original.detach(), self._submesh, placements_of(placements))
        param = nn.Parameter(dt, requires_grad=original.requires_grad)
        self._params[name] = param
        set_module_attr(self, name, param)

    def _owners(self, stages: _Stages, canonical: dict[str, str]) -> dict[str, int]:
        """Each parameter's lowest pipeline rank among those holding it."""
        owner: dict[str, int] = {}
        for st, traced, _ in stages:
            for p in traced.params:
                name = canonical.get(p.name, p.name)
                owner[name] = min(owner.get(name, self._pp), st.index % self._pp)
        return owner

    def _tied_params(self, stages: _Stages, canonical: dict[str, str]
                     ) -> list[tuple[str, tuple[str, ...], tuple[int, ...]]]:
        """Parameters used on more than one pipeline rank: (name, placements, global shape)."""
        ranks: dict[str, set[int]] = {}
        info: dict[str, tuple[tuple[str, ...], tuple[int, ...]]] = {}
        for st, traced, _ in stages:
            for p in traced.params:
                name = canonical.get(p.name, p.name)
                ranks.setdefault(name, set()).add(st.index % self._pp)
                placements = tuple(self.plan.params[name])  # as stored
                if name in info and info[name][0] != placements:
                    raise PlanError(
                        f"parameter {name!r} is placed {info[name][0]} on one stage and "
                        f"{placements} on another; tied parameters need one placement.")
                info.setdefault(name, (placements, p.shape))
        return [(n, *info[n]) for n in sorted(ranks) if len(ranks[n]) > 1]

    def _build_schedule(self, stages: _Stages) -> Any:
        import torch.distributed.pipelining as pipelining

        pipe = self.plan.pipeline
        device = torch.device(self._submesh.device_type)
        pstages = []
        for st, _, _ in stages:
            if st.index not in self._stage_modules:
                continue
            ins, outs = self._example_io(st.index)
            module = self._stage_modules[st.index]
            pstages.append(pipelining.PipelineStage(
                module, st.index, len(stages), device, input_args=ins, output_args=outs,
                group=self._pp_group,
                dw_builder=module.weight_step if module.split_backward else None))
        cls = getattr(pipelining, SCHEDULE_CLASSES[pipe.schedule])
        m = pipe.microbatches
        loss_fn = lambda out, target: out / m  # noqa: E731  (the mean over microbatches)
        if pipe.schedule in _MULTI_STAGE:
            return cls(pstages, m, loss_fn=loss_fn, scale_grads=False)
        return cls(pstages[0], m, loss_fn=loss_fn, scale_grads=False)

    def _example_io(self, j: int) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Local-shaped example inputs/outputs of stage ``j`` (static pipeline metadata; later
        stages' inputs require grad, or earlier stages would silently get no input gradient)."""
        pipe = self.plan.pipeline
        stage = pipe.stages[j]
        traced = self._traced[j]
        nodes = {n.name: n for n in traced.gm.graph.nodes}

        def example(val: Any, placements: Sequence[str]) -> torch.Tensor:
            # (where the stage's plan places it: split on the batch over the data axes, on the
            # sequence over cp, as the planner's boundary_placements)
            return torch.empty(_local(val.shape, placements, self._submesh), dtype=val.dtype,
                               requires_grad=val.dtype.is_floating_point)

        ins = (torch.zeros(1, dtype=torch.long),) if j == 0 else tuple(
            example(nodes[n].meta["val"], stage.nodes[n].outputs[0])
            for n in traced.boundary_inputs)
        last = j == len(pipe.stages) - 1
        out_node = next(n for n in traced.gm.graph.nodes if n.op == "output")
        outs = (torch.empty(()),) if last else tuple(
            example(out_node.args[0][i].meta["val"], stage.output_placements[i])
            for i in traced.boundary_outputs)
        return ins, outs

    def _load_inputs(self, args: tuple, kwargs: dict) -> None:
        from autopar.capture.stages import microbatch_inputs

        pipe = self.plan.pipeline
        flat, spec = tree_flatten((args, kwargs))
        if spec != self._spec:
            raise InputMismatchError(
                f"inputs are structured as {spec}, the plan was made for {self._spec}: call the "
                f"model as with the example inputs.")
        for i, (x, shape) in enumerate(zip(flat, self.plan.input_shapes)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise InputMismatchError(
                    f"input {i} is {got}; the plan was made for {tuple(shape)}. Re-plan with "
                    f"example inputs of this shape (the global batch).")
        chunks, _ = microbatch_inputs(kwargs if kwargs else args, pipe.microbatches)
        for j in self._stage_modules:
            infos = self._traced[j].inputs
            placements = pipe.stages[j].inputs
            layout = layout_of_plan(pipe.stages[j])  # (the sequence's chunk pairs over cp)
            self._feeder.inputs[j] = [
                [distribute_tensor(_arranged(chunk[info.index], layout, placements_of(pl)),
                                   self._submesh, placements_of(pl), src_data_rank=None).to_local()
                 for info, pl in zip(infos, placements)]
                for chunk in chunks]
            self._feeder.next[j] = 0

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One pipelined training step on the global batch; accumulates into ``p.grad`` and
        returns the mean loss on every rank. Every rank passes the same global batch."""
        pipe = self.plan.pipeline
        self._load_inputs(args, kwargs)
        index = torch.arange(pipe.microbatches)
        before = {name: self._params[name].grad for name, _, _ in self._tied if name in self._params}
        for name in before:  # tied gradients are summed over ranks: only this step's part
            self._params[name].grad = None
        with collective_failures("pmodel.step() (pipelined)", self._timeout_s), \
                torch.profiler.record_function("autopar step"):
            return self._run_schedule(index, before)

    def _run_schedule(self, index: torch.Tensor, before: dict[str, torch.Tensor | None]
                      ) -> torch.Tensor:
        losses: list[torch.Tensor] = []
        for stage in self._stage_modules.values():  # (a step that failed may have left some)
            stage.sink.take()
            stage.gathered = None
        self._issued.clear()
        if self._ahead is not None:
            self._ahead.start_step()
        if 0 in self._stage_modules:
            self._schedule.step(index, target=index, losses=losses, return_outputs=False)
        else:
            self._schedule.step(target=index, losses=losses, return_outputs=False)
        self._set_sunk_grads()
        for stage in self._stage_modules.values():  # the gathered parameters: until the step's end
            stage.gathered = None
        self._sync_tied(before)
        if self.plan.pipeline.num_stages - 1 in self._stage_modules:
            total = torch.stack([loss.detach().reshape(()) for loss in losses]).sum()
        else:
            total = torch.zeros(())
        return funcol.wait_tensor(funcol.all_reduce(total, "sum", self._pp_group))

    def _set_sunk_grads(self) -> None:
        """Add the gradients the stages summed locally over the step's microbatches
        (:class:`GradSink`) to the DTensor parameters' ``grad``; those a stage left partial
        over dp were reduced in their buckets, issued at the stage's last backward: wait for
        them here (views of the all-reduced buffers, or of the reduce-scattered shards)."""
        total: dict[str, torch.Tensor] = {}
        for j in sorted(self._stage_modules):
            stage = self._stage_modules[j]
            issued = self._issued.pop(j, {})
            grads = stage.sink.take()
            for b, bucket in enumerate(stage.sink.buckets):
                reduced = funcol.wait_tensor(issued[b]) if b in issued else None
                for group in self._then[j][b] if reduced is not None else ():
                    reduced = funcol.wait_tensor(torch.ops._c10d_functional.all_reduce_.default(
                        reduced, "sum", group))
                if bucket.dims and reduced is not None:
                    grads.update(zip(bucket.names, bucket.chunks(reduced)))
            for name, (dim, parts, rank) in self._chunked.get(j, {}).items():
                if name in grads:  # (the same on every rank of the axis: keep this one's)
                    grads[name] = grads[name].chunk(parts, dim)[rank].contiguous()
            for name, g in grads.items():
                total[name] = g if name not in total else total[name] + g
        for name, g in total.items():
            param = self._params[name]
            fresh = DTensor.from_local(g, self._submesh, param.placements, run_check=False,
                                       shape=param.shape, stride=param.stride())
            param.grad = fresh if param.grad is None else param.grad + fresh

    def _sync_tied(self, before: dict[str, torch.Tensor | None]) -> None:
        """Sum the gradients of parameters used on several pipeline ranks (tied weights)."""
        for name, placements, shape in self._tied:
            param = self._params.get(name)
            if param is not None and param.grad is not None:
                local = param.grad.to_local()
            else:
                local = torch.zeros(_local(shape, placements, self._submesh))
            total = funcol.wait_tensor(funcol.all_reduce(local, "sum", self._pp_group))
            if param is not None:
                grad = DTensor.from_local(total, self._submesh, param.placements,
                                          run_check=False, shape=param.shape, stride=param.stride())
                param.grad = grad if before.get(name) is None else before[name] + grad

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Not available for a pipelined plan: a pipeline runs forward and backward together."""
        raise PlanError("a pipelined plan runs forward and backward together: call "
                        "pmodel.step(*inputs), which returns the loss and fills p.grad.")


def _arranged(x: torch.Tensor, layout: SequenceLayout | None, placements: tuple) -> torch.Tensor:
    """An input of a stage in the order its split over cp needs (as it is without a balanced
    layout)."""
    return x if layout is None else layout.arrange_input(x, placements)
