"""Sharding rules that replace DTensor's on torch releases older than 2.13.

autopar is verified on torch 2.11, 2.12 and 2.13. Where an older DTensor's rule for an op is
wrong or narrower than 2.13's, the planner would find other (worse) plans there, and the runtime
could place data wrongly; the rules here, each gated by the release whose DTensor needs it
(:func:`autopar._torch_private.older_than`), make the older releases plan and run as 2.13 does.
On 2.13 none is registered: DTensor's own rules stay in charge. Found by running the unit suite
on each release (``pytest tests/unit`` in a torch 2.11 or 2.12 environment).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import _torch_private as private
from autopar._torch_private import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    TensorMeta,
    _StridedShard,
)
from autopar.strategies.rules import register_op_rule

__all__: list[str] = []  # registers rules on import; nothing to call


# Layer norm (seen on 2.11; 2.12's rule is rewritten but was not checked on its own, so it is
# replaced there too): DTensor's backward rule offers the mean and rstd replicated beside an
# input sharded on a batch dim, and the kernel then fails to broadcast the whole statistics
# against the local rows. These rules split input, output and statistics together on any dim
# before the normalized ones (the weight and bias whole, their gradients partial sums), or keep
# everything whole.
def _layer_norm_rules(axis: int, outputs: Sequence[Any], inputs: int,
                      params: int) -> list[list[Any]]:
    """``axis``: the first normalized dim (the rows are split on a dim before it); ``outputs``: per output, ``"split"`` (follows the rows), ``"sum"`` (a parameter's
    gradient) or ``None`` (not computed); ``inputs`` row-shaped tensor inputs, then ``params``
    weight and bias."""
    whole = [None if o is None else Replicate() for o in outputs] + [Replicate()] * (inputs + params)
    rules = [whole]
    for d in range(axis):
        rules.append([None if o is None else Shard(d) if o == "split" else Partial() for o in outputs]
                     + [Shard(d)] * inputs + [Replicate()] * params)
    return rules


def _params_given(*values: Any) -> int:
    return sum(isinstance(v, TensorMeta) for v in values)


if private.older_than("2.13"):
    @register_op_rule(torch.ops.aten.native_layer_norm.default, 3, 1)
    def _layer_norm_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> list[list[Any]]:
        ndim = len(args_meta[0].shape)  # input, normalized_shape, weight, bias, eps
        return _layer_norm_rules(ndim - len(args_meta[1]), ["split"] * 3, 1,
                                 _params_given(*args_meta[2:4]))

    @register_op_rule(torch.ops.aten.native_layer_norm_backward.default, 3, 2)
    def _layer_norm_backward_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]
                                  ) -> list[list[Any]]:
        # grad_out, input, normalized_shape, mean, rstd, weight, bias, output_mask
        ndim, mask = len(args_meta[1].shape), args_meta[7]
        outputs = [o if m else None for o, m in zip(("split", "sum", "sum"), mask)]
        return _layer_norm_rules(ndim - len(args_meta[2]), outputs, 4,
                                 _params_given(*args_meta[5:7]))

    # Dropout (2.11, 2.12): DTensor's rule gives the two outputs (values and mask) one spec,
    # which no strategy of two outputs can take, so the planner replicated every dropout and
    # the attention around it. Both outputs follow the input on any dim; never partial (random
    # numbers drawn per partial sum would not add up).
    @register_op_rule(torch.ops.aten.native_dropout.default, 2, 1)
    def _dropout_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> list[list[Any]]:
        ndim = len(args_meta[0].shape)
        return [[Shard(d)] * 3 for d in range(ndim)] + [[Replicate()] * 3]


if private.older_than("2.12"):
    # A cast (2.11): DTensor's rule follows the input's placements only, so a ZeRO parameter
    # (replicated in the plan's space, sharded in storage) could not be cast on its shard and
    # gathered in bf16. This rule, as 2.12's and 2.13's do, offers every dim and keeps partial
    # sums partial (the cast commutes with a sum unless it leaves floating point). The dtype is
    # part of DTensor's cache key: the output's metadata depends on it.
    @register_op_rule(torch.ops.aten._to_copy.default, 1, static_kwargs=("dtype",))
    def _to_copy_rule(args_meta: tuple[Any, ...], kwargs_meta: dict[str, Any]) -> list[list[Any]]:
        src, dst = args_meta[0].dtype, kwargs_meta.get("dtype")
        rules = [[Replicate()] * 2] + [[Shard(d)] * 2 for d in range(len(args_meta[0].shape))]
        if dst is None or not src.is_floating_point or dst.is_floating_point:
            rules += [[Partial("sum")] * 2, [Partial("avg")] * 2]
        return rules


def _strided_transpose(orig: Callable[[OpSchema], OpStrategy]) -> Callable[[OpSchema], OpStrategy]:
    """DTensor's ``t`` rule with ``_StridedShard(d, k)`` moved to ``_StridedShard(1 - d, k)``.

    Torch 2.11's rule swaps only plain ``Shard`` dims and leaves a strided shard on the same
    dim, which describes the transposed fused QKV weight wrongly (2.12 moves it): the planner
    then found no head-aligned layout, and the runtime would place the data wrongly.
    """

    def strategy(op_schema: OpSchema) -> OpStrategy:
        result = orig(op_schema)
        fixed = []
        for spec in result.strategies:
            out, inp = spec.output_spec, spec.input_specs[0]
            if inp.ndim != 2 or not any(isinstance(p, _StridedShard) for p in inp.placements):
                fixed.append(spec)
                continue
            placements = tuple(_StridedShard(1 - p.dim, split_factor=p.split_factor)
                               if isinstance(p, _StridedShard) else p for p in out.placements)
            moved = DTensorSpec(out.mesh, placements, tensor_meta=out.tensor_meta)
            fixed.append(OpSpec(moved, spec.input_specs, spec.redistribute_cost))
        return OpStrategy(fixed)

    return strategy


if private.older_than("2.12"):
    _T = torch.ops.aten.t.default
    _prop = private.sharding_propagator()
    _prop.register_op_strategy(_T, _strided_transpose(_prop.op_strategy_funcs[_T]),
                               schema_info=_prop.op_to_schema_info.get(_T))
