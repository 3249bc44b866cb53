"""Pipeline stages that are the same program: one joint trace, carried over to the others.

A model of identical blocks cut into many stages has a handful of distinct stages (the first,
with the embeddings; the middle ones, a few blocks each; the last, with the head), and tracing a
stage's forward and backward is much of the time of placing it (DeepSeek-V3's 61 layers over 6
stages: 3 distinct, 28 s of traces with the copies against 50 s without).
:func:`stage_signature` says when two stages' forward programs are the same node for node (ops,
arguments by position, shapes, strides, dtypes and ``requires_grad``, parameter shapes and ties,
inputs); :func:`copied_stage` gives the second stage the first one's joint graph under its own
parameter, buffer and layer names.

Requires: the stages were cut from one exported forward graph (:mod:`autopar.capture.stages`)
and the traced stage is the joint trace of ``src``. Guarantees: the copy is the
:class:`~autopar.graph.TracedGraph` tracing ``dst`` would give, but for the module paths in its
nodes' metadata (the first stage's: a plan solved on the copy itself, which happens only when a
tied weight pins it otherwise, names the first stage's modules in its node table), its
``capture_time_s`` (0: nothing was traced) and the graph module itself, which is shared (so
copies are made only for a model that is never run: one built under ``FakeTensorMode``, whose
plan is read and not executed; see :func:`autopar.capture.stages.capture_stages`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any, Sequence

import torch
import torch.fx as fx

from autopar.capture.layers import WRAP, attribute
from autopar.graph import TracedGraph

__all__ = ["copied_stage", "stage_signature"]


def _shape_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return (type(value).__name__, tuple(value.shape), value.stride(), value.dtype,
                value.requires_grad)
    if isinstance(value, (tuple, list)):
        return tuple(_shape_of(v) for v in value)
    return None


def stage_signature(gm: fx.GraphModule, stage: Any, args: Sequence[Any]) -> str:
    """A hash of the stage's forward program ``gm`` (a :class:`~autopar.capture.stages.
    StageGraph`'s, called on ``args``) that ignores names: each node's op, target, arguments
    (by position in the graph; constants by value), and its output's tensor type, shape,
    strides, dtype and ``requires_grad``; each attribute's same, its kind (parameter or buffer)
    and tie (the first attribute holding the same tensor), or, for the body of a higher-order
    op (an autocast region), its own graph so hashed; the stage's boundary, user inputs,
    outputs and its arguments' tensor types, shapes, strides, dtypes and ``requires_grad`` (a
    frozen parameter has no gradient in the joint graph)."""
    h = hashlib.sha256()
    h.update(_graph_digest(gm).encode())
    h.update(repr((stage.num_boundary, stage.user_inputs, stage.num_outputs, stage.is_last,
                   [_shape_of(a) if isinstance(a, torch.Tensor) else repr(a) for a in args])).encode())
    return h.hexdigest()


def _graph_digest(gm: fx.GraphModule) -> str:
    h = hashlib.sha256()
    index: dict[str, int] = {}
    first: dict[int, int] = {}
    for i, n in enumerate(gm.graph.nodes):
        index[n.name] = i
        if n.op == "get_attr":
            obj = attribute(gm, n.target)
            what: Any = (("body", _graph_digest(obj)) if isinstance(obj, fx.GraphModule) else
                         (_shape_of(obj), isinstance(obj, torch.nn.Parameter),
                          first.setdefault(id(obj), i)) if isinstance(obj, torch.Tensor) else
                         ("object", id(obj)))  # (never the same across stages)
        else:
            what = _shape_of(n.meta.get("val"))
        target = n.target if n.op in ("call_function", "call_method") else ""
        refs = fx.node.map_arg((n.args, n.kwargs), lambda a: f"%{index[a.name]}")
        h.update(repr((n.op, target, refs, what)).encode())
    return h.hexdigest()


def copied_stage(traced: TracedGraph, src: fx.GraphModule, dst: fx.GraphModule,
                 prefix: str | None) -> TracedGraph | None:
    """``traced`` (the joint trace of the stage program ``src``) for the stage program ``dst``
    of the same :func:`stage_signature`: parameters, tied names and buffers renamed attribute
    by attribute (the loss wrapper's prefix left out of the names), layers
    ``prefix.N`` renamed by their parameters. ``None`` when a name cannot be mapped (then the
    stage is traced)."""
    names: dict[str, str] = {}
    for a, b in zip(src.graph.nodes, dst.graph.nodes):
        if a.op == "get_attr":
            names[a.target.removeprefix(WRAP)] = b.target.removeprefix(WRAP)
    layer_of = {"": ""}
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)(\.|$)") if prefix else None
    for a, b in names.items():
        ma, mb = (pat.match(a), pat.match(b)) if pat else (None, None)
        if ma and mb:
            if layer_of.setdefault(f"{prefix}.{ma[1]}", f"{prefix}.{mb[1]}") != f"{prefix}.{mb[1]}":
                return None  # one block's parameters in two blocks of the other stage
    wanted = [p.name for p in traced.params] + [p.tied_to for p in traced.params if p.tied_to] \
        + [b.name for b in traced.buffers]
    if any(n not in names for n in wanted) or any(v not in layer_of for v in traced.node_layer.values()):
        return None
    params = tuple(dataclasses.replace(p, name=names[p.name],
                                       tied_to=names[p.tied_to] if p.tied_to else None)
                   for p in traced.params)
    buffers = tuple(dataclasses.replace(b, name=names[b.name]) for b in traced.buffers)
    return dataclasses.replace(
        traced, params=params, buffers=buffers,
        node_layer={n: layer_of[v] for n, v in traced.node_layer.items()},
        layers=tuple(dataclasses.replace(lay, name=layer_of[lay.name]) for lay in traced.layers),
        capture_time_s=0.0)
