"""Activation recomputation pass: re-run the tagged forward values in the backward.

The policies (which values, :func:`autopar.capture.remat.recompute_nodes`) are decided on the
joint graph before planning; this pass rewrites the lowered per-rank program: nodes tagged
``meta["recompute"]`` (the lowering copies the joint node's metadata onto every local node it
produces) are copied into the backward, just before their first backward reader, so the
forward's value is freed after its last forward use.

Under ZeRO-3 a recomputed node that reads a parameter reads it gathered again from its shard
(the lowering marks the nodes making a gathered copy, ``capture.remat.REGATHER``): the copy
re-runs that chain, gathers included, and the backward's copies of one chain are merged into
the first, which the backward's own readers of the parameter share. The forward's gathered
copy is then freed after its last forward reader, as ZeRO-3 means (Rajbhandari et al., SC'20,
sec. 5.3), and each parameter is gathered once for the forward and once for the backward (as
FSDP with activation checkpointing does: the layer's backward gathers it and its recomputed
forward reads that).
"""

from __future__ import annotations

import torch.fx as fx

from autopar.capture.remat import TAG, is_comm, is_forward, is_random, is_regather

__all__ = ["recompute_pass"]


def recompute_pass(gm: fx.GraphModule, regather: bool = False) -> fx.GraphModule:
    """Recompute the forward nodes tagged ``meta["recompute"]`` in the backward.

    Requires: a joint program (forward nodes before backward nodes, ``partitioner_tag`` set).
    Guarantees: every backward read of a tagged, recomputable forward value reads a copy made
    right before the first backward node that needs it (its tagged inputs copied too, its other
    inputs read as saved); random ops and collectives are not copied; copies are tagged
    ``is_backward``; no node keeps the ``recompute`` tag (torch's partitioner would act on it).
    ``regather`` (ZeRO-3): the forward nodes making a parameter's gathered copy are copied too,
    collectives included, and the backward's identical such nodes are merged into the first
    (module docstring). The program computes the same values.
    """
    graph = gm.graph
    tagged = {n for n in graph.nodes if n.meta.get(TAG) and is_forward(n) and not is_random(n)
              and not is_comm(n)}
    if regather:
        tagged |= {n for n in graph.nodes if is_forward(n) and is_regather(n)}
    copies: dict[fx.Node, fx.Node] = {}

    def ensure(n: fx.Node, before: fx.Node) -> fx.Node:
        if n not in tagged:
            return n
        if n not in copies:
            new_args = fx.node.map_arg((n.args, n.kwargs), lambda a: ensure(a, before))
            with graph.inserting_before(before):
                c = graph.call_function(n.target, *new_args)
            c.meta = {k: v for k, v in n.meta.items() if k != TAG}
            c.meta["partitioner_tag"] = "is_backward"
            copies[n] = c
        return copies[n]

    for n in list(graph.nodes):
        if n.op == "call_function" and not is_forward(n):
            for a in list(n.all_input_nodes):
                if a in tagged:
                    n.replace_input_with(a, ensure(a, n))
    for n in graph.nodes:
        n.meta.pop(TAG, None)
    if regather:
        _merge_regathers(graph)
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm


def _merge_regathers(graph: fx.Graph) -> None:
    """Replace every backward node making a gathered parameter copy (``is_regather``) that
    repeats an earlier one (same op, same inputs and arguments) by that one, collectives and
    their waits included: each depends on the parameters' shards alone, so the first is
    computed before any reader of the second, and every rank merges the same collectives."""
    seen: dict[tuple, fx.Node] = {}
    for n in list(graph.nodes):
        if n.op != "call_function" or is_forward(n) or not is_regather(n):
            continue
        key = (n.target, _hashable(n.args), _hashable(n.kwargs))
        if key in seen:
            n.replace_all_uses_with(seen[key])
            graph.erase_node(n)
        else:
            seen[key] = n


def _hashable(x: object) -> object:
    if isinstance(x, (list, tuple)):
        return tuple(_hashable(a) for a in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _hashable(v)) for k, v in x.items()))
    return x
