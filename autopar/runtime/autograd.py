"""Forward with autograd for a lowered plan: the local joint program split in two.

The per-rank joint program (forward and backward with explicit collectives) is partitioned into
a forward graph, which returns the loss and the tensors saved for backward, and a backward graph,
which turns the saved tensors and the loss's gradient into parameter gradients. Both run inside
one ``torch.autograd.Function``, so ``loss = pmodel(...); loss.backward()`` works as in eager
PyTorch and gradients reach the DTensor parameters through ``DTensor.to_local``.
"""

from __future__ import annotations

import copy
from typing import Any, Sequence

import torch
import torch.fx as fx

from autopar import _torch_private as private

__all__ = ["split_forward_backward", "JointFunction"]


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
    return private.partition_joint(gm, num_fwd_outputs=num_fwd_outputs)


class JointFunction(torch.autograd.Function):
    """Runs the forward graph; its backward runs the backward graph.

    ``forward(ctx, fwd, bwd, grad_slots, num_outputs, split_backward, *primals)`` returns the
    forward's first ``num_outputs`` results (one tensor when ``num_outputs == 1``).
    ``grad_slots[j]`` is the position of primal ``j``'s gradient among the backward graph's
    outputs, or ``None``.

    The backward computes every gradient at once. A zero-bubble pipeline schedule calls it twice
    (input gradients first, weight gradients later, with the graph retained): with
    ``split_backward`` the second call returns the gradients kept from the first instead of
    recomputing them.
    """

    @staticmethod
    def forward(ctx: Any, fwd: fx.GraphModule, bwd: fx.GraphModule, grad_slots: tuple,
                num_outputs: int, split_backward: bool, *primals: torch.Tensor) -> Any:
        outs = fwd(*primals)
        results, saved = outs[:num_outputs], outs[num_outputs:]
        tensors = [s for s in saved if isinstance(s, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        ctx.saved_layout = [isinstance(s, torch.Tensor) for s in saved]
        ctx.others = [s for s in saved if not isinstance(s, torch.Tensor)]
        ctx.bwd, ctx.grad_slots = bwd, grad_slots
        ctx.kept, ctx.split_backward = None, split_backward
        if num_outputs == 1:
            return results[0].detach()
        return tuple(r.detach() for r in results)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> Any:
        if ctx.kept is not None:  # second call of a split (zero-bubble) backward
            grads, ctx.kept = ctx.kept, None
            return grads
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        saved = [next(tensors) if is_t else next(others) for is_t in ctx.saved_layout]
        grads = ctx.bwd(*saved, *grad_outputs)
        result = (None, None, None, None, None,
                  *(grads[k] if k is not None else None for k in ctx.grad_slots))
        if ctx.split_backward:
            ctx.kept = result
        return result
