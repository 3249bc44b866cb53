"""Capture: an unmodified ``nn.Module`` and example inputs -> :class:`TracedGraph`.

``torch.export.export`` (non-strict) gives an aten-level forward graph; AOTAutograd's
``aot_export_joint_with_descriptors`` turns it into one joint forward+backward graph whose
placeholders and outputs carry descriptors (parameter, user input, tangent; loss, gradient).
Models built under ``FakeTensorMode`` are traced without allocating a single weight. A model on
the meta device is refused: under it cross-entropy silently loses its backward. Example inputs
may be real, fake (of any mode) or meta: :func:`to_fake` re-creates them from their metadata in
the mode the trace runs in, so no input value ever reaches a graph.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import operator
import os
import re
import time
import traceback
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from autopar._torch_private import tree_flatten, tree_map_only

from autopar import _torch_private as private
from autopar._torch_private import FakeTensor, FakeTensorMode
from autopar.errors import CaptureError, InputMismatchError
from autopar.capture.experts import static_expert_blocks
from autopar.capture.layers import aten_ops, block_prefix, is_op, module_paths
from autopar.graph import InputInfo, Layer, ParamInfo, TracedGraph

__all__ = ["LossModule", "build_traced", "capture", "capture_with_export", "export_program",
           "extract_loss", "first_line", "model_device", "model_fingerprint", "model_is_fake",
           "node_layers", "normalize_inputs", "prepare_inputs", "split_mean_losses", "strip_assertions",
           "strip_input_grads", "to_fake"]

_WRAP = "model."


def normalize_inputs(example_inputs: Any) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Split example inputs into ``(args, kwargs)``: a tuple/list is positional, a dict keywords."""
    if example_inputs is None:
        raise InputMismatchError(
            "example_inputs is required to plan: pass a tuple of positional inputs (or a dict of "
            "keyword inputs) shaped like one training batch."
        )
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    if isinstance(example_inputs, (tuple, list)):
        return tuple(example_inputs), {}
    raise InputMismatchError(
        f"example_inputs of type {type(example_inputs).__name__}: give a tuple of positional "
        f"inputs or a dict of keyword inputs."
    )


def extract_loss(out: Any) -> torch.Tensor:
    """The scalar loss a model returned: a tensor, an object with ``.loss``, or a tuple's first."""
    if isinstance(out, torch.Tensor):
        loss = out
    elif hasattr(out, "loss") and isinstance(getattr(out, "loss"), torch.Tensor):
        loss = out.loss
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        loss = out[0]
    else:
        raise CaptureError(
            f"the model returned {type(out).__name__}; autopar trains on a scalar loss: return it "
            f"as a tensor, as `.loss` (Hugging Face: pass labels), or as the first tuple element."
        )
    if loss.dim() != 0:
        raise CaptureError(
            f"the model's loss has shape {tuple(loss.shape)}; a scalar is required (reduce it "
            f"with .mean() or .sum() inside the model)."
        )
    return loss


_OUTPUT_TYPES: dict[str, type | None] = {}


class LossModule(nn.Module):
    """Wraps the user's model so the traced function returns the scalar loss."""

    def __init__(self, model: nn.Module, autocast: torch.dtype | None = None) -> None:
        super().__init__()
        self.model = model
        self.autocast = autocast
        # export traces a copy of the module: record through a key the copy shares
        self.token = f"{id(self)}-{time.perf_counter_ns()}"

    def take_output_type(self) -> type | None:
        """Type of what the model returned when traced (``None`` for a bare tensor)."""
        return _OUTPUT_TYPES.pop(self.token, None)

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.autocast is None:
            out = self.model(*args, **kwargs)
        else:
            with torch.autocast(_device_type(self.model), dtype=self.autocast):
                out = self.model(*args, **kwargs)
        _OUTPUT_TYPES[self.token] = None if isinstance(out, torch.Tensor) else type(out)
        return extract_loss(out)


def _device_type(model: nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


_PRECISION = {None: None, "fp32": None, "bf16": torch.bfloat16}


def capture(model: nn.Module, example_inputs: Any, mixed_precision: str | None = None) -> TracedGraph:
    """Trace ``model`` on ``example_inputs`` into a joint forward+backward :class:`TracedGraph`.

    Requires: the model returns a scalar loss (see :func:`extract_loss`) and has no data-dependent
    control flow. If its parameters are fake tensors, nothing is materialised. Inputs may be
    real, fake (of any mode) or meta tensors: only their shapes and dtypes are read (see
    :func:`prepare_inputs`), never their values. Raises :class:`CaptureError` naming the module
    and source line on failure.
    ``mixed_precision="bf16"`` traces the model under ``torch.autocast`` (bf16): matmuls compute
    in bf16 from casts of the fp32 parameters, which stay the master weights, and every gradient
    leaves the graph in fp32 (so it is reduced in fp32).
    """
    return capture_with_export(model, example_inputs, mixed_precision)[0]


def capture_with_export(model: nn.Module, example_inputs: Any,
                        mixed_precision: str | None = None) -> tuple[TracedGraph, Any]:
    """:func:`capture`, also returning ``torch.export``'s program of the loss wrapper (the
    forward graph that pipeline stages are cut from), so the model is exported once."""
    start = time.perf_counter()
    args, kwargs, fake_mode = prepare_inputs(model, example_inputs)
    if mixed_precision not in _PRECISION:
        raise ValueError(f"mixed_precision={mixed_precision!r}: use 'fp32', 'bf16' or None.")
    wrapper = LossModule(model, _PRECISION[mixed_precision])
    ctx = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with ctx, contextlib.ExitStack() as stack:
        ep = export_program(wrapper, args, kwargs)
        flat_args, in_spec = tree_flatten((args, kwargs))
        try:
            joint = private.export_joint(ep.module(), args, stack, kwargs or None)
        except Exception as e:
            raise CaptureError(
                f"tracing the backward of {type(model).__name__} failed: {first_line(e)}"
                f"{_user_frame(e)}"
            ) from e
    gm = joint.graph_module
    strip_input_grads(gm)
    strip_assertions(gm)
    split_mean_losses(gm)
    return build_traced(gm, wrapper, in_spec, model_is_fake(model), time.perf_counter() - start), ep


def prepare_inputs(model: nn.Module, example_inputs: Any) -> tuple[tuple, dict, FakeTensorMode | None]:
    """``(args, kwargs, fake_mode)`` to trace ``model`` with: inputs checked against its
    signature, the meta device refused for parameters, and inputs brought into one fake mode.

    Example inputs may be real, fake (of any ``FakeTensorMode``) or meta tensors: only their
    shapes, strides, dtypes and ``requires_grad`` are used (see :func:`to_fake`). A fake model's
    inputs are made fake in the model's own mode; a real model's real inputs are passed as they
    are (export reads no values from them); a real model given any fake or meta input traces in a
    fresh mode that this returns. ``fake_mode`` is ``None`` only when nothing is fake.
    """
    args, kwargs = normalize_inputs(example_inputs)
    _check_signature(model, args, kwargs)
    _refuse_meta(model)
    fake_mode = _fake_mode_of(model)
    if fake_mode is None and any(isinstance(t, FakeTensor) or t.device.type == "meta"
                                 for t in tree_flatten((args, kwargs))[0]
                                 if isinstance(t, torch.Tensor)):
        # the real parameters are read into the mode when the trace touches them
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    if fake_mode is not None:
        args, kwargs = to_fake((args, kwargs), fake_mode, model_device(model))
    return args, kwargs, fake_mode


def model_is_fake(model: nn.Module) -> bool:
    """Whether ``model``'s parameters are fake tensors (it is traced without materialising)."""
    return _fake_mode_of(model) is not None


def model_device(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter (or buffer); CPU when it has none."""
    for t in (*module.parameters(), *module.buffers()):
        return t.device
    return torch.device("cpu")


def _check_signature(model: nn.Module, args: tuple, kwargs: dict) -> None:
    try:
        inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as e:
        raise InputMismatchError(
            f"example inputs do not match {type(model).__name__}.forward"
            f"{inspect.signature(model.forward)}: {e}. Pass example_inputs exactly as you would "
            f"call the model (a tuple of positional inputs, or a dict of keyword inputs)."
        ) from e


def _refuse_meta(model: nn.Module) -> None:
    for name, p in model.named_parameters():
        if p.device.type == "meta":
            raise CaptureError(
                f"parameter {name!r} is on the meta device, under which the backward of "
                f"cross-entropy is silently lost. Build the model under "
                f"torch._subclasses.fake_tensor.FakeTensorMode() instead to plan without memory."
            )


def _fake_mode_of(model: nn.Module) -> FakeTensorMode | None:
    modes = {id(p.fake_mode): p.fake_mode for p in model.parameters() if isinstance(p, FakeTensor)}
    if len(modes) > 1:
        raise CaptureError("the model's parameters come from several FakeTensorModes; use one.")
    if modes and any(not isinstance(p, FakeTensor) for p in model.parameters()):
        raise CaptureError("the model mixes fake and real parameters; build it wholly in one mode.")
    return next(iter(modes.values()), None)


def to_fake(tree: Any, mode: FakeTensorMode, device: torch.device | str = "cpu") -> Any:
    """Every tensor in ``tree`` as a fake tensor of ``mode``, made from its metadata only.

    A tensor already of ``mode`` is kept. Any other (real, fake of another mode, meta) is
    re-created from its shape, strides, dtype and ``requires_grad``: no value is carried, so
    a trace can never depend on one. Its device is kept, except that a meta tensor is placed
    on ``device`` (the model's). One tensor given twice becomes one fake tensor given twice.
    Non-tensor leaves are returned as they are. Raises :class:`InputMismatchError` for a tensor
    subclass or a tensor with symbolic sizes.
    """
    made: dict[int, torch.Tensor] = {}

    def conv(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, FakeTensor) and t.fake_mode is mode:
            return t
        if id(t) not in made:
            made[id(t)] = _empty_like_in(t, mode, device)
        return made[id(t)]

    return tree_map_only(torch.Tensor, conv, tree)


def _empty_like_in(t: torch.Tensor, mode: FakeTensorMode,
                   device: torch.device | str) -> torch.Tensor:
    if type(t) not in (torch.Tensor, nn.Parameter, FakeTensor):
        raise InputMismatchError(
            f"an example input is a {type(t).__name__} of shape {tuple(t.shape)}; autopar plans "
            f"from plain tensors (real, fake or meta): pass a torch.Tensor of the same shape and "
            f"dtype instead.")
    try:
        shape, stride = [int(s) for s in t.shape], [int(s) for s in t.stride()]
    except Exception as e:
        raise InputMismatchError(
            f"an example input has symbolic sizes {tuple(t.shape)}; autopar plans for concrete "
            f"shapes: pass a tensor with integer sizes (one training batch).") from e
    where = device if t.device.type == "meta" else t.device
    with mode:
        return torch.empty_strided(shape, stride, dtype=t.dtype, device=where,
                                   requires_grad=t.requires_grad)


def export_program(wrapper: nn.Module, args: tuple, kwargs: dict) -> Any:
    """``torch.export`` (non-strict) of ``wrapper``, the expert blocks that depend on the data
    in their static form (:mod:`autopar.capture.experts`); a failure is a :class:`CaptureError`
    naming the model's line."""
    try:
        with static_expert_blocks(wrapper):
            return torch.export.export(wrapper, args, kwargs, strict=False)
    except Exception as e:
        name, msg = type(wrapper.model).__name__, str(e)
        dependent = ("data-dependent" in msg or "data dependent" in msg
                     or "GuardOnDataDependent" in msg)
        if not dependent and (_raised_by_user_code(e) or type(e) in _PLAIN_ERRORS):
            # (the model's own error, or an op's on these shapes: not a limit of the tracer,
            # whose refusals are torch's own exception classes)
            raise CaptureError(
                f"could not trace {name}: {type(e).__name__}{_user_frame(e)} when run on the "
                f"example inputs as fake tensors (shapes and dtypes, no values). Check that "
                f"the model runs on these inputs without autopar and reads no tensor's values "
                f"(.item(), .tolist(), .numpy()). Cause: {first_line(e)}") from e
        kind = "data-dependent control flow" if dependent else (
            "a construct torch.export cannot trace")
        raise CaptureError(
            f"could not trace {name}: {kind}{_user_frame(e)}. "
            f"autopar needs one whole graph: replace Python branches on tensor values with "
            f"torch.where / torch.cond, and keep shapes independent of data. Cause: "
            f"{first_line(e)}"
        ) from e


# exceptions of these exact classes come from the model's code or an operator's checks;
# torch's tracer refuses with its own subclasses
_PLAIN_ERRORS = (RuntimeError, ValueError, TypeError, IndexError, KeyError, AssertionError)


def _library_file(filename: str) -> bool:
    """Whether ``filename`` is torch's or autopar's capture code (not the model's)."""
    return filename.startswith((os.path.dirname(torch.__file__), os.path.dirname(__file__)))


def _raised_by_user_code(e: BaseException) -> bool:
    """Whether the innermost frame of ``e``'s traceback, where it was raised, is the model's
    (:func:`_library_file`): its own ``raise``, not a refusal of the tracer."""
    frames = traceback.extract_tb(e.__traceback__)
    return bool(frames) and not _library_file(frames[-1].filename)


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _user_frame(e: BaseException) -> str:
    """`` at file:line (code)`` of the innermost frame outside torch, if any."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not _library_file(f.filename)]
    if not frames:
        m = re.search(r'File "([^"]+)", line (\d+)', str(e))
        return f" at {m.group(1)}:{m.group(2)}" if m else ""
    f = frames[-1]
    return f" at {f.filename}:{f.lineno} in {f.name} ({(f.line or '').strip()})"


_ASSERTIONS = aten_ops("_assert_tensor_metadata", "_assert_scalar", "_assert_async",
                       "sym_constrain_range", "sym_constrain_range_for_size",
                       "_functional_assert_async")


def strip_assertions(gm: fx.GraphModule) -> None:
    """Drop export's metadata assertions (no outputs, no effect on numbers, no sharding rule)."""
    for n in list(gm.graph.nodes):
        if is_op(n, _ASSERTIONS) and not n.users:
            gm.graph.erase_node(n)
    gm.recompile()


# nll_loss's reduction argument: torch.nn._reduction (0 none, 1 mean, 2 sum)
_MEAN, _SUM = 1, 2
_NLL_LOSSES = aten_ops("nll_loss_forward", "nll_loss2d_forward")


def split_mean_losses(gm: fx.GraphModule) -> None:
    """Write each mean-reduced ``nll_loss_forward`` (cross-entropy) as its sum over the
    targets divided by their total weight, the same number, so that a sharded loss is exact.

    Sharded over the tokens, a mean loss would be the average of the shards' means (DTensor's
    rule for it is ``Partial("avg")``), which differs from the mean over all tokens when the
    shards hold different numbers of counted targets: Hugging Face's causal LM loss ignores the
    last position of each sequence (label -100), so the shards of a sequence split over tp
    held 4 and 3 counted tokens, and the forward loss was off by 3e-4 while every gradient
    (from ``nll_loss_backward``, which reads the total weight) was right. As a sum and a total
    weight, both ``Partial("sum")``, the division needs both reduced first: exact. The backward
    is unchanged (it reads the total weight the sum-reduced op returns, the same value)."""
    for n in list(gm.graph.nodes):
        if not is_op(n, _NLL_LOSSES) or len(n.args) < 4 or n.args[3] != _MEAN:
            continue
        loss = [u for u in n.users if u.target is operator.getitem and u.args[1] == 0]
        weight = [u for u in n.users if u.target is operator.getitem and u.args[1] == 1]
        with gm.graph.inserting_after(n):
            summed = gm.graph.call_function(n.target, (*n.args[:3], _SUM, *n.args[4:]), n.kwargs)
        summed.meta = dict(n.meta)
        with gm.graph.inserting_after(summed):
            total = gm.graph.call_function(operator.getitem, (summed, 0))
        with gm.graph.inserting_after(total):
            count = gm.graph.call_function(operator.getitem, (summed, 1))
        with gm.graph.inserting_after(count):
            mean = gm.graph.call_function(torch.ops.aten.div.Tensor, (total, count))
        for new, old in ((total, loss), (mean, loss), (count, weight)):
            if old:
                new.meta = dict(old[0].meta)
        for old in loss:
            old.replace_all_uses_with(mean)
        for old in weight:
            old.replace_all_uses_with(count)
        for old in loss + weight + [n]:
            gm.graph.erase_node(old)
    gm.recompile()


def strip_input_grads(gm: fx.GraphModule, keep: int = 0) -> None:
    """Replace gradients of user inputs (never wanted) by ``None`` outputs, then clean up.

    The first ``keep`` inputs (a pipeline stage's boundary activations) keep their gradients.
    """
    out = next(n for n in gm.graph.nodes if n.op == "output")
    descs = out.meta.get("desc") or []
    vals = list(out.args[0])
    changed = False
    for i, d in enumerate(descs):
        if type(d).__name__ == "GradAOTOutput" and type(d.grad_of).__name__ == "PlainAOTInput" \
                and d.grad_of.idx >= keep:
            if vals[i] is not None:
                vals[i] = None
                changed = True
    if changed:
        out.args = (tuple(vals),)
        gm.graph.eliminate_dead_code()
        gm.recompile()


def build_traced(
    gm: fx.GraphModule, wrapper: nn.Module, in_spec: Any, is_fake: bool, elapsed: float,
    stage: Any = None, prefix: str | None = None,
) -> TracedGraph:
    """Read descriptors off the joint graph into a :class:`TracedGraph`.

    ``stage`` (a :class:`autopar.capture.stages.StageGraph`) marks a pipeline stage: its first
    ``num_boundary`` inputs are activations, and unless it is the last its outputs are too.
    ``prefix``: the module list of the repeated blocks, when known (a stage holding one block
    cannot show it); else found from the parameter names (:func:`block_prefix`).
    """
    nb = stage.num_boundary if stage is not None else 0
    has_loss = stage is None or stage.is_last
    owner: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in wrapper.named_parameters(remove_duplicate=False):
        short = name[len(_WRAP):] if name.startswith(_WRAP) else name
        if id(p) in owner:
            tied[short] = owner[id(p)]
        else:
            owner[id(p)] = short
    out = next(n for n in gm.graph.nodes if n.op == "output")
    out_descs = out.meta.get("desc") or []
    grad_index: dict[str, int] = {}
    input_grad: dict[int, int] = {}
    forward_outs: list[int] = []
    for i, d in enumerate(out_descs):
        kind = type(d).__name__
        if kind == "GradAOTOutput" and type(d.grad_of).__name__ == "ParamAOTInput":
            grad_index[_short(d.grad_of.target)] = i
        elif kind == "GradAOTOutput" and type(d.grad_of).__name__ == "PlainAOTInput":
            input_grad[d.grad_of.idx] = i
        elif kind == "PlainAOTOutput":
            forward_outs.append(i)
    loss_index = forward_outs[0] if has_loss and forward_outs else None
    if has_loss and loss_index is None:
        raise CaptureError("the traced graph has no loss output; the model must return a loss.")
    params, inputs, tangents, buffers, boundary = _placeholders(gm, grad_index, tied, stage)
    if len(input_grad) != len(boundary):
        raise CaptureError(f"pipeline stage {stage.index}: gradients of {len(input_grad)} of its "
                           f"{len(boundary)} boundary activations were traced; each must require grad.")
    node_layer, layers = node_layers(gm, params, prefix)
    return TracedGraph(
        gm=gm, params=tuple(params), inputs=tuple(inputs), buffers=tuple(buffers),
        tangent_nodes=tuple(tangents),
        loss_output_index=loss_index, num_outputs=len(out_descs), layers=layers,
        node_layer=node_layer, is_fake=is_fake, input_spec=in_spec, capture_time_s=elapsed,
        output_type=wrapper.take_output_type() if hasattr(wrapper, "take_output_type") else None,
        boundary_inputs=tuple(boundary),
        boundary_outputs=tuple(forward_outs) if not has_loss else (),
        boundary_tangents=tuple(tangents) if not has_loss else (),
        boundary_grad_outputs=tuple(input_grad[i] for i in range(nb)),
    )


def _placeholders(gm: fx.GraphModule, grad_index: dict[str, int], tied: dict[str, str],
                  stage: Any) -> tuple[list, list, list, list, list]:
    """Parameters, user inputs, tangents, buffers and boundary activations, by descriptor."""
    nb = stage.num_boundary if stage is not None else 0
    params, inputs, tangents, buffers, boundary = [], [], [], [], []
    for n in gm.graph.nodes:
        if n.op != "placeholder":
            continue
        desc = n.meta.get("desc")
        kind = type(desc).__name__
        val = n.meta["val"]
        if kind == "ParamAOTInput":
            name = _short(desc.target)
            params.append(ParamInfo(name, n.name, tuple(val.shape), val.dtype,
                                    grad_index.get(name), tied.get(name)))
        elif kind == "PlainAOTInput" and desc.idx < nb:
            boundary.append(n.name)
        elif kind == "PlainAOTInput":
            index = stage.user_inputs[desc.idx - nb] if stage is not None else desc.idx
            inputs.append(InputInfo(index, n.name, tuple(val.shape), val.dtype))
        elif kind == "TangentAOTInput":
            tangents.append(n.name)
        elif kind == "BufferAOTInput":
            buffers.append(InputInfo(-1, n.name, tuple(val.shape), val.dtype, _short(desc.target)))
        else:
            raise CaptureError(f"unsupported graph input {n.name} ({desc}); please report it.")
    return params, inputs, tangents, buffers, boundary


def _short(target: str) -> str:
    return target[len(_WRAP):] if target.startswith(_WRAP) else target


def node_layers(gm: fx.GraphModule, params: Sequence[ParamInfo], prefix: str | None = None
                ) -> tuple[dict[str, str], tuple[Layer, ...]]:
    """Assign every node to a layer (``prefix.N`` of the repeated module, or ``""``)."""
    prefix = prefix or block_prefix([p.name for p in params])
    pat = re.compile(rf"^{re.escape(prefix)}\.(\d+)(\.|$)") if prefix else None
    param_layer = {}
    for p in params:
        m = pat.match(p.name) if pat else None
        param_layer[p.node] = f"{prefix}.{m.group(1)}" if m else ""
    node_layer: dict[str, str] = {}
    index = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            node_layer[n.name] = param_layer.get(n.name, "")
            continue
        if n.op != "call_function":
            continue
        layer = None
        paths = module_paths(n, keep_root=True)
        if pat is not None:
            for path in paths:
                m = pat.match(path)
                if m:
                    layer = f"{prefix}.{m.group(1)}"
                    break
        if layer is None and any(paths):
            layer = ""
        if layer is None:
            # Glue nodes (e.g. gradient accumulation of the residual stream) have no module
            # stack: they belong with the first input that has a layer.
            # the latest-computed input (in backward: this layer's branch, not the incoming
            # gradient from the layer above).
            order = [a for a in n.all_input_nodes if node_layer.get(a.name)]
            layer = node_layer[max(order, key=lambda a: index[a.name]).name] if order else ""

        node_layer[n.name] = layer
    groups: dict[str, list[str]] = {}
    for name, layer in node_layer.items():
        groups.setdefault(layer, []).append(name)
    nodes = {n.name: n for n in gm.graph.nodes}
    layers = tuple(
        Layer(name, tuple(members), _fingerprint(members, nodes, node_layer))
        for name, members in groups.items()
    )
    return node_layer, layers


def _fingerprint(members: list[str], nodes: dict[str, fx.Node], node_layer: dict[str, str]) -> str:
    """Hash of a layer's ops, shapes and internal wiring (positions, not names)."""
    pos = {name: i for i, name in enumerate(members)}
    h = hashlib.sha256()
    for name in members:
        n = nodes[name]
        val = n.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
        refs = []
        for a in n.all_input_nodes:
            refs.append(f"L{pos[a.name]}" if a.name in pos else f"X{tuple(a.meta['val'].shape) if isinstance(a.meta.get('val'), torch.Tensor) else ''}")
        consts = [a for a in tree_flatten((n.args, n.kwargs))[0] if not isinstance(a, fx.Node)]
        target = "placeholder" if n.op == "placeholder" else n.target
        h.update(f"{n.op}|{target}|{shape}|{refs}|{consts}".encode())
    return h.hexdigest()[:16]


def model_fingerprint(model: nn.Module, example_inputs: Any) -> str:
    """A hash of what a plan depends on, without tracing: every parameter's and buffer's name,
    shape, dtype and tie, the module tree (``repr``), the source of each module class's
    ``forward``, and the example inputs' shapes and dtypes."""
    h = hashlib.sha256(type(model).__qualname__.encode())
    owner: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        h.update(f"p|{name}|{tuple(p.shape)}|{p.dtype}|{owner.setdefault(id(p), name)}".encode())
    for name, b in model.named_buffers(remove_duplicate=False):
        h.update(f"b|{name}|{tuple(b.shape)}|{b.dtype}".encode())
    h.update(repr(model).encode())
    for cls in sorted({type(m) for m in model.modules()}, key=lambda c: c.__qualname__):
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):  # built-in or defined in a REPL: the name stands for it
            source = cls.__qualname__
        h.update(source.encode())
    args, kwargs = normalize_inputs(example_inputs)
    for x in tree_flatten((args, kwargs))[0]:
        h.update((f"{tuple(x.shape)}|{x.dtype}" if isinstance(x, torch.Tensor) else repr(x)).encode())
    return h.hexdigest()[:16]
