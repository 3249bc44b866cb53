"""Pipeline stages with the same graph share one intra-operator solve: what makes two stages
the same problem (:func:`stage_key`), and one stage's plan carried over to another
(:func:`renamed_stage_plan`)."""

from __future__ import annotations

import dataclasses
import hashlib

import torch

from autopar.graph import TracedGraph
from autopar.plan import Plan
from autopar.plan_context import carry

__all__ = ["renamed_stage_plan", "stage_key"]


def stage_key(traced: TracedGraph, fixed: dict[str, tuple[str, ...]]) -> str:
    """What makes two stages' intra-operator ILPs the same problem up to the microbatches in
    flight: every node's name, op and output shape, every parameter's node, shape, dtype and
    tie, the inputs, and the pinned placements (by parameter node). Names of parameters and
    layers are left out."""
    h = hashlib.sha256()
    for n in traced.gm.graph.nodes:
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
        h.update(f"{n.name}|{n.op}|{n.target}|{shape}".encode())
    node_of = {p.name: p.node for p in traced.params}
    for p in traced.params:
        h.update(f"{p.node}|{p.shape}|{p.dtype}|{node_of.get(p.tied_to)}|{fixed.get(p.name)}".encode())
    for i in traced.inputs:
        h.update(f"{i.node}|{i.shape}|{i.dtype}|{bool(i.name)}".encode())
    return h.hexdigest()


def renamed_stage_plan(plan: Plan, traced: TracedGraph, flight: int, other: TracedGraph,
                       stage: int, other_flight: int) -> Plan:
    """``plan``, solved for the stage graph ``traced`` with ``flight`` microbatches in flight,
    for the stage graph ``other`` of the same :func:`stage_key` holding ``other_flight``:
    parameters, layers and modules renamed node by node, collectives tagged with ``stage``, the
    saved activations' memory scaled by ``other_flight / flight``; the explain context points
    at ``other``. With ``other`` being ``traced`` itself, only the stage tag is set."""
    name_of = {p.node: p.name for p in other.params}
    params = {name_of[p.node]: plan.params[p.name] for p in traced.params}
    layer_map = {traced.node_layer.get(n, ""): other.node_layer.get(n, "")
                 for n in traced.node_layer}

    def rename(path: str) -> str:
        layer = next((a for a in layer_map if a and (path == a or path.startswith(a + "."))), None)
        return layer_map[layer] + path[len(layer):] if layer else path

    nodes = {k: dataclasses.replace(n, module=rename(n.module), layer=rename(n.layer))
             for k, n in plan.nodes.items()}
    collectives = tuple(dataclasses.replace(c, layer=rename(c.layer), stage=stage)
                        for c in plan.collectives)
    predicted = dict(plan.predicted)
    if other_flight != flight:  # each microbatch in flight holds the saved values
        for key in ("peak_memory_bytes", "held_bytes"):
            predicted[key] += (other_flight - flight) * predicted["saved_bytes"]
    out = dataclasses.replace(plan, params=params, nodes=nodes, collectives=collectives,
                              predicted=predicted, model_fingerprint=other.fingerprint())
    return carry(plan, out, lambda ctx: dataclasses.replace(ctx, traced=other))
