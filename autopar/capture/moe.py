"""The experts of a mixture-of-experts layer as one op, run on local experts with tokens sent to
them by all-to-all (expert parallelism).

transformers' MoE families (Mixtral, Qwen2/3-MoE, OLMoE, PhiMoE, GraniteMoE, DeepSeek-V3, ...)
share one experts class form (``use_experts_implementation``): weights ``gate_up_proj``
``[experts, 2 * ffn, hidden]`` (or ``up_proj`` without a gate) and ``down_proj``
``[experts, hidden, ffn]`` (transposed when ``is_transposed``), called with the tokens, their
top-k expert ids and weights. :func:`experts_block_form` recognises such a module and
:func:`static_expert_blocks` (``autopar.capture.experts``) swaps its forward, while the model is
captured, for :func:`experts`: one node of the joint graph per layer (and one of
:func:`experts_backward`), whatever the routing, that the planner can split in four ways per
mesh axis (``autopar.strategies.rules``): whole; tokens split, experts whole (data parallel);
tokens and experts split (expert parallel: the op sends each (token, choice) pair to the rank of
the axis holding its expert and brings the result back, all-to-all both ways, as in
Megatron-LM's MoE layer and torchtitan's); tokens whole, experts split (each rank adds its
experts' share, summed after).

Which experts a rank holds is the op's ``owner`` argument: for each expert, the rank within
``group`` (the process group of the dispatching axis, ``""`` for none) that holds it, ``-1`` where
no rank of the group holds it (the share of another replica); the rank's own rows of the weights
are the experts it owns, in increasing order. Captured, every expert is owned by rank 0 of no
group; the lowering (``passes.experts``) gives each rank its own.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from autopar.comm_ops import group_rank_size, register_op_with_collectives

__all__ = ["ACTIVATIONS", "expert_count", "experts", "experts_backward", "experts_block_form",
           "experts_forward", "has_expert_blocks", "routed_rows"]


def _silu_grad(x: torch.Tensor) -> torch.Tensor:
    s = torch.sigmoid(x)
    return s * (1 + x * (1 - s))


def _gelu_grad(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * (1 + torch.erf(x / math.sqrt(2))) + x * torch.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def _gelu_tanh_grad(x: torch.Tensor) -> torch.Tensor:
    c = math.sqrt(2 / math.pi)
    inner = c * (x + 0.044715 * x ** 3)
    t = torch.tanh(inner)
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x)


# activation module class -> (the function, its derivative); transformers' ACT2FN classes
ACTIVATIONS: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor],
                             Callable[[torch.Tensor], torch.Tensor]]] = {
    "SiLU": (F.silu, _silu_grad),
    "SiLUActivation": (F.silu, _silu_grad),
    "GELUActivation": (F.gelu, _gelu_grad),
    "GELU": (F.gelu, _gelu_grad),
    "NewGELUActivation": (lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh_grad),
    "PytorchGELUTanh": (lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh_grad),
    "GELUTanh": (lambda x: F.gelu(x, approximate="tanh"), _gelu_tanh_grad),
    "ReLU": (F.relu, lambda x: (x > 0).to(x.dtype)),
}


def experts_block_form(m: nn.Module) -> str | None:
    """The form string :func:`experts` takes for a transformers experts module ``m``, or None
    when ``m`` is not one or has parts the op does not run (biases, a post-expert norm, a gate
    of its own, an activation not in :data:`ACTIVATIONS`)."""
    if not hasattr(m, "_is_expert_parallel") or not hasattr(m, "down_proj"):
        return None
    from transformers.integrations.moe import _default_apply_gate  # the block is transformers'

    gate = bool(getattr(m, "has_gate", False))
    act = getattr(m, "act_fn", None)
    if getattr(m, "has_bias", False) or getattr(m, "has_post_expert_norm", False) or \
            (gate and getattr(type(m), "_apply_gate", None) is not _default_apply_gate) or \
            type(act).__name__ not in ACTIVATIONS or \
            (isinstance(act, nn.GELU) and act.approximate != "none"):
        return None  # (torch's GELU may be the tanh one under the same class name: not taken)
    return json.dumps({"gate": gate, "transposed": bool(m.is_transposed),
                       "act": type(m.act_fn).__name__})


def has_expert_blocks(model: nn.Module) -> bool:
    """Whether ``model`` has experts that capture as :func:`experts` (and so can be split over
    an ep axis)."""
    return expert_count(model) > 0


def expert_count(model: nn.Module) -> int:
    """The experts an ep degree must split evenly in every MoE layer of ``model`` that captures
    as :func:`experts`: the gcd of their counts (0 without such layers)."""
    counts = [m.down_proj.shape[0] for m in model.modules() if experts_block_form(m) is not None]
    return math.gcd(*counts) if counts else 0


def experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """A transformers experts module's forward as one :func:`experts` call."""
    w_in = self.gate_up_proj if self.has_gate else self.up_proj
    return experts(hidden_states, top_k_index, top_k_weights, w_in, self.down_proj,
                   experts_block_form(self), [0] * self.num_experts, "")


# --- the local computation: rows grouped by local expert --------------------------------------

def _mm(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    return x @ (w if transposed else w.T)


def _local_forward(x: torch.Tensor, counts: list[int], w_in: torch.Tensor, w_out: torch.Tensor,
                   form: dict) -> tuple[torch.Tensor, list[tuple]]:
    """Each local expert on its rows; the output rows and what the backward needs per expert."""
    act = ACTIVATIONS[form["act"]][0]
    out = x.new_zeros(x.shape[0], w_out.shape[2] if form["transposed"] else w_out.shape[1])
    saved, start = [], 0
    for e, c in enumerate(counts):
        rows = x[start:start + c].to(w_in.dtype)
        pre = _mm(rows, w_in[e], form["transposed"])
        if form["gate"]:
            g, u = pre.chunk(2, dim=-1)
            inner = act(g) * u
        else:
            g, u, inner = pre, None, act(pre)
        out[start:start + c] = _mm(inner, w_out[e], form["transposed"]).to(out.dtype)
        saved.append((start, c, rows, g, u, inner))
        start += c
    return out, saved


def _local_backward(grad: torch.Tensor, saved: list[tuple], w_in: torch.Tensor,
                    w_out: torch.Tensor, form: dict, x_dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of :func:`_local_forward`'s input rows and weights from its output's."""
    act, act_grad = ACTIVATIONS[form["act"]]
    t = form["transposed"]
    grad_x = grad.new_zeros(grad.shape[0], w_in.shape[1] if t else w_in.shape[2], dtype=x_dtype)
    grad_in, grad_out = torch.zeros_like(w_in), torch.zeros_like(w_out)
    for e, (start, c, rows, g, u, inner) in enumerate(saved):
        if c == 0:
            continue
        gy = grad[start:start + c].to(w_out.dtype)
        g_inner = _mm(gy, w_out[e], not t)
        grad_out[e] = inner.T @ gy if t else gy.T @ inner
        if form["gate"]:
            g_pre = torch.cat([g_inner * u * act_grad(g), g_inner * act(g)], dim=-1)
        else:
            g_pre = g_inner * act_grad(g)
        grad_x[start:start + c] = _mm(g_pre, w_in[e], not t).to(x_dtype)
        grad_in[e] = rows.T @ g_pre if t else g_pre.T @ rows
    return grad_x, grad_in, grad_out


# --- routing ------------------------------------------------------------------------------

def routed_rows(index: torch.Tensor, owner: list[int], me: int, size: int
                ) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The (token, choice) pairs this rank sends, in sending order (by destination rank, then
    by the expert's place among that rank's experts), and the count per (destination, slot)
    ``[size * local experts]``; and the local expert count. Pairs whose expert no rank of the
    group owns are not sent."""
    own = torch.tensor(owner, device=index.device)
    slot = torch.zeros_like(own)
    per_rank = [int((own == j).sum()) for j in range(size)]
    local = per_rank[me]
    if any(n != local for n in per_rank):
        raise ValueError(f"experts op: owner {owner} gives the {size} ranks of the group "
                         f"{per_rank} experts; each must hold as many.")
    for j in range(size):
        ids = (own == j).nonzero().flatten()
        slot[ids] = torch.arange(ids.numel(), device=own.device)
    e = index.reshape(-1)
    dest = own[e]
    pairs = (dest >= 0).nonzero().flatten()
    key = dest[pairs] * local + slot[e[pairs]]
    order = torch.argsort(key, stable=True)
    counts = torch.bincount(key, minlength=size * local)
    return pairs[order], counts, local


def _all_to_all(x: torch.Tensor, send: list[int], recv: list[int], pg: Any) -> torch.Tensor:
    if pg is None:
        return x
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), recv, send, group=pg)
    return out


class _Exchange:
    """One layer's dispatch: the pairs sent, the splits both ways, and how the received rows
    regroup by local expert."""

    def __init__(self, index: torch.Tensor, owner: list[int], group: str) -> None:
        self.pg, me, size = group_rank_size(group)
        self.pairs, counts, local = routed_rows(index, owner, me, size)
        got = counts if self.pg is None else _all_to_all(counts, [local] * size, [local] * size,
                                                         self.pg)
        self.send = counts.view(size, local).sum(1).tolist()
        self.recv = got.view(size, local).sum(1).tolist()
        expert = torch.arange(local, device=index.device).repeat(size)
        self.perm = torch.argsort(torch.repeat_interleave(expert, got), stable=True)
        self.counts = got.view(size, local).sum(0).tolist()

    def dispatch(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows in sending order -> rows here, grouped by local expert."""
        return _all_to_all(rows, self.send, self.recv, self.pg)[self.perm]

    def combine(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows grouped by local expert -> the sender's rows, in its sending order."""
        back = torch.empty_like(rows)
        back[self.perm] = rows
        return _all_to_all(back, self.recv, self.send, self.pg)


# --- the ops ------------------------------------------------------------------------------

def _experts(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, w_in: torch.Tensor,
            w_out: torch.Tensor, form: str, owner: list[int], group: str) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{index[t, k]}(hidden[t])`` over the experts this rank's
    group holds (see the module docstring); ``[tokens, hidden]``."""
    spec = json.loads(form)
    ex = _Exchange(index, owner, group)
    k = index.shape[-1]
    rows = ex.dispatch(hidden[ex.pairs // k])
    out, _ = _local_forward(rows, ex.counts, w_in, w_out, spec)
    back = ex.combine(out)
    per_pair = back.new_zeros(index.numel(), back.shape[-1])
    per_pair[ex.pairs] = back
    # (weighted and summed in the promoted dtype, as transformers' grouped form does)
    dtype = torch.promote_types(back.dtype, weights.dtype)
    mixed = per_pair.view(*index.shape, -1).to(dtype) * weights.unsqueeze(-1).to(dtype)
    return mixed.sum(-2).to(hidden.dtype)


experts = torch.library.custom_op("autopar::experts", mutates_args=())(_experts)


@experts.register_fake
def _experts_fake(hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                  w_in: torch.Tensor, w_out: torch.Tensor, form: str, owner: list[int],
                  group: str) -> torch.Tensor:
    return torch.empty_like(hidden)


def _experts_backward(grad: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor,
                     weights: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor, form: str,
                     owner: list[int], group: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of :func:`experts`'s hidden, weights, w_in and w_out from its output's.
    The pairs go to their experts again with the output's gradient and their routing weight
    (one all-to-all), the experts run again, and the rows' gradients come back with the
    weights' (one all-to-all)."""
    spec = json.loads(form)
    ex = _Exchange(index, owner, group)
    k, d = index.shape[-1], hidden.shape[-1]
    token = ex.pairs // k
    sent = torch.cat([hidden[token], grad[token].to(hidden.dtype),
                      weights.reshape(-1)[ex.pairs, None].to(hidden.dtype)], dim=-1)
    rows = ex.dispatch(sent)
    x, g, w = rows[:, :d], rows[:, d:2 * d], rows[:, 2 * d:]
    y, saved = _local_forward(x, ex.counts, w_in, w_out, spec)
    grad_w = (y.to(g.dtype) * g).sum(-1, keepdim=True)
    grad_x, grad_in, grad_out = _local_backward(g * w, saved, w_in, w_out, spec, hidden.dtype)
    back = ex.combine(torch.cat([grad_x, grad_w.to(grad_x.dtype)], dim=-1))
    grad_hidden = torch.zeros_like(hidden).index_add_(0, token, back[:, :d])
    grad_weights = torch.zeros(index.numel(), dtype=weights.dtype, device=weights.device)
    grad_weights[ex.pairs] = back[:, d].to(weights.dtype)
    return grad_hidden, grad_weights.view(index.shape), grad_in, grad_out


experts_backward = torch.library.custom_op("autopar::experts_backward",
                                           mutates_args=())(_experts_backward)


@experts_backward.register_fake
def _experts_backward_fake(grad: torch.Tensor, hidden: torch.Tensor, index: torch.Tensor,
                           weights: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor,
                           form: str, owner: list[int], group: str) -> tuple:
    return (torch.empty_like(hidden), torch.empty_like(weights), torch.empty_like(w_in),
            torch.empty_like(w_out))


def _setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.save_for_backward(*inputs[:5])
    ctx.args = inputs[5:]


def _backward(ctx: Any, grad: torch.Tensor) -> tuple:
    hidden, index, weights, w_in, w_out = ctx.saved_tensors
    g_hidden, g_weights, g_in, g_out = experts_backward(grad, hidden, index, weights, w_in, w_out,
                                                        *ctx.args)
    return g_hidden, None, g_weights, g_in, g_out, None, None, None


experts.register_autograd(_backward, setup_context=_setup)
register_op_with_collectives(torch.ops.autopar.experts.default, _experts)
register_op_with_collectives(torch.ops.autopar.experts_backward.default, _experts_backward)
