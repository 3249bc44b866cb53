"""A sharding rule for your own operator.

    python examples/custom_op_rule.py

autopar knows how every aten op may be split from DTensor's rules and its own. An operator of
your own (``torch.library.custom_op``: a fused kernel, say) is opaque: without a rule autopar
replicates it, with a warning, and the activations around it are gathered. A rule lists, for
one mesh axis, the placements that are valid together, ``[output, input, ...]``; autopar
expands it over every mesh axis and gives it to both the solver and DTensor.

Here a fused "scaled GELU" sits between the two matmuls of an MLP. Element-wise, it may be
split along any dim of its input as long as its output is split alike. With the rule the solver
keeps the Megatron layout (first matmul column-parallel, second row-parallel) straight through
it: no all-gather in the middle.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import autopar


@torch.library.custom_op("autopar_example::scaled_gelu", mutates_args=())
def scaled_gelu(x: torch.Tensor, scale: float) -> torch.Tensor:
    """``gelu(x) * scale`` as one operator (stands for a fused kernel)."""
    return torch.nn.functional.gelu(x) * scale


@scaled_gelu.register_fake
def _(x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("autopar_example::scaled_gelu_backward", mutates_args=())
def scaled_gelu_backward(grad: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    """The gradient of :func:`scaled_gelu` with respect to ``x``."""
    with torch.enable_grad():
        x_ = x.detach().requires_grad_()
        y = torch.nn.functional.gelu(x_) * scale
        return torch.autograd.grad(y, x_, grad)[0]


@scaled_gelu_backward.register_fake
def _(grad: torch.Tensor, x: torch.Tensor, scale: float) -> torch.Tensor:
    return torch.empty_like(x)


def _setup(ctx: Any, inputs: tuple, output: torch.Tensor) -> None:
    ctx.save_for_backward(inputs[0])
    ctx.scale = inputs[1]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return scaled_gelu_backward(grad, ctx.saved_tensors[0], ctx.scale), None


scaled_gelu.register_autograd(_backward, setup_context=_setup)


def elementwise_rule(args_meta: tuple, kwargs_meta: dict) -> list[list[Any]]:
    """Single-axis strategies of an element-wise op on its tensor arguments: all of them split
    on the same dim, or all replicated."""
    ndim = len(args_meta[0].shape)
    tensors = sum(hasattr(a, "shape") for a in args_meta)  # tensors arrive as TensorMeta
    return [[Shard(d)] * (1 + tensors) for d in range(ndim)] + [[Replicate()] * (1 + tensors)]


class FusedMLP(nn.Module):
    """A two-layer MLP with the custom activation, returning a regression loss."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((self.fc2(scaled_gelu(self.fc1(x), 1.5)) - target) ** 2).mean()


def _ops(plan: autopar.Plan) -> dict[str, Any]:
    return {name: n for name, n in plan.nodes.items() if "scaled_gelu" in n.op}


def main(argv: Sequence[str] | None = None) -> tuple[autopar.Plan, autopar.Plan]:
    """Plan before and after registering the rule; print the custom ops' placements. Returns
    (before, after)."""
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args(argv)
    torch.manual_seed(0)
    model = FusedMLP(args.dim)
    inputs = (torch.randn(args.tokens, args.dim), torch.randn(args.tokens, args.dim))
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)
    config = autopar.Config(tp=2)
    before = autopar.plan(model, mesh, inputs, config=config)
    for op in (torch.ops.autopar_example.scaled_gelu.default,
               torch.ops.autopar_example.scaled_gelu_backward.default):
        autopar.register_op_rule(op)(elementwise_rule)  # or use it as a decorator
    after = autopar.plan(model, mesh, inputs, config=config)
    for label, plan in (("without a rule", before), ("with the rule", after)):
        print(f"{label}: predicted step {plan.predicted['step_time_s'] * 1e3:.3f} ms")
        for name, n in _ops(plan).items():
            print(f"  {name} ({n.op}): output {n.outputs[0]}, inputs {n.inputs}")
        for w in plan.warnings:
            print(f"  warning: {w}")
    return before, after


if __name__ == "__main__":
    main()
