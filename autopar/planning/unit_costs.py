"""Per-unit costs of a two-block trace's solved intra-operator ILP (``pre``, one repeated block,
``post``): what the setup search's closed form (``cost_models.step_price``) composes. A
model's leading blocks that differ from the repeated ones (DeepSeek-V3's dense first layers)
count in ``pre``; the experts of MoE layers are recorded apart (their state, their all-to-alls'
bytes, their work), for the closed form to split them over ep."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import torch
from torch.distributed.tensor import Shard

from autopar.capture.layers import is_backward, layer_units
from autopar.capture.remat import gather_dtype, is_random, recompute_nodes, regathered_nodes
from autopar.cost_models.experts import (
    ExpertsWork, expert_weight_params, experts_exchanges, experts_node_work,
)
from autopar.cost_models.sharding import alias_root, recomputed_bytes, state_bytes_per_element
from autopar.cost_models.training_step import RECOMPUTE, LayerCosts, UnitCosts
from autopar.planning.pipeline_search import chosen_comm
from autopar.planning.sequence import graph_sequence_length
from autopar.strategies.rules import EXPERT_OPS
from autopar.strategies.reshard import local_shape
from autopar.strategies.space import tensor_inputs

__all__ = ["layer_costs"]


def layer_costs(traced: Any, fwd: Any, space: Any, costs: Any, choice: dict[str, int],
                num_blocks: int, optimizer: str, seq_shards: int,
                lead_runs: Sequence[int] = (), expert_skew: float = 1.0,
                boundary_shards: int = 1) -> LayerCosts:
    """Per-unit costs of a two-block trace's ILP solution (the second repeated block stands for
    every block; the leading blocks that differ from them count in ``pre``: the trace holds
    one block of each run of identical leading ones, ``lead_runs`` their run lengths, each
    counted that many times); ``seq_shards``: the tp degree when the block input is
    sequence-sharded; ``boundary_shards``: the ranks a pipeline cut's activation is split over
    besides the data axes (cp: :func:`~autopar.strategies.space.boundary_placements`)."""

    lead = len(lead_runs)
    nodes = list(traced.gm.graph.nodes)
    units, unit_of = layer_units(nodes, fwd.units[1].rsplit(".", 1)[0], lead + 2)
    backward = {n.name for n in nodes if is_backward(n)}
    acc = [dict(f=0.0, b=0.0, fc=0.0, bc=0.0, state=0.0, act=0.0, elems=0.0, gbytes=0.0,
                xgbytes=0.0, chain=0.0, trans=0.0, attn_f=0.0, attn_b=0.0, rand=0.0,
                xelems=0.0, xstate=0.0, xf=(), xb=(),
                xwf=ExpertsWork(0.0, 0.0, 0.0), xwb=ExpertsWork(0.0, 0.0, 0.0), xfs=0.0)
           for _ in units]
    tied_state, tied_elems = _add_state(traced, costs, choice, unit_of, backward, optimizer, acc)
    params, seq = {p.node for p in traced.params}, graph_sequence_length(traced)
    chains = regathered_nodes(traced)
    for n in nodes:
        if n.name in choice and n.name not in params:
            a = acc[unit_of.get(n.name, len(units) - 1)]
            _add_op(n, choice[n.name], space, costs, n.name in backward, seq, expert_skew, a)
            if n.name in chains:  # (a parameter's copy: ZeRO-3 makes it again for the backward)
                a["chain"] += costs.memory[n.name][choice[n.name]]
            if n.name in backward:
                strategy = space.nodes[n.name].strategies[choice[n.name]]
                a["trans"] = max(a["trans"], _transient_bytes(n, strategy, space.mesh_shape, backward))
    for name, in_backward, t in chosen_comm(space, costs, choice, backward):
        acc[unit_of.get(name, len(units) - 1)]["bc" if in_backward else "fc"] += t
    peaks = _recompute_peaks(traced, space, choice, unit_of)
    unit = lambda a, u: UnitCosts(  # noqa: E731
        a["f"] + a["fc"], a["b"] + a["bc"], a["fc"], a["bc"], a["state"], a["act"], a["elems"],
        a["attn_f"], a["attn_b"], a["rand"], tuple((p, v.get(u, 0.0)) for p, v in peaks.items()),
        a["xelems"], a["xstate"], a["xf"], a["xb"], a["xwf"], a["xwb"], a["xfs"],
        gather_itemsize=_width(a["gbytes"] - a["xgbytes"], a["elems"] - a["xelems"]),
        expert_gather_itemsize=_width(a["xgbytes"], a["xelems"]),
        regathered_bytes=a["chain"], backward_transient_bytes=a["trans"])
    whole = _boundary_bytes(fwd)
    itemsize = traced.params[0].dtype.itemsize if traced.params else 4
    # (a largest transient is a maximum: neither repeated nor added)
    leading = [{k: v if k == "trans" else _times(v, c) for k, v in a.items()}
               for a, c in zip(acc[1:lead + 1], lead_runs)]
    pre = acc[0]
    for a in leading:  # (the leading blocks run where pre does: the first stage)
        pre = {k: max(pre[k], a[k]) if k == "trans" else pre[k] + a[k] for k in pre}
    pre_peaks = {p: {0: max(v.get(u, 0.0) for u in range(lead + 1))} for p, v in peaks.items()}
    return LayerCosts(unit(pre, 0) if not lead else _unit_with(unit(pre, 0), pre_peaks),
                      unit(acc[lead + 2], lead + 2), unit(acc[-1], len(units) - 1), num_blocks,
                      tied_state, tied_elems,
                      whole / boundary_shards, whole / seq_shards, itemsize, optimizer, expert_skew,
                      sum(lead_runs), sum(a["f"] + a["fc"] - a["xfs"] for a in leading),
                      sum(a["act"] - a["rand"] for a in leading))


def _add_state(traced: Any, costs: Any, choice: dict[str, int], unit_of: dict[str, int],
               backward: set[str], optimizer: str, acc: list[dict]) -> tuple[float, float]:
    """Add each parameter's training state, elements and bytes as ZeRO gathers them to the
    units whose forward reads it (the experts' apart too); returns the state and elements held
    by two units (tied)."""
    experts = expert_weight_params(list(traced.gm.graph.nodes))
    by_name = {p.name: p for p in traced.params}
    aliased = {p.tied_to for p in traced.params if p.tied_to is not None}
    readers = {p.name: {unit_of[u.name] for u in traced.node(p.node).users
                        if u.name in unit_of and u.name not in backward} for p in traced.params}
    tied_state = tied_elems = 0.0
    for p in traced.params:
        if p.node not in choice:
            continue
        n = traced.node(p.node)
        # a tied alias holds no state of its own in the ILP; its holder's state is counted
        # again in the units that read the alias (a pipeline stage there holds a copy)
        src = by_name[p.tied_to] if p.tied_to is not None else p
        state = costs.memory[src.node][choice[src.node]]
        elems = state / state_bytes_per_element(optimizer, p.dtype.itemsize)
        users = readers[p.name]
        if not users and p.name in aliased:  # (read only through its alias, which counts it)
            continue
        width = gather_dtype(n).itemsize
        for u in users or {0}:
            acc[u]["state"] += state
            acc[u]["elems"] += elems
            acc[u]["gbytes"] += elems * width
            if n.name in experts:  # (split over ep in closed form: step_price)
                acc[u]["xstate"] += state
                acc[u]["xelems"] += elems
                acc[u]["xgbytes"] += elems * width
        # held by two units: read by both, or its holder read too (and counted there)
        if len(users) > 1 or (p.tied_to is not None and readers[p.tied_to]):
            tied_state, tied_elems = tied_state + state, tied_elems + elems
    return tied_state, tied_elems


def _add_op(n: Any, i: int, space: Any, costs: Any, in_backward: bool, seq: int | None,
            expert_skew: float, a: dict) -> None:
    """Add node ``n``'s chosen strategy ``i`` (compute seconds, saved bytes; an experts op's
    all-to-all bytes and work; random and attention-core values) to its unit's sums ``a``."""
    a["b" if in_backward else "f"] += costs.compute[n.name][i]
    if n.target in EXPERT_OPS:
        key = "xb" if in_backward else "xf"
        strategy = space.nodes[n.name].strategies[i]
        a[key] = a[key] + _exchange_bytes(n, strategy, space.mesh_shape)
        a["xw" + key[1]] = a["xw" + key[1]] + experts_node_work(n, strategy, space.mesh_shape,
                                                                expert_skew)[0]
        if key == "xf":
            a["xfs"] += costs.compute[n.name][i]
    a["act"] += costs.memory[n.name][i]
    if not in_backward and is_random(n):
        a["rand"] += costs.memory[n.name][i]
    if not in_backward and _is_attention_core(n, seq):
        a["attn_f"] += costs.compute[n.name][i]
        a["attn_b"] += costs.memory[n.name][i]


def _transient_bytes(n: Any, strategy: Any, mesh_shape: Sequence[int], backward: set[str]
                     ) -> float:
    """Bytes a backward op ``n`` holds at once beyond the saved values: its outputs and the
    tensors the backward made that it reads (the gradient flowing in), at their local sizes
    under ``strategy`` (the loss's: the logits' gradient, read and written); an op that only
    aliases (a view, a detach) holds nothing of its own, and reads of what the forward made
    are saved values."""
    def size(v: Any, p: Any) -> float:
        if not isinstance(v, torch.Tensor) or p is None:
            return 0.0
        return math.prod(local_shape(tuple(v.shape), p, mesh_shape)) * v.element_size()

    if alias_root(n)[0] is not n:
        return 0.0
    vals = n.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else (vals,)
    out = sum(size(v, p) for v, p in zip(vals, strategy.outputs))
    reads = tensor_inputs(n)
    if len(reads) != len(strategy.inputs):
        raise ValueError(f"internal: {n.name} ({n.target}) reads {len(reads)} tensors and its "
                         f"strategy places {len(strategy.inputs)}; please report this model")
    return out + sum(size(a.meta.get("val"), p) for a, p in zip(reads, strategy.inputs)
                     if alias_root(a)[0].name in backward)


def _width(nbytes: float, elements: float) -> float | None:
    """Bytes per element on average (``None`` for no elements)."""
    return nbytes / elements if elements else None


def _times(value: Any, count: int) -> Any:
    """``value`` (seconds, bytes, a tuple of all-to-all bytes or ``ExpertsWork``) for
    ``count`` identical blocks: summed that many times."""
    out = value
    for _ in range(count - 1):
        out = out + value
    return out


def _unit_with(u: UnitCosts, peaks: dict[str, dict[int, float]]) -> UnitCosts:
    """``u`` with the recomputation peaks of unit 0 in ``peaks``."""
    return dataclasses.replace(u, recompute_peak_bytes=tuple((p, v[0]) for p, v in peaks.items()))


def _exchange_bytes(n: Any, strategy: Any, mesh_shape: Sequence[int]) -> tuple[float, ...]:
    """The bytes a rank sends in each all-to-all of experts op ``n`` under ``strategy`` once
    its experts are split over an ep axis too (the same for any ep: every pair whose expert the
    rank's ep group holds is sent; ``cost_models.experts``): priced with a dispatching axis of
    one rank added."""
    ins = tensor_inputs(n)
    shapes = [tuple(a.meta["val"].shape) for a in ins]
    placements = [(*p, Shard(0)) for p in strategy.inputs]
    return tuple(b for _, _, b in experts_exchanges(n.target, placements, shapes,
                                                    ins[0].meta["val"].element_size(),
                                                    (*mesh_shape, 1)))


def _recompute_peaks(traced: Any, space: Any, choice: dict[str, int],
                     unit_of: dict[str, int]) -> dict[str, dict[int, float]]:
    """Per recomputation policy and unit, the bytes of the unit's recomputed values under the
    chosen strategies: what one block's backward holds at once (as the per-operator model adds
    it, :func:`autopar.planning.solve.solve_space`)."""
    mesh_shape = tuple(space.mesh_shape)
    out: dict[str, dict[int, float]] = {}
    for policy in RECOMPUTE[1:]:
        acc: dict[int, float] = {}
        for name in recompute_nodes(traced, policy):
            if name in choice and name in unit_of:
                nbytes = recomputed_bytes(traced.node(name), space.nodes[name].strategies,
                                          mesh_shape)[choice[name]]
                acc[unit_of[name]] = acc.get(unit_of[name], 0.0) + float(nbytes)
        out[policy] = acc
    return out


def _is_attention_core(n: Any, seq: int | None) -> bool:
    """A forward node whose output ends in (seq, seq) that selective recomputation re-runs:
    attention scores and softmax ([SEL]). A random node (attention dropout) is not among them:
    the runtime never recomputes a random draw (:func:`autopar.passes.recompute.is_random`), so
    its values stay saved, as the per-operator plan prices them."""
    if is_random(n):
        return False
    vals = n.meta.get("val")
    vals = vals if isinstance(vals, (tuple, list)) else [vals]
    return seq is not None and any(isinstance(v, torch.Tensor) and v.dim() >= 2
                                   and tuple(v.shape[-2:]) == (seq, seq) for v in vals)


def _boundary_bytes(fwd: Any) -> float:
    """Bytes crossing from the first block to the second per microbatch (one pipeline cut)."""
    total = 0
    for n in fwd.gm.graph.nodes:
        if fwd.unit_of.get(n.name) != 1:
            continue
        val = n.meta.get("val")
        if hasattr(val, "numel") and any(fwd.unit_of.get(u.name, 0) >= 2 for u in n.users):
            total += val.numel() * val.element_size()
    return float(total)
