"""Module paths, repeated blocks, layer units and node phases of a traced graph (one copy each).

A *layer unit* is what a pipeline stage is cut from: the code before the repeated blocks
(``pre``: embeddings), each block (``blocks.0`` ...), and the code after them (``post``: final
norm, LM head, loss). The repeated blocks are the module list holding most parameters under
integer children (``blocks``, ``h``, ``layers``). Graph nodes carry the module stack they ran in
(``nn_module_stack``; backward nodes ``fwd_nn_module_stack``), from which their module path,
block and unit follow; ``partitioner_tag`` tells the backward from the forward.
"""

from __future__ import annotations

import copy
import re
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from autopar._torch_private import OpOverload

__all__ = ["PRE", "POST", "WRAP", "aten_ops", "attribute", "block_fingerprint", "block_prefix", "identical_blocks", "leading_blocks",
           "is_backward", "is_op", "layer_units", "module_paths", "node_phase", "set_module_attr",
           "with_blocks"]

PRE = "pre"
POST = "post"
WRAP = "model."  # the loss wrapper's attribute holding the user's model


def module_paths(n: fx.Node, keep_root: bool = False) -> list[str]:
    """The module paths of ``n``'s module stack, outermost first, relative to the user's model
    (``blocks.0.attn``); the model itself is ``""`` (``"model"`` with ``keep_root``)."""
    stack = n.meta.get("nn_module_stack") or n.meta.get("fwd_nn_module_stack") or {}
    out = []
    for v in stack.values():
        p = v[0] if isinstance(v, tuple) else str(v)
        if p.startswith(WRAP):
            out.append(p[len(WRAP):])
        else:
            out.append(p if keep_root or p != "model" else "")
    return out


def is_backward(n: fx.Node) -> bool:
    """Whether ``n`` is in the backward part of a joint graph."""
    return n.meta.get("partitioner_tag") == "is_backward"


def node_phase(n: fx.Node) -> str:
    """``"backward"`` or ``"forward"``."""
    return "backward" if is_backward(n) else "forward"


def aten_ops(*names: str) -> frozenset:
    """The aten op packets (``torch.ops.aten.<name>``, every overload) of ``names`` that this
    torch release has: the keys :func:`is_op` matches a node's op against."""
    return frozenset(getattr(torch.ops.aten, n) for n in names if hasattr(torch.ops.aten, n))


def is_op(n: fx.Node, ops: frozenset) -> bool:
    """Whether ``n`` calls one of ``ops``: aten op packets (:func:`aten_ops`; any overload
    matches), op overloads, or Python callables such as ``operator.getitem``."""
    if n.op != "call_function":
        return False
    target = n.target
    return target in ops or (isinstance(target, OpOverload) and target.overloadpacket in ops)


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



def block_fingerprint(block: nn.Module) -> tuple:
    """What makes two blocks cost the same: their structure (``repr`` shows every submodule and
    its sizes) and the shapes and dtypes of their parameters and buffers."""
    tensors = tuple((n, tuple(t.shape), str(t.dtype))
                    for n, t in (*block.named_parameters(), *block.named_buffers()))
    return (repr(block), tensors)


def identical_blocks(model: nn.Module) -> tuple[str | None, int, int]:
    """``(prefix, blocks, kinds)``: the repeated blocks' module list (``None`` if the model has
    none), how many blocks it holds and how many distinct :func:`block_fingerprint` they have."""
    prefix = block_prefix([n for n, _ in model.named_parameters(remove_duplicate=False)])
    if prefix is None:
        return None, 0, 0
    blocks = model.get_submodule(prefix)
    children = list(blocks) if isinstance(blocks, (nn.ModuleList, nn.Sequential)) else []
    return prefix, len(children), len({block_fingerprint(b) for b in children})


def leading_blocks(model: nn.Module) -> int:
    """How many blocks at the front of the list come before the run of identical blocks that
    ends it: 0 when all are alike, the leading ones' count otherwise (such as DeepSeek-V3's
    dense first layers before its MoE layers; they may differ among themselves), -1 when that
    final run is shorter than two blocks."""
    prefix = block_prefix([n for n, _ in model.named_parameters(remove_duplicate=False)])
    if prefix is None:
        return -1
    blocks = model.get_submodule(prefix)
    prints = [block_fingerprint(b) for b in blocks] if isinstance(
        blocks, (nn.ModuleList, nn.Sequential)) else []
    if not prints:
        return -1
    lead = len(prints)
    while lead > 0 and prints[lead - 1] == prints[-1]:
        lead -= 1
    return lead if len(prints) - lead >= 2 else -1


def layer_units(nodes: Sequence[fx.Node], prefix: str | None,
                num_blocks: int) -> tuple[tuple[str, ...], dict[str, int]]:
    """The layer units (``pre``, ``<prefix>.0`` ..., ``post``) and the unit index of every
    ``call_function`` node.

    A node inside block ``i`` (by module path) is in unit ``i + 1``. Other nodes go by their
    top-level module (a module first used before the blocks is ``pre``, else ``post``) or, with no
    module, by position: in the forward, before the first block is ``pre`` and after it the unit
    of its latest input (glue between blocks, such as an activation applied by the parent); in
    the backward (``partitioner_tag == "is_backward"``), before the first block's gradient is
    ``post``, after it the earliest block among its inputs' units, else ``pre``.
    """
    units = (PRE, *(f"{prefix}.{i}" for i in range(num_blocks)), POST)
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)(\.|$)") if prefix else None
    block: dict[str, int] = {}
    for n in nodes:
        for p in module_paths(n):
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
        tops = [p.split(".")[0] for p in module_paths(n) if p]
        if tops and phase == "fwd":
            top_unit.setdefault(tops[0], positional)
        if not tops and after and phase == "fwd":  # glue between blocks: with its latest input
            positional = max((out[a.name] for a in n.all_input_nodes if a.name in out), default=positional)
        if not tops and after and phase == "bwd":  # (e.g. the backward of a write into a
            # preallocated tensor, DeepSeek-V3's keys): with the earliest block among its
            # inputs', if any (a gradient summed over the blocks: one add in each block)
            positional = min((out[a.name] for a in n.all_input_nodes
                              if 0 < out.get(a.name, 0) < len(units) - 1), default=positional)
        out[n.name] = top_unit.get(tops[0], positional) if tops else positional
    return units, out


def attribute(module: Any, target: str) -> Any:
    """The attribute at the dotted ``target`` of ``module`` (what a ``get_attr`` node reads)."""
    obj = module
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


def with_blocks(model: nn.Module, prefix: str, blocks: Sequence[nn.Module]) -> nn.Module:
    """A shallow copy of ``model`` whose module list at ``prefix`` holds ``blocks`` (the
    modules themselves, weights shared, not copied); ``model`` is left as it was."""
    parts = prefix.split(".")
    root = _shallow(model)
    parent = root
    for name in parts[:-1]:
        child = _shallow(parent._modules[name])
        parent._modules[name] = child
        parent = child
    held = copy.copy(parent._modules[parts[-1]])  # (the same kind of list: a Sequential runs)
    held._modules = {str(i): b for i, b in enumerate(blocks)}
    parent._modules[parts[-1]] = held
    return root


def _shallow(module: nn.Module) -> nn.Module:
    out = copy.copy(module)
    out._modules = dict(module._modules)  # so replacing a child leaves the original intact
    return out
