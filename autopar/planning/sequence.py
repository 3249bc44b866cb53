"""The sequence the cp axis splits: its length in a traced graph, and the layout a plan holds it
in over cp (``plan.techniques["cp_layout"]``, read by
:func:`autopar.sequence_layout.layout_of_plan`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch

from autopar.config import Config
from autopar.errors import PlanError
from autopar.graph import TracedGraph
from autopar.placements import from_str
from autopar.plan import NodePlan, Plan
from autopar.sequence_layout import SequenceLayout
from autopar.strategies.space import tensor_inputs

__all__ = ["common_cp_layout", "cp_layout", "graph_sequence_length"]


def graph_sequence_length(traced: TracedGraph) -> int | None:
    """The sequence length cp splits: dim 1 of the first input with two dims or more, on a
    pipeline stage without such an input of its first activation from the previous stage
    (``[batch, seq, ...]``); ``None`` without either."""
    shapes = [tuple(i.shape) for i in traced.inputs] + \
        [tuple(traced.node(b).meta["val"].shape) for b in traced.boundary_inputs]
    shapes = [s for s in shapes if len(s) >= 2]
    return shapes[0][1] if shapes else None


def cp_layout(traced: TracedGraph, config: Config, cand: Any,
              nodes: dict[str, NodePlan] | None = None) -> dict[str, str]:
    """The plan's ``cp_layout``: ``"balanced"`` where there is a cp axis, ``Config.cp_layout``
    does not say ``"contiguous"``, the sequence divides into 2 x cp chunks and (given the
    solved ``nodes``) so does every other dim the plan splits on the cp axis; else
    ``"contiguous"``. Asking for ``"balanced"`` where it does not divide is an error naming
    the value."""
    if "cp" not in cand.names or config.cp_layout == "contiguous":
        return {"cp_layout": "contiguous"}
    axis = cand.names.index("cp")
    cp, seq = cand.shape[axis], graph_sequence_length(traced)
    misfit = (f"the inputs' sequence ({seq} positions)" if seq is not None and seq % (2 * cp)
              else "no input with a sequence dim (dim 1)" if seq is None
              else _misfit(traced, nodes or {}, SequenceLayout(axis, cp)))
    if misfit is None:
        return {"cp_layout": "balanced"}
    if config.cp_layout == "balanced":
        raise PlanError(f"Config(cp_layout='balanced') cuts every dim split over cp into 2 x cp "
                        f"= {2 * cp} chunks; {misfit} does not divide. Use lengths divisible by "
                        f"{2 * cp}, or cp_layout='contiguous' (or None, which falls back to it).")
    return {"cp_layout": "contiguous"}


def _misfit(traced: TracedGraph, nodes: dict[str, NodePlan], layout: SequenceLayout
            ) -> str | None:
    """The first value the plan splits on the layout's axis on a dim that does not cut into its
    chunk pairs (a node's output or a move into a node's input), or ``None``."""
    for name, chosen in nodes.items():
        n = traced.node(name)
        vals = n.meta.get("val")
        outs = vals if isinstance(vals, (tuple, list)) else [vals]
        shapes = [_shape(v) for v in outs] + [_shape(a.meta.get("val")) for a in tensor_inputs(n)]
        for placed, shape in zip((*chosen.outputs, *chosen.inputs), shapes):
            if placed is None or shape is None:
                continue
            if not layout.divides(from_str(placed[layout.axis]), shape):
                return f"{name} of shape {shape}, planned {placed[layout.axis]} on cp,"
    return None


def _shape(val: Any) -> tuple[int, ...] | None:
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def common_cp_layout(plans: Sequence[Plan], config: Config) -> list[Plan]:
    """A pipeline's stage plans holding the sequence in one layout (their programs pass it on
    to each other): contiguous in every stage if one of them is (an error if
    ``Config(cp_layout="balanced")`` asked for the pairs)."""
    layouts = {p.techniques.get("cp_layout", "contiguous") for p in plans}
    if len(layouts) <= 1:
        return list(plans)
    if config.cp_layout == "balanced":
        raise PlanError("Config(cp_layout='balanced'): a pipeline stage splits a dim over cp that "
                        "does not cut into 2 x cp chunks. Use cp_layout='contiguous' (or None).")
    return [dataclasses.replace(p, techniques={**p.techniques, "cp_layout": "contiguous"})
            for p in plans]
