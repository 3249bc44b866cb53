"""Sharding rules autopar adds to DTensor's: a decorator registry keyed on the aten op.

A rule lists, for one mesh axis, the valid placement combinations of an op as
``[out_0, ..., out_{k-1}, in_0, in_1, ...]`` (``None`` for non-tensor outputs); autopar expands
it over every mesh axis (DTensor's ``expand_to_full_mesh_op_strategy``) and registers it into
DTensor's propagator too, so the planner and the runtime use the same rule.

    @autopar.register_op_rule(torch.ops.mylib.fused_gelu.default, num_outputs=1)
    def fused_gelu_rule(args_meta, kwargs_meta):
        ndim = len(args_meta[0].shape)
        return [[Shard(d), Shard(d)] for d in range(ndim)] + [[Replicate(), Replicate()]]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar.capture.moe  # noqa: F401  (registers the experts ops)
from autopar import _torch_private as private
from autopar._torch_private import (
    OpOverload,
    OpSchema,
    OpStrategy,
    RuntimeSchemaInfo,
    TensorMeta,
    expand_to_full_mesh_op_strategy,
)

__all__ = ["ATTENTION_CAUSAL_ARG", "CPU_ATTENTION", "CPU_ATTENTION_BACKWARD", "EXPERT_OPS",
           "OpRule", "SEQUENCE_ATTENTION_QUERY", "SEQ_DIM",
           "attention_is_causal", "dispatch_axes", "dispatches_experts",
           "expert_owners", "register_op_rule", "splits_experts", "registered_rules", "rule_for"]

RuleFn = Callable[[tuple[Any, ...], dict[str, Any]], list[list[Any]]]


@dataclass(frozen=True)
class OpRule:
    """A registered rule: the op, its number of outputs and the single-axis rule function."""

    op: OpOverload
    num_outputs: int
    fn: RuleFn
    static_argnum: int
    static_kwargs: tuple[str, ...] = ()


_RULES: dict[OpOverload, OpRule] = {}


def register_op_rule(
    op: OpOverload, num_outputs: int = 1, static_argnum: int = 100,
    static_kwargs: Sequence[str] = (),
) -> Callable[[RuleFn], RuleFn]:
    """Decorator: register a single-axis sharding rule for ``op`` (overrides DTensor's).

    The function receives the arguments with tensors replaced by ``TensorMeta`` (shape, stride,
    dtype) and returns a list of placement lists ``[outputs..., tensor inputs...]``.
    ``static_argnum``: arguments from this position on are part of the cache key (as DTensor's
    ``RuntimeSchemaInfo``), e.g. flags that change the valid shardings; ``static_kwargs``: keyword
    arguments that are too (e.g. a cast's ``dtype``, which the output's metadata depends on).
    """

    def deco(fn: RuleFn) -> RuleFn:
        rule = OpRule(op, num_outputs, fn, static_argnum, tuple(static_kwargs))
        _RULES[op] = rule
        _install(rule)
        return fn

    return deco


def registered_rules() -> dict[OpOverload, OpRule]:
    """The rules registered so far (autopar's own and the user's)."""
    return dict(_RULES)


def rule_for(op: Any) -> OpRule | None:
    """The registered rule for ``op``, if any."""
    return _RULES.get(op)


def _install(rule: OpRule) -> None:
    def strategy(op_schema: OpSchema) -> OpStrategy:
        mesh = op_schema.get_mesh_from_args(validate=False)
        single = rule.fn(op_schema.args_meta, op_schema.kwargs_meta)
        return expand_to_full_mesh_op_strategy(
            mesh, op_schema, single, input_index=rule.num_outputs
        )

    prop = private.sharding_propagator()
    prop.op_single_dim_strategy_funcs.pop(rule.op, None)
    info = RuntimeSchemaInfo(rule.static_argnum, static_kwargkey=list(rule.static_kwargs) or None)
    prop.register_op_strategy(rule.op, strategy, schema_info=info)


def _tensor_count(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> int:
    return sum(isinstance(a, TensorMeta) for a in list(args_meta) + list(kwargs_meta.values()))


# Scaled-dot-product attention on CPU (the flash kernel): DTensor has no rule for it.
# q, k, v are [batch, heads, seq, head_dim]; shard batch (dim 0) or heads (dim 1).
# An attention mask, if given, is [batch or 1, heads or 1, seq, seq]: it follows q's sharding on a
# dim only where it is not broadcast.
def _mask_placement(kwargs_meta: dict[str, Any], dim: int) -> list[Any]:
    mask = kwargs_meta.get("attn_mask")
    if mask is None:
        return []
    return [Shard(dim) if mask.shape[dim] != 1 else Replicate()]


# A third: the queries (with the output and its log-sum-exp) sharded on the sequence, dim 2, the
# keys and values whole (context parallelism as Llama 3 ran it: keys and values all-gathered,
# their gradients reduced); without dropout only (its random mask would have to follow the
# queries' rows). A causal mask then needs the rank's query positions: the lowering runs such a
# node itself (``autopar.passes.seq_attention``); DTensor's dispatch runs the others.
# A fourth: everything sharded on the sequence, the ring form (keys and values passed around
# the axis's ranks block by block, ``autopar.passes.ring_attention``), which the lowering always
# runs itself: DTensor's dispatch would attend each rank's queries to its own keys only (the
# rule is registered in DTensor's propagator with the others, so a DTensor call of the kernel
# outside autopar's lowering with its keys split on the sequence would do just that).
# The attention ops with the third and fourth rules, each with where its queries are among its
# tensor inputs (the planner pins them on cp, the lowering runs the ring and a causal third)
CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
SEQ_DIM = 2  # the sequence dim of attention's tensors: [batch, heads, sequence, head dim]
SEQUENCE_ATTENTION_QUERY = {CPU_ATTENTION: 0, CPU_ATTENTION_BACKWARD: 1}


# where ``is_causal`` is among their positional arguments
ATTENTION_CAUSAL_ARG = {CPU_ATTENTION: 4, CPU_ATTENTION_BACKWARD: 7}


def attention_is_causal(target: Any, args: Sequence[Any]) -> bool:
    """Whether a call of one of those attention ops with positional ``args`` asks the kernel for
    its causal mask."""
    index = ATTENTION_CAUSAL_ARG[target]
    return len(args) > index and bool(args[index])


def _no_dropout(args_meta: tuple[Any, ...], index: int) -> bool:
    return len(args_meta) <= index or not args_meta[index]


@register_op_rule(CPU_ATTENTION, 2, 3)
def _sdpa_cpu_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> list[list[Any]]:
    rules = [[Replicate()] * 5 + ([Replicate()] if kwargs_meta.get("attn_mask") is not None else [])]
    for dim in (0, 1):
        rules.append([Shard(dim)] * 5 + _mask_placement(kwargs_meta, dim))
    if _no_dropout(args_meta, 3):
        seq = Shard(SEQ_DIM)
        rules.append([seq] * 3 + [Replicate()] * 2 + _mask_placement(kwargs_meta, SEQ_DIM))
        rules.append([seq] * 5 + _mask_placement(kwargs_meta, SEQ_DIM))  # the ring
    return rules


@register_op_rule(CPU_ATTENTION_BACKWARD, 3, 6)
def _sdpa_cpu_backward_rule(
    args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]
) -> list[list[Any]]:
    # outputs grad_q, grad_k, grad_v; inputs grad_out, q, k, v, out, logsumexp (+ mask)
    rules = [[Replicate()] * 9 + ([Replicate()] if kwargs_meta.get("attn_mask") is not None else [])]
    for dim in (0, 1):
        rules.append([Shard(dim)] * 9 + _mask_placement(kwargs_meta, dim))
    if _no_dropout(args_meta, 6):  # grad_k, grad_v: each rank's queries' share of the sum
        seq = Shard(SEQ_DIM)
        rules.append([seq, Partial(), Partial(), seq, seq, Replicate(), Replicate(), seq, seq]
                     + _mask_placement(kwargs_meta, SEQ_DIM))
        rules.append([seq] * 9 + _mask_placement(kwargs_meta, SEQ_DIM))  # the ring
    return rules


# The functional copy (``aten.copy(self, src)``, which functionalization makes of an in-place
# ``copy_``, e.g. DeepSeek-V3's attention writing its rotary part into a preallocated key):
# the output is ``src`` broadcast to ``self``'s shape, so it splits as a pointwise op (DTensor
# registers the in-place ``copy_`` as one, not the functional op). Per dim of ``self``: split
# ``self``, the output and ``src`` where ``src`` has that dim whole, else ``src`` whole.
@register_op_rule(torch.ops.aten.copy.default, 1, 2)
def _copy_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> list[list[Any]]:
    dst, src = args_meta[0].shape, args_meta[1].shape
    off = len(dst) - len(src)
    rules = [[Replicate()] * 3]
    for d in range(len(dst)):
        whole = d >= off and src[d - off] == dst[d]
        rules.append([Shard(d), Shard(d), Shard(d - off) if whole else Replicate()])
    return rules


# The experts of an MoE layer (``autopar.capture.moe``): inputs hidden [tokens, hidden], the
# top-k ids and weights [tokens, k], the two expert weights [experts, ...]. Per mesh axis: all
# whole; tokens split, experts whole (data parallel: the weights' gradients partial); tokens
# and experts split (expert parallel: the op sends each pair to its expert's rank and back,
# all-to-all, run by ``passes.experts``); tokens whole, experts split (each rank adds its own
# experts' share: the output partial, summed after).

# the experts ops, each with where its tokens and its first expert weight are among its tensor
# inputs (read by the planner's ep pinning and by passes.experts)
EXPERT_OPS = {
    torch.ops.autopar.experts.default: (0, 3),
    torch.ops.autopar.experts_backward.default: (1, 4),
}


def dispatches_experts(target: Any, inputs: tuple, axis: int) -> bool:
    """Whether a strategy's input placements ``inputs`` of an experts op split both the tokens
    and the experts over mesh ``axis`` (tokens sent to their experts' ranks there)."""
    tok, wt = EXPERT_OPS[target]
    return splits_experts(inputs[tok][axis]) and splits_experts(inputs[wt][axis])


def splits_experts(p: Any) -> bool:
    """Whether placement ``p`` splits dim 0 (the experts of a weight, the tokens of an input)."""
    return isinstance(p, Shard) and p.dim == 0


def dispatch_axes(tokens: Sequence[Any], weights: Sequence[Any]) -> list[int]:
    """The mesh axes over which both an experts op's tokens and its experts are split."""
    return [a for a, (t, w) in enumerate(zip(tokens, weights)) if splits_experts(t) and splits_experts(w)]


def expert_owners(num_experts: int, weights: Sequence[Any], mesh_shape: Sequence[int],
                  coordinate: Sequence[int], axis: int | None) -> list[int]:
    """For each expert, the rank along ``axis`` (the dispatching axis; ``None``: only this rank)
    holding it among the ranks that share this rank's (``coordinate``) other coordinates, or
    -1; the experts are split on dim 0 by ``weights`` in DTensor's order (the first mesh axis
    splits first): ``autopar.capture.moe``'s ``owner``."""
    out = [-1] * num_experts
    for j in range(mesh_shape[axis] if axis is not None else 1):
        c = list(coordinate)
        if axis is not None:
            c[axis] = j
        start, size = 0, num_experts
        for a, p in enumerate(weights):
            if splits_experts(p):
                if size % mesh_shape[a]:
                    raise ValueError(f"{num_experts} experts do not split evenly over the mesh "
                                     f"axes {tuple(mesh_shape)} as {tuple(weights)}.")
                size //= mesh_shape[a]
                start += c[a] * size
        out[start:start + size] = [j] * size
    return out


def _experts_rules(grad: bool) -> list[list[Any]]:
    R, S0, P = Replicate(), Shard(0), Partial()
    if grad:  # outputs g_hidden, g_weights, g_w_in, g_w_out; inputs grad, hidden, index, weights, w_in, w_out
        return [[R] * 10, [S0, S0, P, P] + [S0] * 4 + [R, R], [S0] * 10,
                [P, P, S0, S0] + [R] * 4 + [S0, S0]]
    return [[R] * 6, [S0] * 4 + [R, R], [S0] * 6, [P, R, R, R, S0, S0]]


@register_op_rule(torch.ops.autopar.experts.default, 1, 5)
def _experts_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> list[list[Any]]:
    return _experts_rules(grad=False)


@register_op_rule(torch.ops.autopar.experts_backward.default, 4, 6)
def _experts_backward_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]
                           ) -> list[list[Any]]:
    return _experts_rules(grad=True)
