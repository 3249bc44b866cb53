"""A pipeline stage's joint graph from the trace of a short copy: its repeated blocks copied.

Tracing a stage's forward and backward (AOTAutograd under ``FakeTensorMode``) costs about the
same for every block it holds: DeepSeek-V3's stages of ten layers took 6-10 s each, three of
them on the planner's path. A stage whose forward program holds a run of three or more alike
blocks (:func:`alike_run`) is traced with the first two of that run only (:func:`short_stage`),
and :func:`unroll_joint` copies the second block's forward and backward once for each block
left out. The joint graph of such a stage is, in order: the values before the run (and the
blocks before it), each block's forward, what follows the blocks (forward and backward), each
block's backward in reverse, and the backward of what came before. The copies go where the
trace of the whole stage puts those blocks' nodes; each copy's forward reads the previous
block's forward, its own parameters and the values from before the run, and its backward reads
its own and the previous block's forward values, its parameters and the next block's backward
(the last copy: what followed the blocks, as the second block did in the short trace).

The two traced blocks are checked to be so, node for node, forward and backward: the same ops
with the same constants; inputs of the same role at the same positions (own nodes, the
previous block's forward, own parameters by name within the block, the same shared value, and
in the backward the next block's gradient where the first block reads the second's). What
follows the blocks may read the last block's forward only; what precedes the run's backward in
the trace order is left alone, and the backward of what came before may not read the second
block (a gradient summed over the blocks would need its sum extended). The left-out blocks of
the stage's forward program are checked against the second by op, constants, shapes and the
same inputs (:func:`alike_run`). A refusal leaves the stage to be traced whole.

Used for a model that is never run (built under ``FakeTensorMode``), as
:mod:`autopar.capture.unroll`: the check cannot see a block whose behaviour depends on its index
through state the forward program does not show.

Requires: the stage was cut from one exported forward graph whose layer units ``unit_of``
gives (:mod:`autopar.capture.stages`). Guarantees: :func:`unroll_joint`'s graph equals the
joint trace of the whole stage node for node but for node names (the copies' names carry a
suffix; placeholders are renumbered ``primals_1 ...`` in the whole stage's parameter order).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Sequence

import torch.fx as fx
import torch.nn as nn

from autopar.capture.joint import node_layers
from autopar.capture.layers import WRAP, attribute, is_backward, set_module_attr
from autopar.capture.unroll import call_inputs, constant_key, renamed_meta

__all__ = ["alike_run", "short_stage", "unroll_joint"]


def _block_nodes(gm: fx.GraphModule, unit_of: dict[str, int], units: Sequence[int]
                 ) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = {u: [] for u in units}
    for n in gm.graph.nodes:
        if n.op == "call_function" and unit_of.get(n.name) in out:
            out[unit_of[n.name]].append(n)
    return out


def _signature(gm: fx.GraphModule, unit: int, nodes: list[fx.Node], prev: list[fx.Node],
               attr_block: re.Pattern) -> tuple:
    """Block ``unit``'s forward program by role: each node's op, constants, output shape and
    inputs (its own nodes and the previous block's by position, its own parameters and buffers
    by name within the block with their shape and dtype, anything else, another block's weight
    included, as itself)."""
    own = {n: i for i, n in enumerate(nodes)}
    before = {n: i for i, n in enumerate(prev)}

    def role(a: fx.Node) -> tuple:
        if a in own:
            return ("own", own[a])
        if a in before:
            return ("prev", before[a])
        m = attr_block.match(str(a.target)) if a.op == "get_attr" else None
        if m is None or int(m.group(1)) + 1 != unit:
            return ("same", a)
        value = attribute(gm, a.target)
        return ("attr", m.group(2), tuple(getattr(value, "shape", ())),
                getattr(value, "dtype", type(value)))

    out = []
    for n in nodes:
        found, blank = call_inputs(n)
        val = n.meta.get("val")
        shape = (tuple(val.shape), val.dtype) if hasattr(val, "shape") else repr(type(val))
        out.append((n.target, repr(blank), shape, tuple(role(a) for a in found)))
    return tuple(out)


def alike_run(stage: Any, unit_of: dict[str, int], prefix: str) -> list[int]:
    """The units of the longest run of consecutive blocks of ``stage`` (a
    :class:`~autopar.capture.stages.StageGraph`) whose forward programs are alike from the
    second on (:func:`_signature`; the first's may read what precedes the run differently), if
    it holds three blocks or more; else ``[]``."""
    attr_block = re.compile(rf"^{re.escape(WRAP + prefix)}\.(\d+)\.(.+)$")
    units = sorted({unit_of[n.name] for n in stage.gm.graph.nodes
                    if n.op == "call_function" and n.name in unit_of} - {0, max(unit_of.values())})
    nodes = _block_nodes(stage.gm, unit_of, units)
    best: list[int] = []
    run: list[int] = []
    sig = None
    for u in units:
        mine = _signature(stage.gm, u, nodes[u], nodes[u - 1], attr_block) if u - 1 in nodes \
            else None
        if run and u == run[-1] + 1 and (len(run) == 1 or mine == sig) and mine is not None \
                and [n.target for n in nodes[u]] == [n.target for n in nodes[run[0]]]:
            run.append(u)
            sig = mine if len(run) == 2 else sig
        else:
            run, sig = [u], None
        if len(run) > len(best):
            best = list(run)
    return best if len(best) >= 3 else []


def short_stage(stage: Any, unit_of: dict[str, int], run: Sequence[int], prefix: str) -> Any:
    """``stage`` with the blocks of ``run`` after its first two left out: what read the last
    block reads the second, by position; ``None`` when a node outside the run reads another
    block of it (a loss over every block's router logits, a value of an earlier block carried
    to the next stage)."""
    drop = set(run[2:])
    nodes = _block_nodes(stage.gm, unit_of, run)
    last = {n: i for i, n in enumerate(nodes[run[-1]])}
    second = nodes[run[1]]
    attr_block = re.compile(rf"^{re.escape(WRAP + prefix)}\.(\d+)\.")
    dropped_attr = {n for n in stage.gm.graph.nodes if n.op == "get_attr"
                    and (m := attr_block.match(n.target)) and int(m.group(1)) + 1 in drop}
    dropped = {n for u in drop for n in nodes[u]} | dropped_attr
    in_run = {n: u for u in run for n in nodes[u]}
    for n in stage.gm.graph.nodes:  # (outside the run, a block read is the last one's: the
        # copies stand in for it; a tap on an earlier block, carried out or summed, is not;
        # nor is a left-out block's weight read by a node kept, as a regulariser on it)
        if n not in dropped and any(a in dropped_attr or n not in in_run and in_run.get(
                a, run[-1]) != run[-1] for a in n.all_input_nodes):
            return None
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    root = nn.Module()
    params: list[str] = []
    for n in stage.gm.graph.nodes:
        if n in dropped:
            continue
        if n.op == "get_attr":
            value = attribute(stage.gm, n.target)
            set_module_attr(root, n.target, value)
            if isinstance(value, nn.Parameter):
                params.append(n.target[len(WRAP):] if n.target.startswith(WRAP) else n.target)
        env[n] = g.node_copy(n, lambda a: env[second[last[a]]] if a in last else env[a])
    gm = fx.GraphModule(root, g)
    return dataclasses.replace(stage, gm=gm, params=tuple(params))


@dataclasses.dataclass(frozen=True)
class _Runs:
    """The traced blocks' nodes in a short stage's joint graph: the first and second blocks'
    forward (``fa``, ``fb``) and backward (``ba``, ``bb``), and each node's index."""

    fa: list[fx.Node]
    fb: list[fx.Node]
    bb: list[fx.Node]
    ba: list[fx.Node]
    index: dict[fx.Node, int]

    def pos(self, which: str) -> dict[fx.Node, int]:
        return {n: i for i, n in enumerate(getattr(self, which))}


def _runs(gm: fx.GraphModule, prefix: str, run: Sequence[int]) -> _Runs | str:
    """The two traced blocks' forward and backward runs, each one contiguous stretch of calls,
    in the order forward first, forward second, backward second, backward first."""
    node_layer, _ = node_layers(gm, (), prefix)
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    at = {n: i for i, n in enumerate(calls)}
    found = []
    for backward, unit in ((False, run[0]), (False, run[1]), (True, run[1]), (True, run[0])):
        layer = f"{prefix}.{unit - 1}"
        mine = [n for n in calls if node_layer.get(n.name) == layer and is_backward(n) == backward]
        if not mine or at[mine[-1]] - at[mine[0]] != len(mine) - 1:
            return f"{'backward' if backward else 'forward'} of {layer} is not one stretch of nodes"
        found.append(mine)
    fa, fb, bb, ba = found
    if len(fa) != len(fb) or len(ba) != len(bb):
        return f"the traced blocks have {len(fa)}, {len(fb)} forward and {len(ba)}, {len(bb)} backward nodes"
    if at[fb[0]] != at[fa[-1]] + 1 or at[ba[0]] != at[bb[-1]] + 1 or at[fb[-1]] > at[bb[0]]:
        return "the traced blocks' forward and backward are not in the order of a joint trace"
    return _Runs(fa, fb, bb, ba, {n: i for i, n in enumerate(gm.graph.nodes)})


def _block_input(n: fx.Node, attr_block: re.Pattern) -> tuple[int, str] | None:
    """(unit, name within the block) of a block's parameter or buffer placeholder."""
    if n.op != "placeholder":
        return None
    target = getattr(n.meta.get("desc"), "target", None)
    m = attr_block.match(target) if isinstance(target, str) else None
    return (int(m.group(1)) + 1, m.group(2)) if m else None


def _roles(r: _Runs, run: Sequence[int], attr_block: re.Pattern
           ) -> tuple[list[dict], list[dict]] | str:
    """What each input of the second block's forward and backward nodes is to it, checked
    against the first block's nodes at the same positions (the module docstring); the reason
    they differ, as a string."""
    fa, fb, bb, ba = r.pos("fa"), r.pos("fb"), r.pos("bb"), r.pos("ba")
    inside = fa.keys() | fb.keys() | bb.keys() | ba.keys()

    def outside(a: fx.Node) -> bool:
        bi = _block_input(a, attr_block)
        return a not in inside and (bi is None or bi[0] not in run[:2])

    def role(ax: fx.Node, ay: fx.Node, backward: bool) -> tuple | None:
        own, mine = (ba, bb) if backward else (fa, fb)
        by = _block_input(ay, attr_block)
        if ay in mine:
            return ("own", mine[ay]) if own.get(ax) == mine[ay] else None
        if backward and ay in fb:
            return ("fwd", fb[ay]) if fa.get(ax) == fb[ay] else None
        if ay in fa:  # the previous block's forward: the first block reads what precedes the run
            return ("prev", fa[ay]) if outside(ax) and r.index[ax] < r.index[r.fa[0]] else None
        if by is not None and by[0] == run[1]:
            bx = _block_input(ax, attr_block)
            # a constant export lifted is numbered across the model (``lifted_tensor_4``):
            # the same by its shape, dtype and (a real one) its values
            const = bx is not None and bx[0] == run[0] and _kind(ax) == _kind(ay) == \
                "BufferAOTInput" and constant_key(ax.meta["val"]) == constant_key(ay.meta["val"])
            return ("param", by[1]) if bx == (run[0], by[1]) or const else None
        if ax is ay and outside(ay):
            return ("same", None)
        if backward and ax in bb and outside(ay) and (_kind(ay) == "TangentAOTInput" or r.index[
                r.fb[-1]] < r.index[ay] < r.index[r.bb[0]]):
            return ("next", bb[ax])  # the gradient the next block (or what follows) sends
        return None

    out: tuple[list[dict], list[dict]] = ([], [])
    for backward, xs, ys in ((False, r.fa, r.fb), (True, r.ba, r.bb)):
        for x, y in zip(xs, ys):
            (ax_all, xc), (ay_all, yc) = call_inputs(x), call_inputs(y)
            if x.target != y.target or xc != yc or len(ax_all) != len(ay_all):
                return f"{x.name} and {y.name} are different calls"
            mine: dict[fx.Node, tuple] = {}
            for ax, ay in zip(ax_all, ay_all):
                got = role(ax, ay, backward)
                if got is None or mine.setdefault(ay, got) != got:
                    return f"{y.name} reads {ay.name} where {x.name} reads {ax.name}"
            out[backward].append(mine)
    return out


def _outside_refusal(gm: fx.GraphModule, r: _Runs) -> str | None:
    """Why the nodes outside the traced blocks stop the copies, if they do: between the forward
    and the backward of the blocks they may read the second block's forward (the last block's,
    once copied) and not the first's; after the backward, neither the second block's forward nor
    its backward; the outputs, no forward node of the first block."""
    fa, fb, bb = set(r.fa), set(r.fb), set(r.bb)
    inside = fa | fb | bb | set(r.ba)
    first, last = r.index[r.fb[-1]], r.index[r.ba[-1]]
    for n in gm.graph.nodes:
        if n in inside or r.index[n] < first:
            continue
        banned = fa if r.index[n] < last else fb | bb
        if n.op == "output":
            banned = fa
        hit = next((a for a in n.all_input_nodes if a in banned), None)
        if hit is not None:
            return f"{n.name}, outside the blocks, reads {hit.name} of a traced block"
    return None


def _kind(n: fx.Node) -> str:
    return type(n.meta.get("desc")).__name__


def _primals(gm: fx.GraphModule, stage: Any, attr_block: re.Pattern, drop: set[int]
             ) -> tuple[list[str], list[str], dict[str, fx.Node]] | str:
    """The whole stage's parameter and buffer names (in the order a trace of it lists them:
    its module's ``named_parameters`` and ``named_buffers``) and the short trace's placeholder
    of each name it has; the reason they do not match, as a string."""
    names = ([n for n, _ in stage.gm.named_parameters(remove_duplicate=False)],
             [n for n, _ in stage.gm.named_buffers(remove_duplicate=False)])
    kinds = ("ParamAOTInput", "BufferAOTInput")
    held = [[n for n in gm.graph.nodes if n.op == "placeholder" and _kind(n) == k] for k in kinds]
    for got, want in zip(held, names):
        short = [t for t in want if not ((m := attr_block.match(t)) and int(m.group(1)) + 1 in drop)]
        if [n.meta["desc"].target for n in got] != short:
            return "the short trace's parameters or buffers are not the stage's, in its order"
    order = [_kind(n) for n in gm.graph.nodes if n.op == "placeholder"]
    rank = [kinds.index(k) if k in kinds else 2 for k in order]
    if rank != sorted(rank):
        return "the short trace's inputs are not parameters, then buffers, then the others"
    return names[0], names[1], {n.meta["desc"].target: n for got in held for n in got}


def unroll_joint(gm: fx.GraphModule, stage: Any, prefix: str, run: Sequence[int]
                 ) -> fx.GraphModule | str:
    """The joint graph of ``stage`` (a :class:`~autopar.capture.stages.StageGraph`) from ``gm``,
    the joint trace of its :func:`short_stage` for ``run`` (:func:`alike_run`): the blocks of
    ``run`` after the second copied from it (the module docstring); the reason it cannot be, as
    a string (``gm`` is left unchanged either way)."""
    attr_block = re.compile(rf"^{re.escape(WRAP + prefix)}\.(\d+)\.(.+)$")
    drop = list(run[2:])
    r = _runs(gm, prefix, run)
    if isinstance(r, str):
        return r
    roles = _roles(r, run, attr_block)
    if isinstance(roles, str):
        return roles
    why = _outside_refusal(gm, r)
    primals = _primals(gm, stage, attr_block, set(drop))
    if why or isinstance(primals, str):
        return why or primals
    params, buffers, held = primals
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    copies: dict[tuple[int, str], fx.Node] = {}
    b_inputs = {bi[1]: n for n in gm.graph.nodes if (bi := _block_input(n, attr_block)) and bi[0] == run[1]}
    sources: list[fx.Node | tuple[int, str]] = []  # (what each primal input of g stands for)
    for i, name in enumerate((*params, *buffers)):
        src = held.get(name)
        new = g.placeholder(f"primals_{i + 1}")
        if src is not None:
            new.meta, env[src] = dict(src.meta), new
            sources.append(src)
            continue
        m = attr_block.match(name)
        model = b_inputs.get(m.group(2)) if m else None
        if model is None:
            return f"the stage's {name} is neither in the short trace nor a copied block's"
        mine, like = attribute(stage.gm, name), model.meta["val"]
        if tuple(mine.shape) != tuple(like.shape) or mine.dtype != like.dtype:
            return (f"the stage's {name} is {tuple(mine.shape)} {mine.dtype}, the second "
                    f"block's {tuple(like.shape)} {like.dtype}")
        new.meta = dict(model.meta, desc=dataclasses.replace(model.meta["desc"], target=name))
        copies[(int(m.group(1)) + 1, m.group(2))] = new
        sources.append((int(m.group(1)) + 1, m.group(2)))
    for n in gm.graph.nodes:
        if n.op == "placeholder" and n not in env:
            plain = _kind(n) != "TangentAOTInput"
            env[n] = g.placeholder(f"primals_{len(sources) + 1}" if plain else n.name)
            env[n].meta = dict(n.meta)
            sources += [n] if plain else []
    blocks = _emit(gm, g, env, copies, r, roles, run, prefix)
    why = _output(gm, g, env, blocks, sources, b_inputs, r, run, prefix)
    if why:
        return why
    g.lint()
    return fx.GraphModule(gm, g)


def _emit(gm: fx.GraphModule, g: fx.Graph, env: dict[fx.Node, fx.Node],
          copies: dict[tuple[int, str], fx.Node], r: _Runs, roles: tuple[list[dict], list[dict]],
          run: Sequence[int], prefix: str) -> tuple[dict[int, list[fx.Node]], dict[int, list[fx.Node]]]:
    """Copy ``gm``'s nodes but its output into ``g``, with each left-out block's forward after
    the second block's and its backward before the second block's (the module docstring);
    every block's forward and backward nodes in ``g``, by unit."""
    fwd: dict[int, list[fx.Node]] = {}
    bwd: dict[int, list[fx.Node]] = {}
    fb_pos, bb_pos = r.pos("fb"), r.pos("bb")
    src = rf"{re.escape(WRAP + prefix)}\.{run[1] - 1}(?=\.|$)"

    def block(nodes: list[fx.Node], block_roles: list[dict], k: int) -> list[fx.Node]:
        mine: list[fx.Node] = []
        for y, rl in zip(nodes, block_roles):
            def arg(a: fx.Node, rl: dict = rl) -> fx.Node:
                kind, key = rl[a]
                if kind == "own":
                    return mine[key]
                if kind in ("fwd", "prev"):
                    return fwd[k if kind == "fwd" else k - 1][key]
                if kind == "param":
                    return copies[(k, key)]
                if kind == "next" and k + 1 in bwd:
                    return bwd[k + 1][key]
                return env[a]  # (the last block's next: what follows the blocks, as traced)

            new = g.node_copy(y, arg)
            new.meta = renamed_meta(y.meta, src, f"{WRAP}{prefix}.{k - 1}")
            mine.append(new)
        return mine

    after, before = r.index[r.fb[-1]], r.index[r.bb[0]]
    for n in gm.graph.nodes:
        if n.op in ("placeholder", "output"):
            continue
        if n is r.bb[0]:
            for k in reversed(run[2:]):
                bwd[k] = block(r.bb, roles[1], k)
        if n in bb_pos:  # the second block's backward: its next block is the first copy
            rl = roles[1][bb_pos[n]]
            env[n] = g.node_copy(n, lambda a, rl=rl: bwd[run[2]][rl[a][1]]
                                 if rl[a][0] == "next" else env[a])
        elif after < r.index[n] < before:  # what follows the blocks reads the last one
            env[n] = g.node_copy(n, lambda a: fwd[run[-1]][fb_pos[a]] if a in fb_pos else env[a])
        else:
            env[n] = g.node_copy(n, lambda a: env[a])
        if n is r.fb[-1]:
            fwd[run[0]], fwd[run[1]] = [env[x] for x in r.fa], [env[y] for y in r.fb]
            for k in run[2:]:
                fwd[k] = block(r.fb, roles[0], k)
    bwd[run[1]], bwd[run[0]] = [env[y] for y in r.bb], [env[x] for x in r.ba]
    return fwd, bwd


def _output(gm: fx.GraphModule, g: fx.Graph, env: dict[fx.Node, fx.Node],
            blocks: tuple[dict[int, list[fx.Node]], dict[int, list[fx.Node]]],
            sources: list, b_inputs: dict[str, fx.Node], r: _Runs, run: Sequence[int],
            prefix: str) -> str | None:
    """``g``'s output: the forward outputs (the second block's nodes read from the last
    block), then a gradient (or ``None``) for every primal input of ``g`` in its order, a
    copied block's from its backward; the reason it cannot be, as a string."""
    fwd, bwd = blocks
    out = next(n for n in gm.graph.nodes if n.op == "output")
    vals, descs = list(out.args[0]), list(out.meta.get("desc") or [])
    primal = [n for n in gm.graph.nodes if n.op == "placeholder" and _kind(n) != "TangentAOTInput"]
    nf = len(vals) - len(primal)
    if nf < 0 or len(descs) != len(vals):
        return f"the short trace has {len(vals)} outputs for {len(primal)} inputs"
    slot = {p: (vals[nf + j], descs[nf + j]) for j, p in enumerate(primal)}
    for p, (_, d) in slot.items():
        of = getattr(d, "grad_of", None)
        if of is not None and of != p.meta.get("desc"):
            return f"the short trace's output for {p.name} is the gradient of {of}"
    fb_pos, bb_pos = r.pos("fb"), r.pos("bb")
    new_vals = [fwd[run[-1]][fb_pos[v]] if v in fb_pos else None if v is None else env[v]
                for v in vals[:nf]]
    new_descs = descs[:nf]
    for source in sources:
        if isinstance(source, fx.Node):
            v, d = slot[source]
            new_vals.append(None if v is None else env[v])
            new_descs.append(d)
            continue
        k, inner = source
        v, d = slot[b_inputs[inner]]
        if v is not None and v not in bb_pos:
            return f"the gradient of the second block's {inner} is not in its backward"
        name = f"{WRAP}{prefix}.{k - 1}.{inner}"
        new_vals.append(None if v is None else bwd[k][bb_pos[v]])
        new_descs.append(None if d is None else dataclasses.replace(
            d, grad_of=dataclasses.replace(d.grad_of, target=name)))
    node = g.output(type(out.args[0])(new_vals))
    node.meta = dict(out.meta, desc=new_descs)
    return None
