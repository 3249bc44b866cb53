"""Stage pass: a model's forward graph + stage cuts -> one forward GraphModule per pipeline stage.

The unit of cutting is the *layer unit*: the code before the repeated blocks (``pre``: embeddings),
each block (``blocks.0`` ...), and the code after them (``post``: final norm, LM head, loss).
:func:`layer_units` assigns every node of a graph to a unit; :func:`split_stages` cuts the
exported forward graph (``torch.export``'s unlifted module of the loss wrapper) into stages.

Why not ``torch.fx.passes.split_module``: it passes parameters into partitions as inputs and lets
a value skip partitions (stage 0 feeding stage 2 directly), while a pipeline stage must own its
parameters and talk only to its neighbours. The split here is a plain node copy with three rules:

- a parameter (``get_attr``) is copied into every stage that reads it, so a tied embedding/LM head
  lives in the first and the last stage (the runtime sums the two gradients);
- a *pure* node (computed from user inputs, buffers and constants only: positions, masks,
  rotary tables, reshaped labels) is recomputed in every stage that needs it rather than sent;
- every other value crossing a cut is an output of each stage between producer and consumer
  (a pass-through is a ``clone``, so no stage output aliases its input).

Requires: ``gm`` is a forward graph whose output is the scalar loss, with ``nn_module_stack``
metadata. Guarantees: composing the stages in order computes the same loss; stage ``s``'s
inputs are ``boundary`` values (stage ``s - 1``'s outputs, in order) followed by the user inputs it
reads (by flattened index); the last stage outputs the loss.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.fx as fx
import torch.nn as nn

__all__ = ["PRE", "POST", "StageGraph", "block_prefix", "layer_units", "node_stages", "set_module_attr",
           "split_stages"]

PRE = "pre"
POST = "post"
_WRAP = "model."


@dataclass(frozen=True)
class StageGraph:
    """One pipeline stage's forward program.

    ``gm`` takes ``(*boundary, *user inputs)`` and returns a tuple: the boundary values for the
    next stage, or ``(loss,)`` on the last stage. ``user_inputs`` are flattened input indices.
    """

    index: int
    gm: fx.GraphModule
    num_boundary: int
    user_inputs: tuple[int, ...]
    num_outputs: int
    is_last: bool
    params: tuple[str, ...]


def _paths(n: fx.Node) -> list[str]:
    stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack") or {}
    out = []
    for v in stack.values():
        p = v[0] if isinstance(v, tuple) else str(v)
        out.append(p[len(_WRAP):] if p.startswith(_WRAP) else ("" if p == "model" else p))
    return out


def block_prefix(param_names: Sequence[str]) -> str | None:
    """The module list holding most parameters under integer children (``blocks``, ``h``)."""
    counts: dict[str, int] = {}
    indices: dict[str, set[str]] = {}
    for name in param_names:
        parts = name.split(".")
        for i in range(len(parts) - 1):
            if parts[i].isdigit():
                prefix = ".".join(parts[:i])
                counts[prefix] = counts.get(prefix, 0) + 1
                indices.setdefault(prefix, set()).add(parts[i])
                break
    candidates = [(c, pfx) for pfx, c in counts.items() if len(indices[pfx]) >= 2]
    return max(candidates)[1] if candidates else None


def layer_units(nodes: Sequence[fx.Node], prefix: str | None,
                num_blocks: int) -> tuple[tuple[str, ...], dict[str, int]]:
    """The layer units (``pre``, ``<prefix>.0`` ..., ``post``) and the unit index of every
    ``call_function`` node.

    A node inside block ``i`` (by module path) is in unit ``i + 1``. Other nodes go by their
    top-level module (a module first used before the blocks is ``pre``, else ``post``) or, with no
    module, by position: in the forward, before the first block is ``pre`` and after it the unit
    of its latest input (glue between blocks, such as an activation applied by the parent); in
    the backward (``partitioner_tag == "is_backward"``), before the first block's gradient is
    ``post``, after it ``pre``.
    """
    units = (PRE, *(f"{prefix}.{i}" for i in range(num_blocks)), POST)
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)(\.|$)") if prefix else None
    block: dict[str, int] = {}
    for n in nodes:
        for p in _paths(n):
            m = pat.match(p) if pat else None
            if m:
                block[n.name] = int(m.group(1)) + 1
                break
    seen_block = {"fwd": False, "bwd": False}
    top_unit: dict[str, int] = {}
    out: dict[str, int] = {}
    for n in nodes:
        if n.op != "call_function":
            continue
        phase = "bwd" if n.meta.get("partitioner_tag") == "is_backward" else "fwd"
        if n.name in block:
            out[n.name] = block[n.name]
            seen_block[phase] = True
            continue
        after = seen_block[phase]
        positional = (len(units) - 1 if after else 0) if phase == "fwd" else (0 if after else len(units) - 1)
        tops = [p.split(".")[0] for p in _paths(n) if p]
        if tops and phase == "fwd":
            top_unit.setdefault(tops[0], positional)
        if not tops and after and phase == "fwd":  # glue between blocks: with its latest input
            positional = max((out[a.name] for a in n.all_input_nodes if a.name in out), default=positional)
        out[n.name] = top_unit.get(tops[0], positional) if tops else positional
    return units, out


def _pure_nodes(gm: fx.GraphModule) -> set[str]:
    """Nodes computed from user inputs, buffers and constants only (no parameter, no activation)."""
    pure: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            pure.add(n.name)
        elif n.op == "get_attr" and not isinstance(_get_attr(gm, n.target), nn.Parameter):
            pure.add(n.name)  # a buffer or constant (rotary tables): each stage has its copy
        elif n.op == "call_function" and all(a.name in pure for a in n.all_input_nodes):
            pure.add(n.name)
    return pure


def node_stages(gm: fx.GraphModule, unit_of: dict[str, int], stage_of_unit: Sequence[int]) -> dict[str, int]:
    """Stage of every non-pure ``call_function`` node: its unit's stage, never before an input's."""
    pure = _pure_nodes(gm)
    stage: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op != "call_function" or n.name in pure:
            continue
        s = stage_of_unit[unit_of[n.name]]
        for a in n.all_input_nodes:
            s = max(s, stage.get(a.name, 0))
        stage[n.name] = s
    return stage


def split_stages(gm: fx.GraphModule, stage_of: dict[str, int], num_stages: int) -> list[StageGraph]:
    """Cut ``gm`` into ``num_stages`` stage GraphModules (see module docstring)."""
    nodes = list(gm.graph.nodes)
    pure = _pure_nodes(gm)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    out_node = next(n for n in nodes if n.op == "output")
    loss = out_node.args[0][0] if isinstance(out_node.args[0], (tuple, list)) else out_node.args[0]
    last_use: dict[str, int] = {}
    for n in nodes:
        if n.op == "call_function" and n.name in stage_of:
            for a in n.all_input_nodes:
                if a.name in stage_of:
                    last_use[a.name] = max(last_use.get(a.name, -1), stage_of[n.name])
    last_use[loss.name] = num_stages  # the loss leaves the last stage
    empty = [s for s in range(num_stages) if s not in set(stage_of.values())]
    if empty:
        raise ValueError(f"stages {empty} hold no computation; every stage needs at least one op. "
                         f"Use fewer pipeline stages or cut elsewhere.")
    stages, carry = [], []
    for s in range(num_stages):
        carry_out = [n for n in nodes if n.name in stage_of and stage_of[n.name] <= s < last_use.get(n.name, -1)]
        stages.append(_build_stage(gm, s, num_stages, nodes, stage_of, pure, placeholders,
                                   carry, carry_out if s < num_stages - 1 else [loss]))
        carry = carry_out
    return stages


def _build_stage(gm: fx.GraphModule, s: int, num_stages: int, nodes: list[fx.Node],
                 stage_of: dict[str, int], pure: set[str], placeholders: list[fx.Node],
                 carry_in: list[fx.Node], outputs: list[fx.Node]) -> StageGraph:
    g = fx.Graph()
    env: dict[str, fx.Node] = {}
    for n in carry_in:
        env[n.name] = g.placeholder(n.name)
        env[n.name].meta = dict(n.meta)
    own = [n for n in nodes if stage_of.get(n.name) == s]
    needed = _pure_closure(own + outputs, pure, stage_of, s)
    used_inputs = [i for i, p in enumerate(placeholders) if p.name in needed]
    for i in used_inputs:
        p = placeholders[i]
        env[p.name] = g.placeholder(p.name)
        env[p.name].meta = dict(p.meta)
    root = nn.Module()
    params: list[str] = []
    for n in nodes:
        if n.op == "get_attr" and n.name in needed:
            set_module_attr(root, n.target, _get_attr(gm, n.target))
            env[n.name] = g.get_attr(n.target)
            env[n.name].meta = dict(n.meta)
            if isinstance(_get_attr(gm, n.target), nn.Parameter):
                params.append(n.target[len(_WRAP):] if n.target.startswith(_WRAP) else n.target)
        elif n.op == "call_function" and (stage_of.get(n.name) == s or (n.name in pure and n.name in needed)):
            env[n.name] = g.node_copy(n, lambda a: env[a.name])
    results = []
    for n in outputs:
        v = env[n.name]
        if n in carry_in:  # pass-through: a copy, so no output aliases an input
            v = g.call_function(torch.ops.aten.clone.default, (v,))
            v.meta = dict(n.meta)
        results.append(v)
    g.output(tuple(results))
    sgm = fx.GraphModule(root, g)
    return StageGraph(s, sgm, len(carry_in), tuple(used_inputs), len(results), s == num_stages - 1,
                      tuple(params))


def _pure_closure(roots: list[fx.Node], pure: set[str], stage_of: dict[str, int], s: int) -> set[str]:
    """Names of the pure nodes, placeholders and parameters that stage ``s``'s own nodes read."""
    needed: set[str] = set()
    stack = [a for n in roots if stage_of.get(n.name) == s for a in n.all_input_nodes]
    while stack:
        a = stack.pop()
        if a.name in needed or a.name in stage_of:
            continue
        needed.add(a.name)
        if a.name in pure or a.op == "get_attr":
            stack.extend(a.all_input_nodes)
    return needed


def _get_attr(gm: nn.Module, target: str) -> torch.Tensor:
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def set_module_attr(root: nn.Module, target: str, value: torch.Tensor | nn.Module) -> None:
    """Register ``value`` under the dotted ``target`` of ``root`` (creating empty modules on the
    way): a Parameter as a parameter, a module as a submodule, any other tensor as a buffer."""
    *path, leaf = target.split(".")
    mod = root
    for part in path:
        if not hasattr(mod, part):
            mod.add_module(part, nn.Module())
        mod = getattr(mod, part)
    if isinstance(value, nn.Parameter):
        mod.register_parameter(leaf, value)
    elif isinstance(value, nn.Module):  # the body of a higher-order op (autocast, no_grad regions)
        mod.add_module(leaf, value)
    else:
        mod.register_buffer(leaf, value)

