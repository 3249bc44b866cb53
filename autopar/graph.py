"""``TracedGraph``: the joint forward+backward aten graph of a model, with what planning needs.

Produced by :mod:`autopar.capture`; read by the strategy space, the cost models and the passes.
Node identity is the FX node name, stable for the life of the graph.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

__all__ = ["ParamInfo", "InputInfo", "Layer", "TracedGraph", "output_moves"]


@dataclass(frozen=True)
class ParamInfo:
    """A parameter placeholder of the joint graph.

    ``tied_to`` names the first parameter sharing the same tensor (``None`` if untied); tied
    placeholders must get one placement and their gradients are summed.
    """

    name: str
    node: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad_output_index: int | None
    tied_to: str | None = None

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class InputInfo:
    """A user input placeholder (flattened position ``index``), or a buffer (``name`` set)."""

    index: int
    node: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str = ""


@dataclass(frozen=True)
class Layer:
    """A repeated module (``blocks.3``) or the code outside repeated modules (``""``)."""

    name: str
    nodes: tuple[str, ...]
    fingerprint: str


@dataclass(frozen=True)
class TracedGraph:
    """The captured joint graph and its metadata.

    Attributes:
        gm: joint graph; placeholders are parameters, user inputs and the loss tangent; outputs are
            ``(loss, *grads, ...)`` as described by ``loss_output_index`` and ``ParamInfo``.
        params / inputs / buffers: placeholders in graph order (buffers are replicated).
        tangent_nodes: names of tangent placeholders (the loss's, a scalar; on a pipeline stage
            also one per boundary output, see ``boundary_tangents``).
        loss_output_index: position of the loss in the graph's outputs (``None`` on a pipeline
            stage that is not the last).
        layers: repeated-module clusters with fingerprints; identical fingerprints are identical
            subgraphs, node for node, and are solved once.
        node_layer: layer name of every call_function node.
        is_fake: whether the model was traced from fake tensors (never materialised).
        input_spec: pytree spec of the user's (args, kwargs), to flatten call-time inputs.
        output_type: the type of what the model returned (``None`` for a bare loss tensor).
        boundary_inputs: on a pipeline stage, the placeholders holding the previous stage's
            activations (placed ``S(0)`` on data-parallel axes, replicated on the others).
        boundary_outputs: on a pipeline stage, the output positions of the activations sent on.
        boundary_tangents: the tangent placeholders of those activations (same placement).
        boundary_grad_outputs: output position of each boundary input's gradient (sent back).
    """

    gm: fx.GraphModule
    params: tuple[ParamInfo, ...]
    inputs: tuple[InputInfo, ...]
    buffers: tuple[InputInfo, ...]
    tangent_nodes: tuple[str, ...]
    loss_output_index: int | None
    num_outputs: int
    layers: tuple[Layer, ...]
    node_layer: dict[str, str] = field(repr=False)
    is_fake: bool
    input_spec: Any = field(repr=False)
    capture_time_s: float = 0.0
    output_type: Any = None
    boundary_inputs: tuple[str, ...] = ()
    boundary_outputs: tuple[int, ...] = ()
    boundary_tangents: tuple[str, ...] = ()
    boundary_grad_outputs: tuple[int, ...] = ()

    @property
    def num_forward_outputs(self) -> int:
        """Outputs computed by the forward: the loss, or a stage's boundary activations."""
        return len(self.boundary_outputs) if self.boundary_outputs else 1

    def wrap_loss(self, loss: torch.Tensor) -> Any:
        """The loss in the container the model returned it in (``output_type``).

        A bare tensor stays a tensor; a tuple becomes ``(loss,)``; an output object (Hugging
        Face's ``ModelOutput``) is rebuilt with only ``loss`` set: the plan computes what
        training needs, not the other outputs (logits).
        """
        if self.output_type is None:
            return loss
        if issubclass(self.output_type, (tuple, list)):
            return self.output_type([loss])
        return self.output_type(loss=loss)

    def node(self, name: str) -> fx.Node:
        """The FX node called ``name``."""
        return self._nodes()[name]

    def _nodes(self) -> dict[str, fx.Node]:
        cache = self.__dict__.get("_node_cache")
        if cache is None:
            cache = {n.name: n for n in self.gm.graph.nodes}
            object.__setattr__(self, "_node_cache", cache)
        return cache

    def param(self, name: str) -> ParamInfo:
        """The parameter called ``name`` (its original module path)."""
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(f"no parameter {name!r}; parameters: {[p.name for p in self.params]}")

    @property
    def num_parameters(self) -> int:
        """Distinct parameter elements (tied parameters counted once)."""
        return sum(p.numel for p in self.params if p.tied_to is None)

    def fingerprint(self) -> str:
        """A hash of the graph's ops, shapes and parameter names: identifies the model."""
        h = hashlib.sha256()
        for n in self.gm.graph.nodes:
            val = n.meta.get("val")
            shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
            h.update(f"{n.op}|{n.target}|{shape}".encode())
        for p in self.params:
            h.update(f"{p.name}|{p.shape}|{p.tied_to}".encode())
        return h.hexdigest()[:16]


def output_moves(gm: fx.GraphModule) -> tuple[dict[str, int], dict[str, int]]:
    """Where each graph output is moved to its final placement, as the lowering and the
    planner's collective list both walk it: ``(early, late)``, node name -> output index.
    ``early``: outputs computed in the forward (the loss, a pipeline stage's activations),
    moved where computed, in the forward; ``late``: the other computed outputs (gradients),
    moved where computed, in graph order."""
    out_node = next(n for n in gm.graph.nodes if n.op == "output")
    early = {a.name: i for i, a in enumerate(out_node.args[0])
             if isinstance(a, fx.Node) and a.meta.get("partitioner_tag") == "is_forward"}
    late = {a.name: i for i, a in enumerate(out_node.args[0])
            if isinstance(a, fx.Node) and a.op == "call_function" and a.name not in early}
    order = {n.name: k for k, n in enumerate(gm.graph.nodes)}
    return early, dict(sorted(late.items(), key=lambda kv: order[kv[0]]))

