"""Capture for pipeline parallelism: the forward graph, its layer units, and one joint graph per stage.

:func:`export_forward` exports the model once (at the microbatch's shape) and assigns every node
to a layer unit. :func:`capture_stages` cuts that graph at the plan's unit boundaries
(:mod:`autopar.passes.stages`) and traces each stage's forward+backward with AOTAutograd, keeping
the gradients of its boundary activations (they are sent to the previous stage).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_map_only

from autopar import _torch_private as private
from autopar.capture import (
    _LossModule, _build, _export, _first_line, _strip_assertions, _strip_input_grads,
    capture_with_export, model_device, model_is_fake, normalize_inputs, prepare_inputs, to_fake,
)
from autopar.errors import CaptureError
from autopar.graph import TracedGraph
from autopar.passes.stages import StageGraph, block_prefix, layer_units, node_stages, split_stages

__all__ = ["ForwardGraph", "export_forward", "capture_with_forward", "capture_stages", "microbatch_inputs"]

_WRAP = "model."


@dataclass(frozen=True)
class ForwardGraph:
    """A model's exported forward graph with its layer units.

    ``canonical`` maps each parameter name used in the graph to the model's own name for that
    tensor (a tied LM head maps to the embedding it shares).
    """

    gm: fx.GraphModule
    units: tuple[str, ...]
    unit_of: dict[str, int] = field(repr=False)
    canonical: dict[str, str] = field(repr=False)
    fake_mode: Any = field(repr=False)
    in_spec: Any = field(repr=False)


def microbatch_inputs(example_inputs: Any, microbatches: int) -> tuple[list[Any], Any]:
    """Split every tensor input on dim 0 into ``microbatches`` equal chunks.

    Returns the flattened inputs of each microbatch and the pytree spec. Raises ``ValueError``
    when an input's batch dim does not divide.
    """
    args, kwargs = normalize_inputs(example_inputs)
    flat, spec = tree_flatten((args, kwargs))
    chunks: list[list[Any]] = [[] for _ in range(microbatches)]
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            if x.dim() == 0 or x.shape[0] % microbatches:
                raise ValueError(
                    f"input {i} has shape {tuple(x.shape)}: its batch dim (dim 0) must divide into "
                    f"{microbatches} microbatches. Choose Config(microbatch_size=...) dividing the "
                    f"batch, or a batch divisible by the microbatch count.")
            for j, c in enumerate(x.chunk(microbatches, dim=0)):
                chunks[j].append(c)
        else:
            for j in range(microbatches):
                chunks[j].append(x)
    return chunks, spec


def capture_with_forward(model: nn.Module, example_inputs: Any) -> tuple[TracedGraph, ForwardGraph]:
    """The joint graph (:func:`autopar.capture.capture`) and the forward graph with its layer
    units, from one export of the model."""
    traced, ep = capture_with_export(model, example_inputs)
    return traced, export_forward(model, example_inputs, ep)


def export_forward(model: nn.Module, example_inputs: Any, ep: Any = None) -> ForwardGraph:
    """Export ``model`` (wrapped to return its loss) on ``example_inputs``; find its layer units.

    ``ep``: an export of the wrapped model on these inputs, if one was already made.
    """
    args, kwargs, fake_mode = prepare_inputs(model, example_inputs)
    if ep is None:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            ep = _export(_LossModule(model), args, kwargs)
    gm = ep.module()
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and not n.users:  # export's input guard
            gm.graph.erase_node(n)
    _strip_assertions(gm)
    names = [n.target[len(_WRAP):] for n in gm.graph.nodes if n.op == "get_attr"]
    prefix = block_prefix(names)
    blocks = len({n.split(".")[len(prefix.split("."))] for n in names
                  if prefix and n.startswith(prefix + ".")})
    units, unit_of = layer_units(list(gm.graph.nodes), prefix, blocks)
    owner: dict[int, str] = {}
    canonical: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical[name] = owner.setdefault(id(p), name)
    _, spec = tree_flatten((args, kwargs))
    return ForwardGraph(gm, units, unit_of, canonical, fake_mode, spec)


def capture_stages(fwd: ForwardGraph, stage_of_unit: Sequence[int], mb_inputs: Sequence[Any]
                   ) -> list[tuple[StageGraph, TracedGraph]]:
    """Split ``fwd`` by ``stage_of_unit`` and trace every stage's joint graph.

    ``mb_inputs`` are one microbatch's flattened inputs (as the graph was exported for). The
    boundary activations are produced by running the stages in order on them (under the fake
    mode of ``fwd`` if it has one, the inputs made fake in it by :func:`autopar.capture.to_fake`).
    """
    num_stages = max(stage_of_unit) + 1
    stage_of = node_stages(fwd.gm, fwd.unit_of, stage_of_unit)
    stages = split_stages(fwd.gm, stage_of, num_stages)
    ctx = fwd.fake_mode if fwd.fake_mode is not None else contextlib.nullcontext()
    out: list[tuple[StageGraph, TracedGraph]] = []
    flat = list(mb_inputs)
    if fwd.fake_mode is not None:
        flat = to_fake(flat, fwd.fake_mode, model_device(fwd.gm))
    is_fake = model_is_fake(fwd.gm)
    boundary: list[torch.Tensor] = []
    for st in stages:
        start = time.perf_counter()
        args = tuple(boundary) + tuple(flat[i] for i in st.user_inputs)
        with ctx, contextlib.ExitStack() as stack:
            try:
                joint = private.export_joint(st.gm, args, stack)
            except Exception as e:
                raise CaptureError(f"tracing pipeline stage {st.index} failed: {_first_line(e)}") from e
        with ctx, torch.no_grad():
            outs = st.gm(*args)
        gm = joint.graph_module
        _strip_input_grads(gm, keep=st.num_boundary)
        _strip_assertions(gm)
        traced = _build(gm, st.gm, fwd.in_spec, is_fake,
                        time.perf_counter() - start, stage=st)
        out.append((st, traced))
        boundary = [tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(True), o) for o in outs]
    return out
