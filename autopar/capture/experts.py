"""Expert blocks whose own forward depends on the routing, traced in an equivalent static form.

Most mixture-of-experts models of transformers run their experts as grouped matmuls over the
tokens sorted by expert (``config._experts_implementation == "grouped_mm"``): shapes do not
depend on the routing and ``torch.export`` captures them whole. A few families still loop over
the experts the batch routes to, or turn the per-expert token counts into Python ints, which no
single graph can hold. For those, :func:`static_expert_blocks` swaps the block's forward, for
the duration of an export, for the same computation in the grouped form: the (token, expert)
pairs sorted by expert, each expert's rows a group of :func:`grouped_mm` (group ends from the
counts, computed in the graph), the results weighted and summed back per token.
The same numbers up to the order of fp32 sums. The replacements are registered by the class
name of the block (:func:`expert_block`); the model itself is not changed.
"""

from __future__ import annotations

import contextlib
import types
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn

from autopar.capture.moe import experts_block_form, experts_forward

__all__ = ["expert_block", "grouped_mm", "grouped_mm_backward", "static_expert_blocks",
           "sorted_by_expert"]

_BLOCKS: dict[str, Callable[..., Any]] = {}


# The grouped matmul the static forms run: ``x[rows of group e] @ w[e]`` for each expert e, the
# groups' ends in ``ends``. One opaque op (its own fake and backward), so that the joint graph
# holds one node per expert layer whatever the routing, and the cost model prices its FLOPs
# (``cost_models.compute``); torch's ``grouped_mm`` traces in bf16 only.
@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """``[rows, in] x [experts, in, out] -> [rows, out]``, rows grouped by expert up to ``ends``."""
    out = x.new_zeros(x.shape[0], w.shape[2])
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = x[start:end] @ w[e]
        start = end
    return out


@grouped_mm.register_fake
def _grouped_mm_fake(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], w.shape[2])


@torch.library.custom_op("autopar::grouped_mm_backward", mutates_args=())
def grouped_mm_backward(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of :func:`grouped_mm`'s ``x`` and ``w`` from its output's ``grad``."""
    grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(w)
    start = 0
    for e, end in enumerate(ends.tolist()):
        if end > start:
            grad_x[start:end] = grad[start:end] @ w[e].T
            grad_w[e] = x[start:end].T @ grad[start:end]
        start = end
    return grad_x, grad_w


@grouped_mm_backward.register_fake
def _grouped_mm_backward_fake(grad: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                              ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(w)


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    x, w, ends = ctx.saved_tensors
    grad_x, grad_w = grouped_mm_backward(grad, x, w, ends)
    return grad_x, grad_w, None


grouped_mm.register_autograd(_backward, setup_context=_setup)


def expert_block(class_name: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn(module, *args)`` as the static forward of modules of ``class_name``."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        _BLOCKS[class_name] = fn
        return fn

    return register


@contextlib.contextmanager
def static_expert_blocks(model: nn.Module) -> Iterator[list[str]]:
    """Within the block, the registered expert blocks of ``model`` run their static forward;
    yields their module names. Each module's own ``forward`` is restored on exit."""
    patched: list[tuple[nn.Module, Any]] = []
    names = []
    try:
        for name, m in model.named_modules():
            fn = _BLOCKS.get(type(m).__name__)
            if fn is None and experts_block_form(m) is not None:
                fn = experts_forward  # transformers' experts form: one op (capture.moe)
            if fn is not None:
                patched.append((m, m.__dict__.get("forward")))
                m.forward = types.MethodType(fn, m)
                names.append(name)
        yield names
    finally:
        for m, own in patched:
            if own is None:
                del m.forward
            else:
                m.forward = own


def sorted_by_expert(top_k_index: torch.Tensor, num_experts: int
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (token, choice) pairs of a top-k routing sorted by expert: each pair's position in
    the flattened ``[tokens, k]`` routing, its token, and the group ends (cumulative counts per
    expert, int32) of ``grouped_mm``."""
    k = top_k_index.shape[-1]
    experts, order = torch.sort(top_k_index.reshape(-1), stable=True)
    counts = torch.histc(experts.float(), bins=num_experts, min=0, max=num_experts - 1)
    return order, order // k, torch.cumsum(counts, 0, dtype=torch.int32)


@expert_block("DbrxExperts")
def _dbrx_experts(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                  top_k_weights: torch.Tensor) -> torch.Tensor:
    """DBRX's experts (a GLU each, weights stored as ``[experts * ffn, hidden]``), grouped."""
    batch = hidden_states.shape[0]
    x = hidden_states.reshape(-1, self.hidden_size)
    shape = (self.num_experts, self.ffn_hidden_size, self.hidden_size)
    w1, v1, w2 = (getattr(self.mlp, n).view(shape) for n in ("w1", "v1", "w2"))
    order, token, ends = sorted_by_expert(top_k_index, self.num_experts)
    rows = x[token]
    gate = self.mlp.activation_fn(grouped_mm(rows, w1.transpose(1, 2), ends))
    inner = gate * grouped_mm(rows, v1.transpose(1, 2), ends)
    out = grouped_mm(inner, w2, ends) * top_k_weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add(0, token, out).view(batch, -1, self.hidden_size)


@expert_block("JetMoeTopKGating")
def _jetmoe_gating(self: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """JetMoE's top-k gating with the per-expert counts kept a tensor (its own turns them into
    Python ints, ``expert_size.tolist()``); read by :func:`_jetmoe_experts`."""
    logits = self.layer(hidden_states).float()
    top_logits, top_index = logits.topk(self.top_k, dim=1)
    gates = torch.softmax(top_logits, dim=1).type_as(hidden_states)
    order, token, ends = sorted_by_expert(top_index, self.num_experts)
    return order, token, gates.flatten()[order], ends, logits


@expert_block("JetMoeParallelExperts")
def _jetmoe_experts(self: nn.Module, inputs: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """JetMoE's experts (``weight``: ``[experts, out, in]``) over rows grouped by expert, the
    group ends from :func:`_jetmoe_gating`."""
    return grouped_mm(inputs, self.weight.transpose(1, 2), ends)
