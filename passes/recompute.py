"""Activation recomputation pass: re-run the tagged forward values in the backward.

The policies (which values, :func:`autopar.capture.remat.recompute_nodes`) are decided on the
joint graph before planning; this pass rewrites the lowered per-rank program: nodes tagged
``meta["recompute"]`` (the lowering copies the joint node's metadata onto every local node it
produces) are copied into the backward, just before their first backward reader, so the
forward's value is freed after its last forward use.
"""

from __future__ import annotations

import torch.fx as fx

from autopar.capture.remat import TAG, is_comm, is_forward, is_random

__all__ = ["recompute_pass"]


def recompute_pass(gm: fx.GraphModule) -> fx.GraphModule:
    """Recompute the forward nodes tagged ``meta["recompute"]`` in the backward.

    Requires: a joint program (forward nodes before backward nodes, ``partitioner_tag`` set).
    Guarantees: every backward read of a tagged, recomputable forward value reads a copy made
    right before the first backward node that needs it (its tagged inputs copied too, its other
    inputs read as saved); random ops and collectives are not copied; copies are tagged
    ``is_backward``; no node keeps the ``recompute`` tag (torch's partitioner would act on it).
    The program computes the same values.
    """
    graph = gm.graph
    tagged = {n for n in graph.nodes if n.meta.get(TAG) and is_forward(n) and not is_random(n)
              and not is_comm(n)}
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
    graph.eliminate_dead_code()
    graph.lint()
    gm.recompile()
    return gm
