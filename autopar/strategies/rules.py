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

__all__ = ["ATTENTION_CAUSAL_ARG", "ATTENTION_FORWARD", "CPU_ATTENTION", "CPU_ATTENTION_BACKWARD",
           "CUDNN_ATTENTION", "CUDNN_ATTENTION_BACKWARD", "EFFICIENT_ATTENTION",
           "EFFICIENT_ATTENTION_BACKWARD", "EXPERT_OPS", "FLASH_ATTENTION", "NEW_FACTORIES",
           "FLASH_ATTENTION_BACKWARD",
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
# The attention ops with the third and fourth rules (CPU's here, CUDA's three below), each with
# where its queries are among its tensor inputs (the planner pins them on cp, the lowering runs
# the ring, a causal third and every CUDA one)
CPU_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
CPU_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
# CUDA's FlashAttention and memory-efficient kernels: the same two forms, each node of them
# sharded on the sequence run by the lowering in blocks (``autopar.passes.attention_blocks``)
FLASH_ATTENTION = torch.ops.aten._scaled_dot_product_flash_attention.default
FLASH_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_backward.default
EFFICIENT_ATTENTION = torch.ops.aten._scaled_dot_product_efficient_attention.default
EFFICIENT_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default
CUDNN_ATTENTION = torch.ops.aten._scaled_dot_product_cudnn_attention.default
CUDNN_ATTENTION_BACKWARD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default
SEQ_DIM = 2  # the sequence dim of attention's tensors: [batch, heads, sequence, head dim]
SEQUENCE_ATTENTION_QUERY = {CPU_ATTENTION: 0, CPU_ATTENTION_BACKWARD: 1, FLASH_ATTENTION: 0,
                            FLASH_ATTENTION_BACKWARD: 1, EFFICIENT_ATTENTION: 0,
                            EFFICIENT_ATTENTION_BACKWARD: 1, CUDNN_ATTENTION: 0,
                            CUDNN_ATTENTION_BACKWARD: 1}
# the forward ones among them
ATTENTION_FORWARD = frozenset({CPU_ATTENTION, FLASH_ATTENTION, EFFICIENT_ATTENTION, CUDNN_ATTENTION})


# where ``is_causal`` is among their positional arguments (each op's schema, torch 2.11-2.13)
ATTENTION_CAUSAL_ARG = {CPU_ATTENTION: 4, CPU_ATTENTION_BACKWARD: 7, FLASH_ATTENTION: 4,
                        FLASH_ATTENTION_BACKWARD: 11, EFFICIENT_ATTENTION: 6,
                        EFFICIENT_ATTENTION_BACKWARD: 11, CUDNN_ATTENTION: 6,
                        CUDNN_ATTENTION_BACKWARD: 14}


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


# CUDA's kernels (FlashAttention, memory-efficient, cuDNN), as DTensor's rules for them (torch
# 2.13, ``_matrix_ops``) without the
# sequence split DTensor's own context parallelism adds (older releases offer it to every
# caller, and a plain dispatch would then attend each rank's queries to its own keys), plus
# the gathered and the ring forms above. Their extra outputs (FlashAttention's cumulative
# lengths and random state, the efficient kernel's philox seed) are not split: ``None`` where
# DTensor gives no spec, else whole. The sequence forms are offered without dropout, with
# FlashAttention's debug mask off, and for the efficient and cuDNN kernels with their
# log-sum-exp asked for and no attention bias (the blocks run without a mask); the efficient
# kernel's sequence a multiple of 32 (it pads the log-sum-exp to one).
def _forward_sequence_forms(extra: list[Any]) -> list[list[Any]]:
    """A CUDA forward's gathered and ring forms: output and log-sum-exp split on the sequence,
    its ``extra`` outputs as given, then q, k, v."""
    seq, r = Shard(SEQ_DIM), Replicate()
    return [[seq, seq] + extra + [seq, r, r], [seq, seq] + extra + [seq, seq, seq]]


def _backward_sequence_forms(extra: list[Any], tail: list[Any]) -> list[list[Any]]:
    """A CUDA backward's gathered form (the keys' and values' gradients partial: each rank's
    queries' share) and ring form: grad_q, grad_k, grad_v, the ``extra`` outputs, then
    grad_out, q, k, v, out, logsumexp and the ``tail`` inputs as given."""
    seq, r, p = Shard(SEQ_DIM), Replicate(), Partial()
    return [[seq, p, p] + extra + [seq, seq, r, r, seq, seq] + tail,
            [seq] * 3 + extra + [seq] * 6 + tail]


def _replicated_or_split(outs: list[Any], ins: int, dim: int | None) -> list[Any]:
    place = Replicate() if dim is None else Shard(dim)
    return [place if o == "x" else o for o in outs] + [place] * ins


@register_op_rule(FLASH_ATTENTION, 9, 3)
def _flash_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> list[list[Any]]:
    debug = len(args_meta) > 5 and args_meta[5]
    extra = [None, None, None, None, Replicate(), None]  # cum_seq_q/k, max_q/k, rng_state, unused
    rules = [_replicated_or_split(["x", "x"] + extra + ["x" if debug else Replicate()], 3, dim)
             for dim in (None, 0, 1)]
    if _no_dropout(args_meta, 3) and not debug:
        rules += _forward_sequence_forms(extra + [Replicate()])
    return rules


@register_op_rule(FLASH_ATTENTION_BACKWARD, 3, 10)
def _flash_backward_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]
                         ) -> list[list[Any]]:
    # outputs grad_q, grad_k, grad_v; inputs grad_out, q, k, v, out, logsumexp, then the
    # cumulative lengths and the random state, whole
    rest = [Replicate()] * (_tensor_count(args_meta, kwargs_meta) - 6)
    rules = [_replicated_or_split([], 9, dim) + rest for dim in (None, 0, 1)]
    if _no_dropout(args_meta, 10):
        rules += _backward_sequence_forms([], rest)
    return rules


def _sequence_ok(args_meta: tuple[Any, ...], query: int, bias: int, lse: bool,
                           align: int = 32) -> bool:
    q = args_meta[query]
    return lse and args_meta[bias] is None and q.shape[SEQ_DIM] % align == 0


@register_op_rule(EFFICIENT_ATTENTION, 4, 4)
def _efficient_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> list[list[Any]]:
    bias, lse = args_meta[3] is not None, bool(args_meta[4])
    rules = []
    for dim in (None, 0, 1):
        place = Replicate() if dim is None else Shard(dim)
        rules.append([place, place if lse else Replicate(), None, None]
                     + [place] * (3 + bias))
    if _no_dropout(args_meta, 5) and _sequence_ok(args_meta, 0, 3, lse):
        rules += _forward_sequence_forms([None, None])
    return rules


@register_op_rule(EFFICIENT_ATTENTION_BACKWARD, 4, 9)
def _efficient_backward_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]
                             ) -> list[list[Any]]:
    # outputs grad_q, grad_k, grad_v, grad_bias; inputs grad_out, q, k, v, (bias), out,
    # logsumexp, philox_seed, philox_offset
    bias = args_meta[4] is not None
    rules = []
    for dim in (None, 0, 1):
        place = Replicate() if dim is None else Shard(dim)
        rules.append([place] * 3 + [place if bias else None] + [place] * (6 + bias)
                     + [Replicate()] * 2)
    if _no_dropout(args_meta, 9) and _sequence_ok(args_meta, 1, 4, True):
        rules += _backward_sequence_forms([None], [Replicate()] * 2)
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


# ``Tensor.new_*`` (a new tensor of a given size; the input gives only its dtype and device):
# DTensor's rule replicates the output unless the input has the output's whole shape, so
# DeepSeek-V3's attention, which writes its rotary and plain parts into a key and a query made by
# ``new_empty`` with a longer head dim, ran replicated on every axis. Per mesh axis: the output
# whole, its input as it comes (not read), or the output split on a dim of the input's size,
# the input split there too (passes.lower makes the local block, ``_local_factory``).
NEW_FACTORIES = (torch.ops.aten.new_zeros.default, torch.ops.aten.new_ones.default,
                  torch.ops.aten.new_full.default, torch.ops.aten.new_empty.default)


def _new_factory_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> list[list[Any]]:
    x, size = args_meta[0].shape, list(args_meta[1])
    rules = [[Replicate(), p] for p in (Replicate(), Partial(), *(Shard(d) for d in range(len(x))))]
    if len(x) == len(size):
        rules += [[Shard(d), Shard(d)] for d in range(len(x)) if x[d] == size[d]]
    return rules


# (torch 2.13 and later only: on 2.11 a 2-process JetMoE whose plan split a new_zeros with it
# failed in an index_put of the lowered program, "value tensor of shape [64] cannot be broadcast
# to indexing result of shape [128]", which 2.13 runs equal to one process; not understood yet,
# so older releases keep DTensor's rule)
for _op in NEW_FACTORIES if not private.older_than("2.13") else ():
    register_op_rule(_op, 1, 1, ("dtype",))(_new_factory_rule)


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


@register_op_rule(CUDNN_ATTENTION, 9, 4)
def _cudnn_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> list[list[Any]]:
    bias, lse = args_meta[3] is not None, bool(args_meta[4])
    debug = len(args_meta) > 7 and args_meta[7]
    extra = [None] * 6  # cum_seq_q/k, max_q/k, philox seed and offset
    rules = []
    for dim in (None, 0, 1):
        place = Replicate() if dim is None else Shard(dim)
        rules.append([place, place if lse else Replicate()] + extra
                     + [place if debug else None] + [place] * (3 + bias))
    if (_no_dropout(args_meta, 5) and not debug
            and _sequence_ok(args_meta, 0, 3, lse, align=1)):
        rules += _forward_sequence_forms(extra + [None])
    return rules


@register_op_rule(CUDNN_ATTENTION_BACKWARD, 3, 13)
def _cudnn_backward_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]
                         ) -> list[list[Any]]:
    # outputs grad_q, grad_k, grad_v; inputs grad_out, q, k, v, out, logsumexp, the philox
    # seed and offset, then the bias and the cumulative lengths where they are tensors
    bias = args_meta[8] is not None
    rest = [Replicate()] * (_tensor_count(args_meta, kwargs_meta) - 8 - bias)
    rules = []
    for dim in (None, 0, 1):
        place = Replicate() if dim is None else Shard(dim)
        rules.append([place] * 9 + [Replicate()] * 2 + [place] * bias + rest)
    if _no_dropout(args_meta, 13) and not bias:
        rules += _backward_sequence_forms([], [Replicate()] * 2 + rest)
    return rules
