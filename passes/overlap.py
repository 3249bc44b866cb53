"""Overlap pass: start each collective as early as its input allows (ZeRO-3's parameter
gathers a layer ahead), wait for it as late as its result allows.

A functional collective (``_c10d_functional.all_reduce`` and its kin) starts the communication
and returns at once; ``wait_tensor`` blocks until it is done. Traced programs issue a collective
where its consumer needs it and wait right after it, so nothing overlaps. :func:`overlap_collectives`
moves every collective (with the views of its input just before it) up to right after the node
computing its input, and every wait (with the views of its result that follow it: ``t``,
``view``, ``split`` and ``getitem``...) down to the first node that computes with the result, so
the compute in between runs while the communication does: a column-parallel layer's input-gradient all-reduce overlaps its weight-gradient GEMM
(Megatron-LM's asynchronous all-reduce, Narayanan et al., SC'21, sec. 4.2 and 3.3 of Korthikanti
et al., MLSys'23), a gradient bucket's all-reduce overlaps the rest of the backward
(:class:`autopar.passes.grad_buckets.GradientBuckets`). On GPUs, inductor schedules within the same
freedom; on CPU ranks (gloo) the eager program does, gloo running the collective on its own
thread.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopar.capture.remat import GatherRuns, is_regather, regather_layer
from autopar.passes.grad_buckets import WAIT_HERE

__all__ = ["overlap_collectives", "hoist_collectives", "marked_inputs", "prefetch_gathers", "sink_waits"]

_WAIT = torch.ops._c10d_functional.wait_tensor.default
_VIEWS = {
    torch.ops.aten.t.default, torch.ops.aten.transpose.int, torch.ops.aten.permute.default,
    torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default, torch.ops.aten.reshape.default,
    torch.ops.aten.alias.default, torch.ops.aten.split.Tensor, torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.select.int, torch.ops.aten.unsqueeze.default,
    torch.ops.aten.squeeze.dim, torch.ops.aten.expand.default, operator.getitem,
}


def overlap_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """:func:`hoist_collectives`, then :func:`sink_waits` (see the module docstring)."""
    return sink_waits(hoist_collectives(gm))


def hoist_collectives(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each collective, with the views of its input that only it reads, up to right
    after the last node it depends on, not before the collective before it nor a wait that
    stays where it is (:data:`~autopar.passes.grad_buckets.WAIT_HERE`). Collectives of the
    program's inputs stay (a ZeRO
    parameter's all-gather moved to the top would hold every gathered parameter at once;
    ZeRO-3's are issued a layer ahead by :func:`prefetch_gathers`).

    Requires: a local program of ``_c10d_functional`` collectives. Guarantees: the same nodes
    computing the same values; the collectives keep their order among themselves (every rank
    runs the same program, so they pair up as before); a collective never leaves its
    ``partitioner_tag`` (forward or backward part).
    """
    for c in [n for n in gm.graph.nodes if _is_collective(n)]:
        group = _input_views(c)
        position = {n: i for i, n in enumerate(gm.graph.nodes)}
        first = position[group[0]]
        outside = [a for n in group for a in n.all_input_nodes if a not in group]
        if any(_root(a).op != "call_function" for a in outside):
            continue  # a program input (a parameter's shard under ZeRO): gathered where used
        previous = _previous_collective(c)
        floor = max([position[a] for a in outside] + [_last_of_other_tag(c, position, first)]
                    + [position[p] for p in (previous, _previous_pinned_wait(c)) if p is not None])
        anchor = list(position)[floor] if floor >= 0 else None
        if anchor is not None and position[anchor] < first - 1:
            for n in group:
                anchor.append(n)
                anchor = n
    gm.graph.lint()
    gm.recompile()
    return gm


def prefetch_gathers(gm: fx.GraphModule) -> fx.GraphModule:
    """ZeRO-3's prefetch: move each parameter gather (the nodes the lowering marks
    ``capture.remat.REGATHER``, a collective with the marked nodes it reads) up to where
    :class:`~autopar.capture.remat.GatherRuns` issues it: a layer's gathers together, while the
    layer before it computes, in the forward and again in the backward. Their waits stay where
    the gathered copies are first read.

    Requires: a lowered joint program (``partitioner_tag`` set), each collective waited for by
    one ``wait_tensor``. Guarantees: the same nodes computing the same values; a gather never
    leaves its part of the step; every rank moves the same collectives the same way (their
    order changes alike on every rank); a gather whose inputs include an unmarked node computed
    after its new place stays where it is.
    """
    for backward in (False, True):
        runs = GatherRuns()
        for c in [n for n in gm.graph.nodes if _is_collective(n) and is_regather(n)
                  and (n.meta.get("partitioner_tag") == "is_backward") == backward]:
            wait = next((u for u in c.users if u.target is _WAIT), None)
            if wait is None:
                continue
            anchor, _ = runs.issue(regather_layer(c), wait)
            _move_before([*marked_inputs(c), c], anchor)
    gm.graph.lint()
    gm.recompile()
    return gm


def marked_inputs(c: fx.Node) -> list[fx.Node]:
    """The marked (``REGATHER``) nodes ``c`` depends on through marked nodes, in program order;
    an unmarked op among its inputs is returned too (and stops the move)."""
    seen: set[fx.Node] = set()
    todo = list(c.all_input_nodes)
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if is_regather(n):
            todo += n.all_input_nodes
    position = {n: i for i, n in enumerate(c.graph.nodes)}
    return sorted(seen, key=position.__getitem__)


def _move_before(group: list[fx.Node], anchor: fx.Node) -> None:
    """Put the nodes of ``group`` that come after ``anchor`` right before it, in order, unless
    one of them is unmarked (it may depend on what comes before it); right after the last
    node they read that is not before ``anchor`` (the anchor itself, when the gather reads
    what the anchor waits for), if there is one."""
    position = {n: i for i, n in enumerate(anchor.graph.nodes)}
    late = [n for n in group if position[n] > position[anchor]]
    if not late or any(not is_regather(n) for n in late):
        return
    moved = set(late)
    read = [a for n in late for a in n.all_input_nodes
            if a not in moved and position[a] >= position[anchor]]
    if read:  # (before the first of them, which the reads all precede)
        after = max(read, key=position.__getitem__)
        if position[after] + 1 >= position[late[0]]:
            return
        anchor = after.next
    for n in late:
        anchor.prepend(n)


def _root(n: fx.Node) -> fx.Node:
    """The node that ``n`` is a view of (``n`` itself if it is no view)."""
    while n.target in _VIEWS and n.args and isinstance(n.args[0], fx.Node):
        n = n.args[0]
    return n


def _is_collective(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "namespace", None) == "_c10d_functional" \
        and n.target is not _WAIT


def _input_views(c: fx.Node) -> list[fx.Node]:
    """``[views..., c]``: the chain of views just before ``c`` that only it reads."""
    group = [c]
    n = c.args[0] if c.args and isinstance(c.args[0], fx.Node) else None
    while n is not None and n.target in _VIEWS and len(n.users) == 1 and n.next is group[0]:
        group.insert(0, n)
        n = n.args[0] if isinstance(n.args[0], fx.Node) else None
    return group


def _last_of_other_tag(c: fx.Node, position: dict[fx.Node, int], first: int) -> int:
    """The position of the last node before ``first`` in another part than ``c``'s."""
    tag = c.meta.get("partitioner_tag")
    last = -1
    for n in position:
        if position[n] >= first:
            break
        other = n.meta.get("partitioner_tag")
        if tag is not None and other is not None and other != tag:
            last = position[n]
    return last


def _previous_pinned_wait(c: fx.Node) -> fx.Node | None:
    """The last wait before ``c`` marked to stay where it is (``grad_buckets.WAIT_HERE``):
    ``c`` is not issued before it (the collectives it waits for are kept one in flight)."""
    n = c.prev
    while n.op != "root":
        if n.target is _WAIT and (n.meta.get("custom") or {}).get(WAIT_HERE):
            return n
        n = n.prev
    return None


def _previous_collective(c: fx.Node) -> fx.Node | None:
    """The collective issued last before ``c`` (their order must not change)."""
    n = c.prev
    while n.op != "root":
        if _is_collective(n):
            return n
        n = n.prev
    return None


def sink_waits(gm: fx.GraphModule) -> fx.GraphModule:
    """Move each ``wait_tensor`` and the views of its result to just before the first node that
    uses them otherwise (see the module docstring).

    Requires: a local program whose collectives are ``_c10d_functional`` ops, each waited for
    by one ``wait_tensor``. Guarantees: the same nodes computing the same values (only their
    order changes); the collectives in the same order; a wait never crosses into another
    ``partitioner_tag`` (forward or backward part), so the forward/backward split is unchanged;
    a wait marked :data:`~autopar.passes.grad_buckets.WAIT_HERE` stays where it is.
    """
    for wait in [n for n in gm.graph.nodes if n.target is _WAIT
                 and not (n.meta.get("custom") or {}).get(WAIT_HERE)]:
        position = {n: i for i, n in enumerate(gm.graph.nodes)}  # (earlier groups moved)
        group = _wait_group(wait, position)
        target = group.pop()
        if target is not None and target is not wait.next:
            for n in group:
                target.prepend(n)
    gm.graph.lint()
    gm.recompile()
    return gm


def _wait_group(wait: fx.Node, position: dict[fx.Node, int]) -> list:
    """``[wait, views of its result..., target]``: the nodes to move, in order, and the node to
    put them before (``None`` if they need not move)."""
    members, group = {wait}, [wait]
    tag = wait.meta.get("partitioner_tag")
    n = wait.next
    while n.op != "root":
        other = n.meta.get("partitioner_tag")
        if n.op == "output" or (tag is not None and other is not None and other != tag):
            return group + [n]
        inputs = n.all_input_nodes
        if any(a in members for a in inputs):
            if n.target in _VIEWS and all(a in members or position[a] < position[wait] for a in inputs):
                members.add(n)
                group.append(n)
            else:
                return group + [n]
        n = n.next
    return group + [None]
