"""``ParallelModule``: runs a Plan's per-rank program with DTensor parameters.

Parameters are ``nn.Parameter``s wrapping DTensors under the original model's names, so
``p.full_tensor()``, ``p.grad.full_tensor()``, ``torch.optim`` and DCP work as with PyTorch's own
tensor parallelism; ``state_dict()`` gives the single-device model's state dict with full tensors
(:mod:`autopar.runtime.state`). :meth:`ParallelModule.step` runs forward and backward of the whole batch in
one local program (explicit collectives) and leaves gradients in ``p.grad``.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor
from autopar._torch_private import tree_flatten

from autopar.errors import InputMismatchError
from autopar.graph import TracedGraph
from autopar.plan import Plan
from autopar.sequence_layout import layout_of_plan
from autopar.passes.gather_buffers import compilable, gather_into_buffers
from autopar.passes.lower import placements_of
from autopar.capture.layers import set_module_attr
from autopar.runtime.faults import collective_failures
from autopar.runtime.state import StateDictMixin, model_state

__all__ = ["ParallelModule"]


class ParallelModule(StateDictMixin, nn.Module):
    """A model parallelized by a :class:`Plan` on a DeviceMesh (see module docstring)."""

    def __init__(self, model: nn.Module, traced: TracedGraph, plan: Plan, mesh: Any,
                 local_program: fx.GraphModule, compile: bool = False,
                 timeout_s: float | None = None) -> None:
        super().__init__()
        self.plan = plan
        self.device_mesh = mesh
        self._traced = traced
        self._layout = layout_of_plan(plan)
        self._program = local_program
        # what step() runs (passes.gather_buffers, made on first use); forward() splits
        # _program itself
        self._runnable: fx.GraphModule | None = None
        self._compile = compile
        self._compiled: Any = None
        # seconds of each start-up phase (autopar.parallelize fills it; compile_s: the first step)
        self.startup: dict[str, Any] = {}
        self._split: tuple[fx.GraphModule, fx.GraphModule] | None = None
        self._timeout_s = timeout_s
        self._names: list[str] = []
        originals = dict(model.named_parameters(remove_duplicate=False))
        by_name: dict[str, nn.Parameter] = {}
        for p in traced.params:
            if p.tied_to is not None:
                by_name[p.name] = by_name[p.tied_to]
            else:
                full = originals[p.name].detach()
                dt = distribute_tensor(full, mesh, placements_of(plan.params[p.name]))
                by_name[p.name] = nn.Parameter(dt, requires_grad=originals[p.name].requires_grad)
            set_module_attr(self, p.name, by_name[p.name])
            self._names.append(p.name)
        self._by_name = by_name
        self._held, self._owner, self._pp_group = by_name, dict.fromkeys(by_name, 0), None
        self._state = model_state(model, set(by_name))
        owned = dict(model.named_buffers(remove_duplicate=False))
        self._buffers_local = {b.node: owned[b.name].detach() for b in traced.buffers}

    def _local_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        flat, spec = tree_flatten((args, kwargs))
        if spec != self._traced.input_spec:
            raise InputMismatchError(
                f"inputs are structured as {spec}, the plan was made for "
                f"{self._traced.input_spec}: call the model as with the example inputs.")
        out = []
        for info, x, placements in zip(self._traced.inputs, flat, self.plan.inputs):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != info.shape or x.dtype != info.dtype:
                got = f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
                raise InputMismatchError(
                    f"input {info.index} is {got}; the plan was made for {info.shape} "
                    f"{info.dtype}. Re-plan with example inputs of this shape (the global batch).")
            if self._layout is not None:  # the sequence in the chunk pairs of the cp ranks
                x = self._layout.arrange_input(x, placements_of(placements))
            dt = distribute_tensor(x, self.device_mesh, placements_of(placements), src_data_rank=None)
            out.append(dt.to_local())
        return out

    def step(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """One forward+backward on the global batch; accumulates into ``p.grad``; returns the loss.

        Every rank passes the same global batch; each keeps the shard its placement says.
        """
        inputs = iter(self._local_inputs(args, kwargs))
        feeds: list[torch.Tensor] = []
        params = {p.node: p for p in self._traced.params}
        for name in self._placeholder_order():
            if name in params:
                feeds.append(self._by_name[params[name].name].to_local().detach())
            elif name in self._buffers_local:
                feeds.append(self._buffers_local[name])
            elif name in self._traced.tangent_nodes:
                feeds.append(torch.ones((), dtype=torch.float32, device=self.device_mesh.device_type))
            else:
                feeds.append(next(inputs))
        with collective_failures("pmodel.step()", self._timeout_s), \
                torch.profiler.record_function("autopar step"):
            outs = self._execute(feeds)
        for p in self._traced.params:
            if p.grad_output_index is None or outs[p.grad_output_index] is None:
                continue
            param = self._by_name[p.name]
            g = DTensor.from_local(outs[p.grad_output_index], self.device_mesh,
                                   param.placements, run_check=False,
                                   shape=param.shape, stride=param.stride())
            param.grad = g if param.grad is None else param.grad + g
        return outs[self._traced.loss_output_index].detach()

    def _execute(self, feeds: list[torch.Tensor]) -> Any:
        if self._runnable is None:  # the program, its all-gathers into buffers of its own
            self._runnable = gather_into_buffers(copy.deepcopy(self._program))
        if not self._compile:
            return self._runnable(*feeds)
        if self._compiled is None:  # compiled on first use, for these (static) shapes
            from autopar import _torch_private as private

            t0 = time.perf_counter()
            self._compiled = private.inductor_compile(compilable(self._runnable), feeds)
            self.startup["compile_s"] = time.perf_counter() - t0
        return self._compiled(*feeds)

    def _placeholder_order(self) -> list[str]:
        return [n.name for n in self._traced.gm.graph.nodes if n.op == "placeholder"]

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """Forward with autograd: returns the loss as the model does; ``.backward()`` fills grads.

        A model returning a loss tensor gets the loss tensor; a Hugging Face model gets its output
        class with ``loss`` set (the other fields, such as logits, are not computed by the plan).

        Uses the same lowered program as :meth:`step`, split into forward and backward graphs
        (the tensors saved for backward stay alive in between). :meth:`step` is faster when
        nothing runs between forward and backward.
        """
        from autopar.runtime.autograd import JointFunction, split_forward_backward

        if self._split is None:
            self._split = split_forward_backward(self._program, self._placeholder_order())
        fwd, bwd = self._split
        inputs = iter(self._local_inputs(args, kwargs))
        params = {p.node: p for p in self._traced.params}
        primals, slots = [], []
        for name in self._placeholder_order():
            if name in self._traced.tangent_nodes:
                continue
            if name in params:
                info = params[name]
                primals.append(self._by_name[info.name].to_local())
                slots.append(info.grad_output_index - 1 if info.grad_output_index is not None else None)
            elif name in self._buffers_local:
                primals.append(self._buffers_local[name])
                slots.append(None)
            else:
                primals.append(next(inputs))
                slots.append(None)
        with collective_failures("pmodel(...) (forward)", self._timeout_s):
            loss = JointFunction.apply(fwd, bwd, tuple(slots), 1, False, None, *primals)
        return self._traced.wrap_loss(loss)
