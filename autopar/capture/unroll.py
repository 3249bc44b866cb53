"""A deep model's forward graph from the export of a short copy: its repeated block copied.

``torch.export`` of DeepSeek-V3's 61 layers under ``FakeTensorMode`` takes about 19 s on a
laptop-class CPU, about 0.3 s a block, spent tracing the same block again and again. A model
whose block list ends in a run of identical blocks (:func:`~autopar.capture.layers.
leading_blocks`) is exported with its leading blocks and the first two of that run only
(:func:`~autopar.capture.layers.with_blocks`); :func:`unroll_blocks` then copies the last
block's nodes once for every further block, each copy reading its own block's parameters and
buffers and the previous copy's outputs, and feeds the last copy to what came after the blocks
(final norm, head, loss). This is what an export of the whole model would have traced, provided
every repeated block is the same function of the previous block's outputs and of values
computed before the blocks (masks, positions, rotary tables). The two exported blocks of the
run are checked to be so, node for node: the same ops with the same constants, reading the
same values from before the blocks, their own weights (the same ones by name within the block)
and their own or the previous block's nodes at the same positions; the code after the blocks
must read no block but the last (no loss over every block's router logits, for example).

What the check cannot see: a block whose behaviour depends on its index through a Python
attribute that differs only in blocks beyond the two exported (a sliding window on the last
layers only, set from the config). The copies would then miss it. That is why the unrolled
graph is used only for a model that is never run (built under ``FakeTensorMode``, planned and
not executed; :func:`autopar.capture.stages.export_forward`), like the stage copies of
:mod:`autopar.capture.stage_copies`, and why :func:`identical_blocks` must already find its
blocks alike by structure and weight shapes.

Requires: ``gm`` is the cleaned unlifted export of the loss wrapper of a copy of ``model`` whose
block list holds its first ``lead + 2`` blocks. Guarantees: on success ``gm`` holds the forward
graph of the whole model, the copies' nodes carrying their own block's module paths and
parameters; on refusal (a reason returned) ``gm`` is unchanged.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from autopar._torch_private import FakeTensor

from autopar.capture.layers import WRAP, attribute, layer_units, set_module_attr

__all__ = ["attribute_refusal", "call_inputs", "constant_key", "renamed_meta", "unroll_blocks"]

_PLAIN = (int, float, bool, str, type(None))


def attribute_refusal(blocks: Sequence[nn.Module], lead: int) -> str | None:
    """Why the repeated blocks after the two exported ones may not behave as the second, if a
    plain attribute tells (an ``int``, ``float``, ``bool``, ``str`` or ``None``, or a tuple
    of them, on any of their modules): one that differs from block ``lead + 1``'s where blocks
    ``lead`` and ``lead + 1`` agree, as a sliding window set from the config on some layers
    only. One the two exported blocks already differ in (a layer index) is one the node-for-node
    check of :func:`unroll_blocks` shows the graph does not depend on."""
    def plain(block: nn.Module) -> dict[tuple[str, str], str]:
        return {(path, k): repr(v) for path, m in block.named_modules() for k, v in vars(m).items()
                if not k.startswith("_") and (isinstance(v, _PLAIN) or isinstance(v, tuple)
                                              and all(isinstance(x, _PLAIN) for x in v))}

    ref, first = plain(blocks[lead + 1]), plain(blocks[lead])
    free = {k for k in ref.keys() | first.keys() if ref.get(k) != first.get(k)}
    for i in range(lead + 2, len(blocks)):
        got = plain(blocks[i])
        for key in sorted(got.keys() | ref.keys()):
            if key not in free and got.get(key) != ref.get(key):
                path = ".".join(p for p in (str(i), *key) if p)
                return (f"block attribute {path} is {got.get(key)}, where block {lead + 1}'s is "
                        f"{ref.get(key)}: the blocks may differ beyond the two exported")
    return None


def unroll_blocks(gm: fx.GraphModule, model: nn.Module, prefix: str, lead: int,
                  total: int) -> str | None:
    """Extend ``gm`` (blocks ``0 .. lead + 1`` of ``model``'s ``prefix``) to ``total`` blocks in
    place (module docstring); the reason it cannot, or ``None`` when done."""
    nodes = list(gm.graph.nodes)
    if any(n.op not in ("placeholder", "get_attr", "call_function", "output") for n in nodes):
        return "the graph has module or method calls"
    _, unit_of = layer_units(nodes, prefix, lead + 2)
    prev_unit, last_unit = lead + 1, lead + 2
    in_prev = [n for n in nodes if unit_of.get(n.name) == prev_unit]
    in_last = [n for n in nodes if unit_of.get(n.name) == last_unit]
    if len(in_prev) != len(in_last) or not in_last:
        return (f"blocks {lead} and {lead + 1} traced to {len(in_prev)} and {len(in_last)} nodes")
    block_attr = re.compile(rf"^{re.escape(WRAP + prefix)}\.(\d+)\.(.+)$")
    pos = {n: i for i, n in enumerate(in_prev)} | {n: i for i, n in enumerate(in_last)}

    own_tensors = {WRAP + n: i for i, (n, _) in enumerate(
        (*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)))}

    def role(a: fx.Node, unit: int) -> tuple | None:
        """What input ``a`` is to a node of ``unit``: its own node (by position), the previous
        unit's, its own weight (by name within the block), a constant or a region's body (by
        value), a shared value, or None (refused)."""
        if a.op == "get_attr":
            m = block_attr.match(a.target)
            if m is not None and a.target in own_tensors:
                return ("attr", m.group(2)) if int(m.group(1)) == unit - 1 else None
            value = attribute(gm, a.target)
            if isinstance(value, fx.GraphModule):
                return ("body", value.code)
            if m is None:
                return ("shared", a)
            return ("const", constant_key(value)) if int(m.group(1)) == unit - 1 else None
        u = unit_of.get(a.name, 0)
        if u == unit:
            return ("own", pos[a])
        if u == unit - 1:
            return ("prev", None if unit == prev_unit else pos[a])
        return ("shared", a) if u == 0 else None

    roles: dict[fx.Node, tuple] = {}
    for x, y in zip(in_prev, in_last):
        why = _same_step(x, y, role, roles, prev_unit, last_unit)
        if why:
            return f"blocks {lead} and {lead + 1} differ: {why}"
    end = nodes.index(in_last[-1]) + 1  # (the copies go right after the last block)
    why = _outside_refusal(nodes, unit_of, end, last_unit, lambda a: a.op == "get_attr"
                           and a.target in own_tensors and block_attr.match(a.target) is not None)
    if why:
        return why
    inside = set(in_last)
    after = [n for n in nodes[end:] if n.op in ("call_function", "output")]
    last = _copies(gm, model, prefix, lead, total, in_last, roles, nodes[end])
    for z in after:
        for b in [a for a in z.all_input_nodes if a in inside]:
            z.replace_input_with(b, last[pos[b]])
    _in_model_order(gm.graph, own_tensors)
    gm.graph.lint()
    gm.recompile()
    return None


def _outside_refusal(nodes: list[fx.Node], unit_of: dict[str, int], end: int, last_unit: int,
                     block_weight: Callable[[fx.Node], bool]) -> str | None:
    """Why the code outside the blocks stops the copies, if it does: it must read no block's
    node but the last one's, and that only after the last block's nodes (the final norm, head
    and loss: not always labelled post, as a top-level module first used before the blocks
    holds them), and no block's weight; no block's node may come after the last block's."""
    blocks = range(1, last_unit + 1)
    for i, z in enumerate(nodes):
        if z.op not in ("call_function", "output"):
            continue
        if unit_of.get(z.name) in blocks:
            if i >= end:
                return f"{z.name} of a block comes after the last exported block's last node"
            continue
        for a in z.all_input_nodes:
            u = unit_of.get(a.name)
            if u in blocks and (u != last_unit or i < end):
                return (f"{z.name}, outside the blocks, reads {a.name} of block {u - 1} "
                        f"(e.g. a loss over every block's output)")
            if block_weight(a):
                return f"{z.name}, outside the blocks, reads a block's weight ({a.target})"
    return None


_NODE = object()  # (a node's place among a call's arguments)


def call_inputs(n: fx.Node) -> tuple[list[fx.Node], Any]:
    """``n``'s input nodes in argument order (repeats kept) and its arguments with each node
    replaced by one marker (the constants it is called with, and where the nodes go)."""
    found: list[fx.Node] = []
    blank = fx.node.map_arg((n.args, n.kwargs), lambda a: found.append(a) or _NODE)
    return found, blank


def _same_step(x: fx.Node, y: fx.Node, role: Any, roles: dict, prev_unit: int,
               last_unit: int) -> str | None:
    """Whether ``y`` (the last exported block) does what ``x`` (the block before) does;
    records the roles of ``y``'s inputs."""
    xs, xc = call_inputs(x)
    ys, yc = call_inputs(y)
    if x.target != y.target or xc != yc or len(xs) != len(ys):
        return f"{x.name} and {y.name} are different calls"
    for ax, ay in zip(xs, ys):
        ry, rx = role(ay, last_unit), role(ax, prev_unit)
        # a value from before the blocks: the very same one; the previous block's output: a
        # node of the block before (or, for the first block of the run, of what precedes it);
        # its own nodes, weights and region bodies: the same position, name and code
        same = ry is not None and (ax is ay if ry[0] == "shared" else
                                   rx == ("prev", None) if ry[0] == "prev" else rx == ry)
        if not same:
            return f"{y.name} reads {ay.name} where {x.name} reads {ax.name}"
        roles[ay] = ry
    return None


def _copies(gm: fx.GraphModule, model: nn.Module, prefix: str, lead: int, total: int,
            in_last: list[fx.Node], roles: dict, before: fx.Node) -> list[fx.Node]:
    """Blocks ``lead + 2 .. total - 1``: copies of ``in_last`` inserted before ``before``; the
    last copy's nodes."""
    graph = gm.graph
    prev = list(in_last)
    src = rf"{re.escape(WRAP + prefix)}\.{lead + 1}(?=\.|$)"
    src_prefix = f"{WRAP}{prefix}.{lead + 1}."
    with graph.inserting_before(before):
        for k in range(lead + 2, total):
            attrs: dict[str, fx.Node] = {}
            env: list[fx.Node] = []

            def arg(a: fx.Node) -> fx.Node:
                kind, key = roles[a]
                if kind == "own":
                    return env[key]
                if kind == "prev":
                    return prev[key]
                if kind in ("attr", "const"):  # (a constant: the last block's value, own name)
                    assert a.target.startswith(src_prefix), (a.target, src_prefix)
                    name = a.target[len(src_prefix):]
                    if name not in attrs:
                        target = f"{WRAP}{prefix}.{k}.{name}"
                        value = attribute(model, target[len(WRAP):]) if kind == "attr" \
                            else attribute(gm, a.target)
                        set_module_attr(gm, target, value)
                        attrs[name] = graph.get_attr(target)
                        attrs[name].meta = dict(a.meta)
                    return attrs[name]
                return a  # a value from before the blocks, or a region's body (the same code)

            for y in in_last:
                new = graph.node_copy(y, arg)
                new.meta = renamed_meta(y.meta, src, f"{WRAP}{prefix}.{k}")
                env.append(new)
            prev = env
    return prev


def _in_model_order(graph: fx.Graph, rank: dict[str, int]) -> None:
    """Move the parameters' and buffers' reads to the top in the model's order (parameters,
    then buffers), as an export of the whole model has them (a stage lists its parameters in
    the order its graph reads them)."""
    reads = sorted((n for n in graph.nodes if n.op == "get_attr" and n.target in rank),
                   key=lambda n: rank[n.target])
    anchor = next(n for n in graph.nodes if not (n.op == "get_attr" and n.target in rank))
    for n in reads:
        anchor.prepend(n)


def constant_key(value: Any) -> tuple:
    """What makes a block's lifted constant the same as another's: its type, shape, dtype and,
    for a real tensor, its values (a fake one has none: the same op made it in both blocks)."""
    if not isinstance(value, torch.Tensor):
        return (type(value).__name__, repr(value))
    real = not isinstance(value, FakeTensor)
    return (tuple(value.shape), value.dtype, tuple(value.flatten().tolist()) if real else None)


def renamed_meta(meta: dict, src: str, dst: str) -> dict:
    """``meta`` with the module paths of its module stacks (the forward's, and the one a
    backward node may carry from its forward) moved from block ``src`` to ``dst`` (regular
    expressions, as :func:`re.sub` takes them)."""
    out = dict(meta)
    for field in ("nn_module_stack", "fwd_nn_module_stack"):
        stack = meta.get(field)
        if stack:
            out[field] = {re.sub(src, dst, k): (re.sub(src, dst, v[0]), *v[1:])
                          if isinstance(v, tuple) else v for k, v in stack.items()}
    return out
