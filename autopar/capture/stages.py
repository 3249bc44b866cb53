"""Capture for pipeline parallelism: the forward graph, its layer units, and one joint graph per stage.

:func:`export_forward` exports the model once (at the microbatch's shape) and assigns every node
to a layer unit. :func:`capture_stages` cuts that graph at the plan's unit boundaries
(:func:`split_stages`, below) and traces each stage's forward+backward with AOTAutograd, keeping
the gradients of its boundary activations (they are sent to the previous stage).

Cutting the forward graph into stages (:func:`split_stages`).

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

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from autopar._torch_private import tree_flatten, tree_map_only

from autopar import _torch_private as private
from autopar.capture.joint import (
    LossModule, build_traced, export_program, first_line, split_mean_losses, strip_assertions,
    strip_input_grads,
    capture_with_export, model_device, model_is_fake, normalize_inputs, prepare_inputs, to_fake,
)
from autopar.errors import CaptureError
from autopar.graph import TracedGraph
from autopar.capture.layers import (
    WRAP, attribute, block_prefix, identical_blocks, layer_units, leading_blocks, set_module_attr,
    with_blocks,
)
from autopar.capture.joint_unroll import alike_run, short_stage, unroll_joint
from autopar.capture.unroll import attribute_refusal, unroll_blocks
from autopar.capture.stage_copies import copied_stage, stage_signature

__all__ = ["ForwardGraph", "StageGraph", "capture_stages", "capture_with_forward", "export_forward",
           "first_microbatch", "microbatch_inputs", "node_stages", "split_stages",
           "unflatten_inputs"]



@dataclass(frozen=True)
class ForwardGraph:
    """A model's exported forward graph with its layer units.

    ``canonical`` maps each parameter name used in the graph to the model's own name for that
    tensor (a tied LM head maps to the embedding it shares).
    """

    gm: fx.GraphModule
    units: tuple[str, ...]
    unit_of: dict[str, int] = field(repr=False)
    canonical: dict[str, str] = field(repr=False)
    fake_mode: Any = field(repr=False)
    in_spec: Any = field(repr=False)


def microbatch_inputs(example_inputs: Any, microbatches: int) -> tuple[list[Any], Any]:
    """Split every tensor input on dim 0 into ``microbatches`` equal chunks.

    Returns the flattened inputs of each microbatch and the pytree spec. Raises ``ValueError``
    when an input's batch dim does not divide.
    """
    args, kwargs = normalize_inputs(example_inputs)
    flat, spec = tree_flatten((args, kwargs))
    chunks: list[list[Any]] = [[] for _ in range(microbatches)]
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            _check_divides(i, x, microbatches)
            for j, c in enumerate(x.chunk(microbatches, dim=0)):
                chunks[j].append(c)
        else:
            for j in range(microbatches):
                chunks[j].append(x)
    return chunks, spec


def first_microbatch(example_inputs: Any, microbatches: int) -> Any:
    """The first of :func:`microbatch_inputs`' chunks, as the inputs are structured (without
    making the others: a global batch of thousands of samples has as many chunks at one sample
    each)."""
    args, kwargs = normalize_inputs(example_inputs)
    flat, _ = tree_flatten((args, kwargs))
    first = []
    for i, x in enumerate(flat):
        if isinstance(x, torch.Tensor):
            _check_divides(i, x, microbatches)
            x = x.narrow(0, 0, x.shape[0] // microbatches)
        first.append(x)
    return unflatten_inputs(example_inputs, first)


def unflatten_inputs(example_inputs: Any, flat: Sequence[Any]) -> Any:
    """One microbatch's flattened inputs (a chunk of :func:`microbatch_inputs`) in the form the
    model is called with: keyword inputs for a dict, positional ones for a tuple or list, the
    tensor itself for a single tensor."""
    if isinstance(example_inputs, dict):
        return dict(zip(example_inputs.keys(), flat))
    if not isinstance(example_inputs, (tuple, list)):
        return flat[0]
    return tuple(flat)


def _check_divides(i: int, x: torch.Tensor, microbatches: int) -> None:
    if x.dim() == 0 or x.shape[0] % microbatches:
        raise ValueError(
            f"input {i} has shape {tuple(x.shape)}: its batch dim (dim 0) must divide into "
            f"{microbatches} microbatches. Choose Config(microbatch_size=...) dividing the "
            f"batch, or a batch divisible by the microbatch count.")


def capture_with_forward(model: nn.Module, example_inputs: Any,
                         mixed_precision: str | None = None) -> tuple[TracedGraph, ForwardGraph]:
    """The joint graph (:func:`autopar.capture.capture`) and the forward graph with its layer
    units, from one export of the model. Under bf16 autocast (``mixed_precision="bf16"``) the
    joint graph is traced from the forward graph, exported in the model's dtype, as one
    pipeline stage (:func:`capture_stages`), so that its nodes keep their module paths (a
    whole-model capture exports the autocast region as one higher-order op, whose body loses
    them); the casts are autocast's either way."""
    if mixed_precision != "bf16":
        traced, ep = capture_with_export(model, example_inputs, mixed_precision)
        return traced, export_forward(model, example_inputs, ep)
    fwd = export_forward(model, example_inputs)
    chunks, _ = microbatch_inputs(example_inputs, 1)
    [(_, traced)] = capture_stages(fwd, (0,) * len(fwd.units), chunks[0], torch.bfloat16)
    return traced, fwd


def export_forward(model: nn.Module, example_inputs: Any, ep: Any = None,
                   unroll: bool | None = None) -> ForwardGraph:
    """Export ``model`` (wrapped to return its loss) on ``example_inputs``; find its layer units.

    ``ep``: an export of the wrapped model on these inputs, if one was already made.
    ``unroll``: export a copy with the model's leading blocks and two of its repeated ones and
    copy the last for the others (:mod:`autopar.capture.unroll`), where the blocks allow it; by
    default for a model that is never run (built under ``FakeTensorMode``) only.
    """
    args, kwargs, fake_mode = prepare_inputs(model, example_inputs)
    if unroll is None:
        unroll = ep is None and model_is_fake(model)
    gm = _unrolled(model, args, kwargs, fake_mode) if unroll else None
    if gm is None:
        if ep is None:
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                ep = export_program(LossModule(model), args, kwargs)
        gm = _module(ep)
    names = [n.target[len(WRAP):] for n in gm.graph.nodes if n.op == "get_attr"]
    prefix = block_prefix(names)
    blocks = len({n.split(".")[len(prefix.split("."))] for n in names
                  if prefix and n.startswith(prefix + ".")})
    units, unit_of = layer_units(list(gm.graph.nodes), prefix, blocks)
    owner: dict[int, str] = {}
    canonical: dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        canonical[name] = owner.setdefault(id(p), name)
    _, spec = tree_flatten((args, kwargs))
    return ForwardGraph(gm, units, unit_of, canonical, fake_mode, spec)


def _module(ep: Any) -> fx.GraphModule:
    """The unlifted module of an export, without its input guard and assertions."""
    gm = ep.module()
    for n in list(gm.graph.nodes):
        if n.op == "call_module" and not n.users:  # export's input guard
            gm.graph.erase_node(n)
    strip_assertions(gm)
    return gm


def _unrolled(model: nn.Module, args: tuple, kwargs: dict, fake_mode: Any) -> fx.GraphModule | None:
    """The forward graph of ``model`` from a short copy's export (:mod:`autopar.capture.
    unroll`), or ``None`` when its blocks do not allow it or the copy does not export (a model
    that indexes its blocks by count, say): the whole model is exported then, and a real error
    is raised there."""
    prefix, total, _ = identical_blocks(model)
    lead = leading_blocks(model)
    if prefix is None or lead < 0 or total <= lead + 2:
        return None
    blocks = list(model.get_submodule(prefix))
    if attribute_refusal(blocks, lead) is not None:
        return None
    short = with_blocks(model, prefix, blocks[:lead + 2])
    try:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            gm = _module(export_program(LossModule(short), args, kwargs))
    except CaptureError:
        return None
    return None if unroll_blocks(gm, model, prefix, lead, total) else gm


def capture_stages(fwd: ForwardGraph, stage_of_unit: Sequence[int], mb_inputs: Sequence[Any],
                   autocast: torch.dtype | None = None, copy_identical: bool | None = None,
                   ) -> list[tuple[StageGraph, TracedGraph]]:
    """Split ``fwd`` by ``stage_of_unit`` and trace every stage's joint graph.

    ``mb_inputs`` are one microbatch's flattened inputs (as the graph was exported for). The
    boundary activations are produced by running the stages in order on them (under the fake
    mode of ``fwd`` if it has one, the inputs made fake in it by :func:`autopar.capture.to_fake`).
    ``autocast``: trace each stage under ``torch.autocast`` of that dtype, as
    :func:`autopar.capture.capture` traces a whole model (the forward graph is exported in
    fp32; its aten ops meet autocast when each stage is traced, so the casts are in the stage's
    joint graph, fp32 parameters stay the master weights and gradients leave in fp32). A
    boundary value crosses in the dtype its stage computed it in. ``copy_identical``: a stage
    whose forward program is an earlier one's (:func:`~autopar.capture.stage_copies.
    stage_signature`) takes that stage's joint graph, renamed (:func:`~autopar.capture.
    stage_copies.copied_stage`), instead of being traced; by default only for a model that is
    never run (built under ``FakeTensorMode``), as the copies share one graph module.
    """
    num_stages = max(stage_of_unit) + 1
    stage_of = node_stages(fwd.gm, fwd.unit_of, stage_of_unit)
    stages = split_stages(fwd.gm, stage_of, num_stages)
    ctx = fwd.fake_mode if fwd.fake_mode is not None else contextlib.nullcontext()
    out: list[tuple[StageGraph, TracedGraph]] = []
    flat = list(mb_inputs)
    if fwd.fake_mode is not None:
        flat = to_fake(flat, fwd.fake_mode, model_device(fwd.gm))
    is_fake = model_is_fake(fwd.gm)
    copy_identical = is_fake if copy_identical is None else copy_identical
    prefix = fwd.units[1].rsplit(".", 1)[0] if len(fwd.units) > 2 else None
    boundary: list[torch.Tensor] = []
    device = model_device(fwd.gm).type
    cast = (lambda: torch.autocast(device, dtype=autocast)) if autocast is not None \
        else contextlib.nullcontext  # noqa: E731
    # a model that is never run traces each distinct stage once (autopar.capture.stage_copies)
    seen: dict[str, tuple[StageGraph, TracedGraph, list]] = {}
    for st in stages:
        args = tuple(boundary) + tuple(flat[i] for i in st.user_inputs)
        sig = stage_signature(st.gm, st, args) if copy_identical else None
        copy = copied_stage(seen[sig][1], seen[sig][0].gm, st.gm, prefix) \
            if sig in seen else None
        if copy is not None:  # the same program: its outputs have the earlier stage's shapes
            out.append((st, copy))
            boundary = seen[sig][2]
            continue
        traced, outs = _trace_stage(st, args, fwd, ctx, cast, is_fake, prefix)
        out.append((st, traced))
        boundary = [tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(True), o) for o in outs]
        if sig is not None:
            seen.setdefault(sig, (st, traced, boundary))
    return out


def _trace_stage(st: StageGraph, args: tuple, fwd: ForwardGraph, ctx: Any, cast: Any,
                 is_fake: bool, prefix: str | None) -> tuple[TracedGraph, Any]:
    """One stage's joint trace and its forward outputs on ``args``: for a model that is never
    run, from the trace of a short copy of the stage where its blocks allow it
    (:mod:`autopar.capture.joint_unroll`), else of the whole stage."""
    start = time.perf_counter()
    run = alike_run(st, fwd.unit_of, prefix) if is_fake and prefix else []
    short = short_stage(st, fwd.unit_of, run, prefix) if run else None
    joint = None
    if short is not None:
        try:
            gm, outs = _joint(short, args, ctx, cast)
        except CaptureError:  # (the whole stage is traced: a real error is raised there)
            gm = None
        unrolled = unroll_joint(gm, st, prefix, run) if gm is not None else None
        # (a refusal, a string: the blocks differ where the check can see it)
        joint = None if unrolled is None or isinstance(unrolled, str) else (unrolled, outs)
    gm, outs = joint if joint is not None else _joint(st, args, ctx, cast)
    # a stage of one block cannot show which module list repeats: the model's tells it
    traced = build_traced(gm, st.gm, fwd.in_spec, is_fake, time.perf_counter() - start,
                          stage=st, prefix=prefix)
    return traced, outs


def _joint(st: StageGraph, args: tuple, ctx: Any, cast: Any) -> tuple[fx.GraphModule, Any]:
    """The joint graph of ``st``'s program on ``args`` (user inputs' gradients and assertions
    left out, mean losses split) and its forward outputs."""
    with ctx, contextlib.ExitStack() as stack:
        stack.enter_context(cast())
        try:
            joint = private.export_joint(st.gm, args, stack)
        except Exception as e:
            raise CaptureError(f"tracing pipeline stage {st.index} failed: {first_line(e)}") from e
    with ctx, torch.no_grad(), cast():
        outs = st.gm(*args)
    gm = joint.graph_module
    strip_input_grads(gm, keep=st.num_boundary)
    strip_assertions(gm)
    split_mean_losses(gm)
    return gm, outs


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


def _pure_nodes(gm: fx.GraphModule) -> set[str]:
    """Nodes computed from user inputs, buffers and constants only (no parameter, no activation)."""
    pure: set[str] = set()
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            pure.add(n.name)
        elif n.op == "get_attr" and not isinstance(attribute(gm, n.target), nn.Parameter):
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
            set_module_attr(root, n.target, attribute(gm, n.target))
            env[n.name] = g.get_attr(n.target)
            env[n.name].meta = dict(n.meta)
            if isinstance(attribute(gm, n.target), nn.Parameter):
                params.append(n.target[len(WRAP):] if n.target.startswith(WRAP) else n.target)
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
