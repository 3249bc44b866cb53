"""What a plan records about its own choices: each node's op, module, layer, phase and costs;
the techniques it really applies; the parameter elements a device holds; the precision."""

from __future__ import annotations

import math

import dataclasses
from typing import Any, Sequence

from autopar._torch_private import OpOverload

from autopar.capture.layers import aten_ops, is_op, module_paths, node_phase
from autopar.config import Config
from autopar.cost_models.sharding import stored_placement
from autopar.graph import TracedGraph
from autopar.capture.remat import recompute_nodes
from autopar.plan import NodePlan
from autopar.planning.sequence import cp_layout
from autopar.strategies.rules import SEQ_DIM, SEQUENCE_ATTENTION_QUERY

__all__ = ["NORMS", "applied_techniques", "cp_attention_form", "describe_nodes", "local_elements", "param_shards",
           "precision", "stored_params"]

# the normalisation ops sequence parallelism shards (as solve.pin_norms pins them)
NORMS = aten_ops("native_layer_norm", "native_rms_norm", "_fused_rms_norm")


def describe_nodes(traced: TracedGraph, nodes: dict[str, NodePlan], compute: dict[str, float],
                    comm: dict[str, float]) -> dict[str, NodePlan]:
    """``nodes`` with each node's op, module, layer, phase and predicted costs filled in."""
    out = {}
    for n in traced.gm.graph.nodes:
        if n.name not in nodes:
            continue
        paths = module_paths(n) if n.op == "call_function" else []
        op = (str(n.target).removesuffix(".default") if isinstance(n.target, OpOverload)
              else getattr(n.target, "__name__", str(n.target)) if n.op == "call_function"
              else n.op)
        out[n.name] = dataclasses.replace(
            nodes[n.name], op=op, module=paths[-1] if paths else "",
            layer=traced.node_layer.get(n.name, ""), phase=node_phase(n),
            compute_s=compute.get(n.name, 0.0), comm_s=comm.get(n.name, 0.0))
    return out


def stored_params(traced: TracedGraph, nodes: dict[str, NodePlan], cand: Any,
                  zero_axes: Sequence[int] = ()) -> dict[str, tuple[str, ...]]:
    """Each parameter's placement between steps, by name: as the program places it, or with
    ZeRO-1 gathered once a step (``zero_axes``) as stored there
    (:func:`~autopar.cost_models.sharding.stored_placement`)."""
    return {p.name: stored_placement(nodes[p.node].outputs[0], p.shape, cand.shape, zero_axes)
            for p in traced.params}


def local_elements(traced: TracedGraph, nodes: dict[str, NodePlan], cand: Any,
                   zero_axes: Sequence[int] = ()) -> float:
    """Parameter elements one device holds between steps (a tied parameter once)."""
    stored = stored_params(traced, nodes, cand, zero_axes)
    return sum(p.numel / param_shards(stored[p.name], cand.shape)
               for p in traced.params if p.tied_to is None)


def param_shards(placements: Sequence[str], mesh_shape: Sequence[int]) -> int:
    """Into how many pieces ``placements`` (text, per axis) cut a tensor on ``mesh_shape``."""
    n = 1
    for p, size in zip(placements, mesh_shape):
        if p.startswith("S"):  # S(d) and strided SS(d,f)
            n *= size
    return n


def applied_techniques(traced: TracedGraph, config: Config, cand: Any,
                       nodes: dict[str, NodePlan], zero_axes: Sequence[int] = ()
                       ) -> tuple[dict[str, Any], list[str]]:
    """The techniques the plan really uses (a setting that changes nothing is recorded as off,
    with a warning saying why). ``zero_axes``: as :func:`stored_params`."""
    notes = []
    recompute = config.recompute or "none"
    if recompute != "none" and not recompute_nodes(traced, recompute):
        notes.append(f"recompute={recompute!r} found nothing to recompute (it needs repeated "
                     f"blocks, and 'selective' an attention core); the plan recomputes nothing")
        recompute = "none"
    stored = stored_params(traced, nodes, cand, zero_axes)
    zero = (config.zero or 0) if any(
        stored[p.name][a].startswith("S") for p in traced.params for a in cand.zero_axes) else 0
    if config.cp_attention and "cp" not in cand.names:
        notes.append(f"cp_attention={config.cp_attention!r} changes nothing without a cp axis "
                     f"(cp=1); set Config.cp > 1 for context parallelism")
    if config.cp_layout and "cp" not in cand.names:
        notes.append(f"cp_layout={config.cp_layout!r} changes nothing without a cp axis (cp=1)")
    if config.cp_inside_tp is not None and not {"cp", "tp"} <= set(cand.names):
        notes.append(f"cp_inside_tp={config.cp_inside_tp!r} changes nothing unless the mesh has "
                     f"both a cp and a tp axis (cp and tp > 1): their order is moot here")
    if config.zero and not zero:
        notes.append(f"zero={config.zero} shards nothing on this mesh (no data-parallel axis, or "
                     f"no parameter dim divides by it); the optimizer state is not sharded")
    # the data-parallel ranks a parameter is sharded over (fewer than dp: hybrid sharding; once
    # a step, over one axis: a dense weight's, the innermost, sharding.zero_once_placement)
    axes = (max(zero_axes),) if zero_axes else cand.zero_axes
    shard = math.prod(cand.shape[a] for a in axes) if zero else 1
    return {"recompute": recompute, "zero": zero, "dp_shard": shard,
            "sequence_parallel": _sequence_sharded(
        traced, cand, nodes), "mixed_precision": precision(traced, config),
            "cp_attention": cp_attention_form(traced, cand, nodes),
            **cp_layout(traced, config, cand, nodes)}, notes


def cp_attention_form(traced: TracedGraph, cand: Any, nodes: dict[str, NodePlan]) -> str:
    """How the plan's attention runs over cp: ``"gather"`` (keys and values whole on the cp
    axis), ``"ring"`` (sharded: ring attention), both joined by ``+`` when its attention nodes
    differ, ``"none"`` without a cp axis."""
    if "cp" not in cand.names:
        return "none"
    axis = cand.names.index("cp")
    forms = set()
    for n in traced.gm.graph.nodes:
        if n.target in SEQUENCE_ATTENTION_QUERY and n.name in nodes:
            inputs = nodes[n.name].inputs
            key = SEQUENCE_ATTENTION_QUERY[n.target] + 1
            forms.add("ring" if inputs[key][axis] == f"S({SEQ_DIM})" else "gather")
    return "+".join(sorted(forms)) or "none"


def _sequence_sharded(traced: TracedGraph, cand: Any, nodes: dict[str, NodePlan]) -> bool:
    """Whether the plan runs sequence parallelism: its layer norms read their input sharded on
    the sequence dim over tp (set by ``Config.sequence_parallel``, or chosen by the ILP)."""
    if "tp" not in cand.names:
        return False
    axis = cand.names.index("tp")
    norms = [n.name for n in traced.gm.graph.nodes if n.op == "call_function"
             and is_op(n, NORMS) and n.name in nodes
             and nodes[n.name].inputs]
    return bool(norms) and all(nodes[n].inputs[0][axis] == "S(1)" for n in norms)


def precision(traced: TracedGraph, config: Config) -> str:
    """``"bf16-autocast"`` for Config(mixed_precision="bf16"), else the parameters' dtype."""
    if config.mixed_precision == "bf16":
        return "bf16-autocast"
    dtypes = {traced.node(p.node).meta["val"].dtype for p in traced.params}
    return "/".join(sorted(str(d).removeprefix("torch.") for d in dtypes)) or "none"
