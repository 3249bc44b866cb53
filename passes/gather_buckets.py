"""Flat gather buckets for ZeRO: each run of a layer's parameter gathers
(:class:`autopar.capture.remat.GatherRuns`, issued together by
:func:`autopar.passes.overlap.prefetch_gathers`) becomes one all-gather of the run's shards
packed into one flat buffer, split back into the gathered parameters where the first of them
is needed.

Why: each collective pays a fixed cost (its launch, the group's handshake, a gloo worker's
wake-up) whatever its size; a transformer layer has a dozen parameters, and gathering each
alone made a step's ~170 small all-gathers the gap to FSDP2, which gathers each
``fully_shard`` module's parameters as one flat buffer ("copy-in, all-gather, copy-out":
Zhao et al., "PyTorch FSDP", VLDB 2023, sec. 3.2 and 4.1; torch's
``_fsdp_collectives.foreach_all_gather``). The same bytes move in fewer collectives.

The layout: the run's shards ``x_1 .. x_k`` (``n_i`` elements each, ``N`` in all) are
flattened and concatenated; the all-gather over ``g`` ranks gives ``g`` rows of ``N``, rank
``r``'s row holding its ``x_1 .. x_k``; column block ``i`` of the ``(g, N)`` grid, copied out
contiguous, is ``x_i`` gathered on its dim 0 (what ``all_gather_into_tensor`` of ``x_i``
alone returns). Memory: the packed shards and the flat buffer from the run's issue to its first
reader, then the gathered copies (``cost_models.liveness`` walks the same).
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.capture.remat import gather_bucket_key, is_comm, is_regather, is_wait, regather_layer
from autopar.passes.overlap import marked_inputs

__all__ = ["bucket_gathers"]

_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
_WAIT = torch.ops._c10d_functional.wait_tensor.default
_aten = torch.ops.aten


def _key(c: fx.Node) -> tuple | None:
    """``c``'s bucket key, if it is a ZeRO parameter gather that reads no other collective's
    result (the first collective of its parameter's chain: the plan's walk buckets the same)."""
    if c.target is not _GATHER or not is_regather(c):
        return None
    waits = [u for u in c.users if u.target is _WAIT]
    if len(c.users) != 1 or len(waits) != 1 or _after_collective(c):
        return None
    part = "backward" if c.meta.get("partitioner_tag") == "is_backward" else "forward"
    return gather_bucket_key(part, regather_layer(c), c.args[2], c.args[0].meta["val"].dtype)


def _after_collective(c: fx.Node) -> bool:
    """Whether collective ``c`` reads, through the marked nodes making its input, another
    collective's result (the second step of a move, or a view of a gathered copy)."""
    return any(is_comm(n) for n in marked_inputs(c))


def _runs(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Runs of bucketed gathers (:func:`_key`) consecutive among themselves (the other
    collectives between them do not count) with one ``capture.remat.gather_bucket_key``, each
    cut where a member is issued after a member's result is first waited for (it may read
    what that wait gives)."""
    position = {n: i for i, n in enumerate(gm.graph.nodes)}
    runs: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    key = None
    first_wait = len(position)
    for c in [n for n in gm.graph.nodes if is_comm(n) and not is_wait(n)]:
        k = _key(c)
        if k is None:
            continue
        if k != key or position[c] > first_wait:
            runs.append(current)
            current, key, first_wait = [], k, len(position)
        current.append(c)
        first_wait = min(first_wait, position[next(iter(c.users))])
    runs.append(current)
    return [r for r in runs if len(r) > 1]


def bucket_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """Merge each run of ZeRO parameter gathers into one flat all-gather (module docstring).

    Requires: a lowered program after :func:`~autopar.passes.overlap.overlap_collectives`
    (functional ``all_gather_into_tensor`` collectives, each waited for by one
    ``wait_tensor``; ZeRO's marked ``capture.remat.REGATHER``). Guarantees: every gathered
    parameter has the value and shape it had; the merged collective is issued where the run's
    last gather was, or, when that is ahead of the previous run's copy-out (the prefetch),
    right after that copy-out (so the previous run's flat buffer is freed before this one is
    made: two layers' parameters at once, not three), and waited for where its first result
    was, keeping its members' metadata
    (part of the step, ZeRO mark); the other collectives keep their order among themselves
    (a merged one may come after a collective its first member came before: the same on every
    rank, whose programs change alike).
    """
    copied: dict[str, fx.Node] = {}  # per part: where the last merged run's copy-out ends
    for run in _runs(gm):
        part = _key(run[0])[0]
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        before = copied.get(part)
        first_read = min(position[next(iter(c.users))] for c in run)
        ahead = before is not None and position[run[-1]] < position[before] < first_read
        copied[part] = _merge(gm, run, before.next if ahead else run[-1])
    gm.graph.lint()
    gm.recompile()
    return gm


def _merge(gm: fx.GraphModule, run: list[fx.Node], issue: fx.Node) -> fx.Node:
    """Replace the collectives of ``run`` (and their waits) by one flat all-gather issued
    before node ``issue``; returns the last node of its copy-out."""
    graph = gm.graph
    position = {n: i for i, n in enumerate(graph.nodes)}
    waits = [next(iter(c.users)) for c in run]
    first_wait = min(waits, key=position.__getitem__)
    size, name = run[0].args[1], run[0].args[2]
    shards = [c.args[0] for c in run]
    sizes = [s.meta["val"].numel() for s in shards]
    like = shards[0].meta["val"]

    def add(target: object, args: tuple, val: object, meta: dict, kwargs: dict | None = None
            ) -> fx.Node:
        node = graph.call_function(target, args, kwargs or {})
        node.meta = {**meta, "val": val}
        return node

    with graph.inserting_before(issue):
        meta = dict(run[-1].meta)
        flat = [add(_aten.reshape.default, (s, [-1]), like.new_empty((n,)), meta)
                for s, n in zip(shards, sizes)]
        packed = add(_aten.cat.default, (flat,), like.new_empty((sum(sizes),)), meta)
        merged = add(_GATHER, (packed, size, name), like.new_empty((size * sum(sizes),)), meta)
    with graph.inserting_before(first_wait):  # copied out where the first result is read
        meta = dict(first_wait.meta)
        done = add(_WAIT, (merged,), merged.meta["val"], meta)
        grid = add(_aten.view.default, (done, [size, sum(sizes)]),
                   like.new_empty((size, sum(sizes))), meta)
        pieces = [like.new_empty((size, n)) for n in sizes]
        parts = add(_aten.split_with_sizes.default, (grid, sizes, 1), pieces, meta)
        for i, (c, w) in enumerate(zip(run, waits)):
            part = add(operator.getitem, (parts, i), pieces[i], meta)
            copy = add(_aten.clone.default, (part,), pieces[i], meta,
                       {"memory_format": torch.contiguous_format})
            out = add(_aten.view.default, (copy, list(c.meta["val"].shape)), c.meta["val"], meta)
            w.replace_all_uses_with(out)
    for c, w in zip(run, waits):
        graph.erase_node(w)
        graph.erase_node(c)
    return out
