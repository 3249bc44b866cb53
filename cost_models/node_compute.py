"""The compute time of one node under one strategy, on the local (per-rank) shapes it gives.

Owns what :func:`autopar.cost_models.sharding.price_space` prices a node's compute with: the
roofline terms of a node (:func:`roofline_terms`: FLOPs, bytes and matmul peak on its local
shapes), its seconds under a strategy (:func:`compute_time`: a fused attention kernel at its
measured rate, ring attention block by block, MoE experts with their all-to-alls), and the ops
that only alias memory and cost nothing (:func:`is_free`).
"""

from __future__ import annotations

import operator
from dataclasses import replace
from typing import Any, Sequence

import torch
import torch.fx as fx

from autopar.capture.layers import aten_ops, is_op
from autopar.cost_models.attention import (ATTENTION_KERNELS, attention_call, attention_seconds,
                                           gathered_seconds)
from autopar.cost_models.compute import flops_of_node, matmul_peak, op_time
from autopar.cost_models.experts import experts_comm_time, experts_node_work
from autopar.cost_models.ring import ring_axis, ring_seconds
from autopar.cost_models.topology import Topology
from autopar.strategies.reshard import local_shape
from autopar.strategies.rules import EXPERT_OPS, attention_is_causal
from autopar.strategies.space import Placements, Strategy, tensor_inputs

__all__ = ["compute_time", "is_free", "numel", "roofline_terms", "val_list"]

# Ops that only alias or re-describe memory: no compute, no traffic.
_FREE = aten_ops("detach", "t", "view", "_unsafe_view", "transpose", "permute", "expand",
                 "unsqueeze", "squeeze", "alias", "split", "slice", "select", "as_strided",
                 "unbind", "split_with_sizes", "reshape") | {operator.getitem}


def val_list(val: Any) -> list[Any]:
    """The values of a node's ``meta['val']`` as a list (one, or each of a tuple's)."""
    return list(val) if isinstance(val, (tuple, list)) else [val]


def _meta_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def compute_time(n: fx.Node, s: Strategy, mesh_shape: tuple[int, ...], topo: Topology,
                 fused: frozenset = frozenset(), skew: float = 1.0,
                 balanced_axis: int | None = None) -> float:
    """Seconds of node ``n`` under strategy ``s`` on one rank: its roofline on the local shapes
    (:func:`roofline_terms`), a fused attention kernel at its measured rate, ring attention
    block by block, an MoE experts op at load ``skew``; nothing for a view (:func:`is_free`)."""
    if is_op(n, _FREE):
        return 0.0
    if n.target in EXPERT_OPS:
        return _experts_time(n, s, mesh_shape, topo, skew)
    flops, nbytes, dtype = roofline_terms(n, s.inputs, s.outputs, mesh_shape, fused)
    seconds = op_time(flops, nbytes, topo, dtype, is_matmul=flops > 0)
    ring_on = ring_axis(n.target, s.inputs)
    ring = ring_on is not None
    if n.target in ATTENTION_KERNELS:  # a fused kernel at its measured rate, where measured
        q = ATTENTION_KERNELS[n.target][1]
        q_shape, k_shape = (local_shape(a.meta["val"].shape, p, mesh_shape)
                            for a, p in zip(tensor_inputs(n)[q:q + 2], s.inputs[q:q + 2]))
        call = attention_call(n.target, n.args, n.kwargs, q_shape, k_shape)
        if ring:  # (the ring's kernel runs whole blocks: ring_seconds halves the diagonal one)
            call = replace(call, causal=False)
        fused_s = attention_seconds(call, flops, nbytes, dtype, topo)
        seconds = seconds if fused_s is None else fused_s
        gathered = gathered_seconds(
            call, flops, q_shape[0] * q_shape[1], tensor_inputs(n)[q].meta["val"].element_size(),
            any(getattr(p, "dim", None) == 2 and a == balanced_axis
                for a, p in enumerate(s.inputs[q])), topo,
            lambda c, f: attention_seconds(c, f, 0.0, dtype, topo) or op_time(f, 0.0, topo, dtype, True))
        seconds = seconds if gathered is None else gathered
    if ring:  # (ring attention: the kernel on one block)
        args = tensor_inputs(n)
        return ring_seconds(n.target, s.inputs, [tuple(a.meta["val"].shape) for a in args],
                            args[0].meta["val"].element_size(), mesh_shape, topo, seconds,
                            attention_is_causal(n.target, n.args), ring_on == balanced_axis)
    return seconds


def roofline_terms(n: fx.Node, inputs: Sequence[Placements | None] | None = None,
                   outputs: Sequence[Placements | None] | None = None,
                   mesh_shape: tuple[int, ...] = (1,), fused: frozenset = frozenset()
                   ) -> tuple[float, float, str]:
    """The roofline terms the cost model prices node ``n`` with: ``(flops, bytes, dtype)`` on the
    local shapes the ``inputs`` / ``outputs`` placements give on ``mesh_shape`` (``inputs`` or
    ``outputs`` ``None``: the whole tensors, one device; an output placement ``None``: that
    output not counted). Bytes are every tensor input and output once (a ``fused`` input's
    name, or ``""`` for the outputs, costs no traffic); ``dtype`` is the matmul peak's
    (:func:`autopar.cost_models.compute.matmul_peak`: "bf16", "bf16_unaligned" or "fp32").
    View-like ops and expert ops are the caller's: they are priced apart (``_FREE``,
    :func:`autopar.cost_models.experts.experts_node_work`)."""
    args_in = tensor_inputs(n)
    inputs = inputs if inputs is not None else [None] * len(args_in)
    local_in = {}
    nbytes = 0
    for a, p in zip(args_in, inputs):
        v = a.meta["val"]
        shp = tuple(v.shape) if p is None else local_shape(v.shape, p, mesh_shape)
        local_in[a] = _meta_tensor(shp, v.dtype)
        nbytes += 0 if a.name in fused else numel(shp) * v.element_size()
    vals = val_list(n.meta.get("val"))
    outputs = outputs if outputs is not None else [()] * len(vals)
    outs = []
    for v, p in zip(vals, outputs):
        if isinstance(v, torch.Tensor) and p is not None:
            shp = tuple(v.shape) if p == () else local_shape(v.shape, p, mesh_shape)
            outs.append(_meta_tensor(shp, v.dtype))
            nbytes += 0 if "" in fused else numel(shp) * v.element_size()
    args = fx.node.map_arg(n.args, lambda a: local_in.get(a, a))
    kwargs = fx.node.map_arg(n.kwargs, lambda a: local_in.get(a, a))
    try:
        flops = flops_of_node(n.target, args, kwargs, outs[0] if len(outs) == 1 else tuple(outs))
    except (RuntimeError, TypeError, ValueError, IndexError, AssertionError):
        # a FLOP formula that cannot take these (local, meta) arguments: price by traffic alone
        flops = 0.0
    # matmuls run at the peak of their dtype (16-bit tensor cores, fp32, or 16-bit with rows
    # the tensor cores cannot load: judged on the whole tensors' strides)
    dtype = matmul_peak(n.target, [a.meta["val"] for a in args_in]
                        + [v for v in vals if isinstance(v, torch.Tensor)])
    return flops, float(nbytes), dtype


def is_free(n: fx.Node) -> bool:
    """Whether node ``n`` only aliases or re-describes memory (a view, a split, ``getitem``):
    no compute and no traffic in the cost model."""
    return is_op(n, _FREE)


def _experts_time(n: fx.Node, s: Strategy, mesh_shape: tuple[int, ...], topo: Topology,
                  skew: float) -> float:
    """An MoE experts op (``cost_models.experts``): its FLOPs at the rows its experts receive
    and its memory traffic, plus its all-to-alls, which run inside it; the busiest rank's, at
    load ``skew``."""
    work, item = experts_node_work(n, s, mesh_shape, skew)
    shapes = [tuple(a.meta["val"].shape) for a in tensor_inputs(n)]
    return work.seconds(topo) + experts_comm_time(n.target, s.inputs, shapes, item,
                                                       mesh_shape, topo, skew)


def numel(shape: Sequence[int]) -> int:
    """Elements of a tensor of ``shape``."""
    n = 1
    for d in shape:
        n *= d
    return n
