"""Fused projections (one weight producing q, k and v, or gate and up): head-aligned sharding.

A fused weight ``[k*C, C]`` sharded with plain ``Shard(0)`` is not aligned with its k parts, so
the ``split`` after the projection would all-gather. With ``_StridedShard(0, split_factor=k)``
rank r holds rows r of each part; the projection's output then carries
``_StridedShard(dim, k)`` (DTensor propagates it through ``t``, ``mm``/``addmm`` and ``view``),
and these rules finish the job without communication:

* ``split`` of a ``_StridedShard(d, k)`` dim into its k equal parts gives ``Shard(d)`` parts;
* ``cat`` of k ``Shard(d)`` tensors along d gives ``_StridedShard(d, k)`` (the backward).

Both wrap DTensor's own rule and only add strategies, so everything else behaves as before.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import Replicate, Shard

from autopar import _torch_private as private
from autopar.capture.layers import aten_ops, is_op
from autopar._torch_private import (
    DTensorSpec,
    OpSchema,
    OpSpec,
    OpStrategy,
    TensorMeta,
    TupleStrategy,
    _StridedShard,
    generate_redistribute_costs,
)

__all__ = ["fused_params", "fused_strategy", "needs_local", "run_local", "strided_placements"]

aten = torch.ops.aten


def strided_placements(placements: tuple, dim: int, k: int) -> tuple | None:
    """Placements with every ``_StridedShard(dim, k)`` replaced by ``Shard(dim)``, else None."""
    if not any(isinstance(p, _StridedShard) and p.dim == dim and p.split_factor == k for p in placements):
        return None
    if any(isinstance(p, _StridedShard) and not (p.dim == dim and p.split_factor == k) for p in placements):
        return None
    return tuple(Shard(dim) if isinstance(p, _StridedShard) else p for p in placements)


def _chunk_meta(meta: TensorMeta, dim: int, size: int) -> TensorMeta:
    shape = list(meta.shape)
    shape[dim] = size
    stride = torch.empty(shape, device="meta").stride()
    return TensorMeta(tuple(shape), stride, meta.dtype)


def _split_wrapper(orig: Callable[[OpSchema], OpStrategy]) -> Callable[[OpSchema], OpStrategy]:
    def strategy(op_schema: OpSchema) -> OpStrategy:
        result = orig(op_schema)
        inp = op_schema.args_schema[0]
        sizes = op_schema.args_schema[1]
        ndim = inp.ndim
        dim = op_schema.args_schema[2] if len(op_schema.args_schema) > 2 else 0
        dim = dim % ndim
        length = inp.shape[dim]
        parts = [sizes] * (length // sizes) if isinstance(sizes, int) else list(sizes)
        if sum(parts) != length or len(set(parts)) != 1:
            return result
        k = len(parts)
        for cand in inp.strategies:
            spec = cand.output_spec
            out_p = strided_placements(tuple(spec.placements), dim, k)
            if out_p is None:
                continue
            meta = _chunk_meta(spec.tensor_meta, dim, parts[0]) if spec.tensor_meta else None
            outs = tuple(DTensorSpec(spec.mesh, out_p, tensor_meta=meta) for _ in range(k))
            in_spec = DTensorSpec(spec.mesh, spec.placements, tensor_meta=spec.tensor_meta)
            result.strategies.append(OpSpec(outs, [in_spec], [generate_redistribute_costs(inp, in_spec)]))
        return result

    return strategy


def _add_empty_cat(result: OpStrategy, children: list) -> None:
    """``cat([empty, x])`` (Hugging Face's KV cache starts empty) is ``x``: follow ``x``."""
    empty = [c.shape == torch.Size([0]) or tuple(c.shape) == (0,) for c in children]
    if sum(not e for e in empty) != 1:
        return
    x = children[empty.index(False)]
    for cand in x.strategies:
        spec = cand.output_spec
        ins = []
        for c, e in zip(children, empty):
            meta = c.strategies[0].output_spec.tensor_meta
            pl = tuple(Replicate() for _ in spec.placements) if e else spec.placements
            ins.append(DTensorSpec(spec.mesh, pl, tensor_meta=meta))
        out = DTensorSpec(spec.mesh, spec.placements, tensor_meta=spec.tensor_meta)
        costs = [generate_redistribute_costs(c, i) for c, i in zip(children, ins)]
        result.strategies.append(OpSpec(out, ins, costs))


def _cat_wrapper(orig: Callable[[OpSchema], Any]) -> Callable[[OpSchema], Any]:
    def strategy(op_schema: OpSchema) -> Any:
        result = orig(op_schema)
        tup = op_schema.args_schema[0]
        if not isinstance(tup, TupleStrategy) or not isinstance(result, OpStrategy):
            return result
        children = tup.children
        _add_empty_cat(result, children)
        k = len(children)
        first = children[0]
        dim = (op_schema.args_schema[1] if len(op_schema.args_schema) > 1 else 0) % first.ndim
        if k < 2 or any(tuple(c.shape) != tuple(first.shape) for c in children):
            return result
        for cand in first.strategies:
            spec = cand.output_spec
            if not any(isinstance(p, Shard) and type(p) is Shard and p.dim == dim for p in spec.placements):
                continue
            if any(isinstance(p, _StridedShard) for p in spec.placements):
                continue
            out_p = tuple(_StridedShard(dim, split_factor=k) if (type(p) is Shard and p.dim == dim) else p
                          for p in spec.placements)
            meta = None
            if spec.tensor_meta is not None:
                meta = _chunk_meta(spec.tensor_meta, dim, spec.tensor_meta.shape[dim] * k)
            out = DTensorSpec(spec.mesh, out_p, tensor_meta=meta)
            ins = [DTensorSpec(spec.mesh, spec.placements, tensor_meta=c.strategies[0].output_spec.tensor_meta)
                   for c in children]
            costs = [generate_redistribute_costs(c, s) for c, s in zip(children, ins)]
            result.strategies.append(OpSpec(out, ins, costs))
        return result

    return strategy


def fused_strategy(op: Any, op_schema: OpSchema) -> OpStrategy | None:
    """DTensor's strategies for ``split``/``cat`` plus the fused-projection ones; None otherwise.

    Used by the planner only: the runtime executes these strategies on local shards
    (:func:`run_local`), so DTensor's global propagator is left untouched.
    """
    prop = private.sharding_propagator()
    if op in (aten.split.Tensor, aten.split_with_sizes.default):
        return _split_wrapper(prop.op_strategy_funcs[op])(op_schema)
    if op is aten.cat.default:
        return _cat_wrapper(prop.op_strategy_funcs[op])(op_schema)
    return None


FUSED_OPS = (aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default)


def needs_local(op: Any, in_placements: list[tuple], out_placements: list[tuple]) -> bool:
    """Whether a planned split/cat is a fused-projection strategy (run on local shards)."""
    if op not in FUSED_OPS:
        return False
    strided = lambda pl: any(isinstance(p, _StridedShard) for p in pl)  # noqa: E731
    if op is aten.cat.default:
        # autopar's own cat strategies (fused backward: Shard parts -> strided output; empty
        # first input replicated) are the ones whose inputs are not all placed as the output
        return any(i != out_placements[0] for i in in_placements)
    return any(strided(i) for i in in_placements)


def run_local(op: Any, args: tuple, out_placements: list[tuple], mesh: Any, out_vals: Any) -> Any:
    """Execute a fused split/cat on local shards and wrap the results as DTensors."""
    from torch.distributed.tensor import DTensor

    vals = out_vals if isinstance(out_vals, (list, tuple)) else [out_vals]
    if op is aten.cat.default:
        tensors, dim = args[0], (args[1] if len(args) > 1 else 0)
        local = torch.cat([t.to_local() for t in tensors], dim)  # legacy empty inputs are skipped
        v = vals[0]
        return DTensor.from_local(local, mesh, out_placements[0], run_check=False,
                                  shape=v.shape, stride=v.stride())
    x = args[0]
    dim = (args[2] if len(args) > 2 else 0) % x.ndim
    k = len(vals)
    local = x.to_local()
    chunks = local.split(local.shape[dim] // k, dim)
    return [DTensor.from_local(c, mesh, p,
                               run_check=False, shape=v.shape, stride=v.stride())
            for c, p, v in zip(chunks, out_placements, vals)]


_PASS_THROUGH = aten_ops("view", "_unsafe_view", "reshape", "t", "transpose", "addmm", "mm", "add",
                         "clone")


def fused_params(gm: Any, param_nodes: set[str]) -> dict[str, tuple[int, int]]:
    """Parameters feeding a split into k equal parts: node name -> (dim, k).

    Walks back from every equal split through views, transposes and the projection
    (``addmm``/``mm``) to the weight and bias placeholders whose dim has the split length.
    """
    found: dict[str, tuple[int, int]] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.target not in (aten.split.Tensor, aten.split_with_sizes.default):
            continue
        x = n.args[0]
        dim = (n.args[2] if len(n.args) > 2 else 0) % x.meta["val"].ndim
        length = x.meta["val"].shape[dim]
        sizes = n.args[1]
        parts = [sizes] * (length // sizes) if isinstance(sizes, int) else list(sizes)
        if sum(parts) != length or len(set(parts)) != 1 or len(parts) < 2:
            continue
        stack, seen = [x], set()
        while stack:
            cur = stack.pop()
            if cur.name in seen:
                continue
            seen.add(cur.name)
            if cur.op == "placeholder" and cur.name in param_nodes:
                dims = [d for d, s in enumerate(cur.meta["val"].shape) if s == length]
                if len(dims) == 1:
                    found[cur.name] = (dims[0], len(parts))
            elif is_op(cur, _PASS_THROUGH):
                stack.extend(cur.all_input_nodes)
    return found
