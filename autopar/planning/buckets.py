"""Gradient buckets: which gradient reductions of a step are merged into one collective.

Data parallelism reduces every parameter's gradient over the dp axis. One collective per
gradient pays the collective's fixed cost (latency, launch) once per parameter; merging them
into buckets of up to ``Config.bucket_bytes`` pays it once per bucket, and a bucket issued as
soon as its last gradient exists overlaps the rest of the backward (Li et al., "PyTorch
Distributed: Experiences on Accelerating Data Parallel Training", VLDB 2020, sec. 3.2.3 and
4.2: 25 MiB buckets, the first one of 1 MiB so that communication starts early).

This module is the policy: it decides the buckets from the plan's placements, in the order the
backward produces the gradients. The plan records them (``Plan.grad_buckets``) and lists one
collective per bucket; the lowering (:mod:`autopar.passes.lower`) executes exactly these
buckets, so the predicted and executed collectives stay equal by construction.

:func:`reduce_at_outputs` first moves each gradient's reduction to the gradient itself where
the solver put it on the input of a linear op leading to it (a transpose, a reshape, an
embedding's backward: no more bytes after it than before, so the ILP does not prefer either),
so that it can join a bucket. A gradient of at least the cap is a bucket of its own, reduced in
its own memory.

A gradient is bucketed when moving it to its parameter's placement is one all-reduce (a
``Partial`` on one mesh axis becoming ``Replicate``) or, under ZeRO, one reduce-scatter (a
``Partial`` becoming ``Shard`` of a dim the axis divides evenly: FSDP's flat reduce-scatter,
Zhao et al., VLDB 2023, sec. 4.1); gradients of one bucket share the kind, the axis and a
dtype. Other moves (several steps, an uneven shard) stay as they are.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch.fx as fx
from torch.distributed.tensor import Partial, Shard

from autopar.graph import output_moves
from autopar.placements import from_str
from autopar.strategies.reshard import local_shape, reshard_steps
from autopar.strategies.space import StrategySpace

__all__ = ["FIRST_BUCKET_BYTES", "gradient_buckets", "reduce_at_outputs", "single_reduction"]

FIRST_BUCKET_BYTES = 2**20  # DDP's first bucket (VLDB 2020, sec. 4.2)


def gradient_buckets(gm: fx.GraphModule, node_outputs: dict[str, tuple[str, ...]],
                     output_placements: Sequence[tuple[str, ...] | None],
                     grad_outputs: set[int], mesh_shape: Sequence[int], cap_bytes: int
                     ) -> tuple[tuple[int, ...], ...]:
    """The gradient buckets of a plan: output indices per bucket, in the order they are issued.

    ``node_outputs``: node name -> its output placement (text); ``grad_outputs``: the output
    indices that are parameter gradients. A gradient of at least the cap has a bucket of its
    own; smaller ones join the open bucket of their (axis, dtype) in the order the backward
    produces them, and a bucket closes (is issued) once it holds the cap (``cap_bytes``; the
    first bucket's ``min(cap_bytes, FIRST_BUCKET_BYTES)``). Every bucket is issued where its
    last gradient is computed: the order returned.
    """
    nodes = {n.name: n for n in gm.graph.nodes}
    closed: list[tuple[int, list[int]]] = []  # (position of the last gradient, members)
    open_: dict[tuple, tuple[list[int], int, int]] = {}  # key -> members, bytes, last position
    for pos, (name, index) in enumerate(output_moves(gm)[1].items()):
        if index not in grad_outputs or output_placements[index] is None:
            continue
        key_nbytes = single_reduction(nodes[name], node_outputs[name], output_placements[index],
                                      mesh_shape)
        if key_nbytes is None:
            continue
        key, nbytes = key_nbytes
        cap = min(cap_bytes, FIRST_BUCKET_BYTES) if not closed else cap_bytes
        if nbytes >= cap:  # a bucket of its own (reduced in its own memory: no copy)
            closed.append((pos, [index]))
            continue
        members, size, _ = open_.pop(key, ([], 0, pos))
        members.append(index)
        size += nbytes
        if size >= cap:
            closed.append((pos, members))
        else:
            open_[key] = (members, size, pos)
    closed += [(pos, members) for members, _, pos in open_.values()]
    closed.sort(key=lambda pm: pm[0])
    return tuple(tuple(members) for _, members in closed)


def single_reduction(node: fx.Node, src: tuple[str, ...], dst: tuple[str, ...],
                     mesh_shape: Sequence[int]) -> tuple[tuple, int] | None:
    """``((kind, axis, dtype), bytes)`` when moving ``node``'s value from ``src`` to ``dst`` is
    one all-reduce, or one reduce-scatter to an even ``Shard`` (each rank's part of every
    gradient the same size: the bucket's flat buffer splits into equal rows), else ``None``."""
    val = node.meta.get("val")
    if val is None or not hasattr(val, "shape"):
        return None
    before, after = tuple(map(from_str, src)), tuple(map(from_str, dst))
    steps = reshard_steps(before, after, tuple(val.shape), val.element_size(), tuple(mesh_shape))
    if len(steps) != 1 or steps[0].kind not in ("all_reduce", "reduce_scatter"):
        return None
    axis = steps[0].axis
    if steps[0].kind == "reduce_scatter":
        p = after[axis]
        if type(p) is not Shard or local_shape(tuple(val.shape), before, tuple(mesh_shape))[p.dim] \
                % mesh_shape[axis]:
            return None
    return (steps[0].kind, axis, val.dtype), int(steps[0].nbytes)


def reduce_at_outputs(gm: fx.GraphModule, space: StrategySpace, choice: dict[str, int],
                      grad_outputs: set[int]) -> dict[str, int]:
    """``choice`` with the reduction of each gradient moved down to the gradient itself (see
    the module docstring): along the chain of nodes, each used once, that ends at a gradient
    output, a node whose chosen input placement ends a ``Partial`` takes the strategy that
    keeps it ``Partial`` instead, when it has one (only linear ops do) and its output is no
    larger than that input. The step costs no more: the node computes on a tensor of the same
    shape, and the all-reduce moves no more bytes after it than before."""
    choice = dict(choice)
    nodes = {n.name: n for n in gm.graph.nodes}
    for name, index in output_moves(gm)[1].items():
        if index not in grad_outputs:
            continue
        chain: list[fx.Node] = []
        n = nodes[name]
        while n.op == "call_function" and len(n.users) == 1 and n.name in space.nodes:
            links = [a for a in n.all_input_nodes if len(a.users) == 1 and a.op == "call_function"]
            if len(links) != 1:
                break
            chain.insert(0, n)
            n = links[0]
        if chain:
            _keep_partial(space, choice, chain)
    return choice


def _keep_partial(space: StrategySpace, choice: dict[str, int], chain: list[fx.Node]) -> None:
    """Along ``chain`` (in order, each reading the one before), keep ``Partial`` axes partial
    from where they arise."""
    prev = chain[0].all_input_nodes
    first = next(a for a in prev if len(a.users) == 1 and a.op == "call_function")
    cur = _output_placement(space, choice, first.name)
    for v in chain:
        node_space = space.nodes[v.name]
        if cur is None or not any(isinstance(p, Partial) for p in cur):
            cur, first = node_space.strategies[choice[v.name]].outputs[0], v
            continue
        k = _position(space, node_space, first.name)
        if k is None:
            return
        chosen = node_space.strategies[choice[v.name]]
        if chosen.inputs[k] != cur:
            out_val, in_val = v.meta.get("val"), first.meta.get("val")
            if not (hasattr(out_val, "numel") and hasattr(in_val, "numel")) \
                    or out_val.numel() > in_val.numel():
                return
            want = tuple(c if isinstance(c, Partial) else o for c, o in zip(cur, chosen.outputs[0]))
            match = next((i for i, s in enumerate(node_space.strategies)
                          if s.inputs[k] == cur and s.outputs[0] == want
                          and all(s.inputs[j] == chosen.inputs[j]
                                  for j in range(len(s.inputs)) if j != k)), None)
            if match is None:
                return
            choice[v.name] = match
        cur, first = node_space.strategies[choice[v.name]].outputs[0], v


def _output_placement(space: StrategySpace, choice: dict[str, int], name: str):
    prod, idx = space.value_of(name)
    return space.nodes[prod].strategies[choice[prod]].outputs[idx] if prod in choice else None


def _position(space: StrategySpace, node_space, name: str) -> int | None:
    """Where the value named ``name`` is among ``node_space``'s tensor inputs (once only)."""
    value = space.value_of(name)
    hits = [k for k, v in enumerate(node_space.inputs) if v == value]
    return hits[0] if len(hits) == 1 else None
