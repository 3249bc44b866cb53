"""Per-op compute cost: a roofline over FLOPs and bytes moved.

Sources:
  [ROOF]  Williams, Waterman, Patterson, "Roofline: An Insightful Visual Performance Model for
          Multicore Architectures", CACM 52(4), 2009: time = max(work / peak, traffic / bandwidth).
  [DESIGN] autopar DESIGN section 5: ``max(flops / (peak * eff), bytes / (mem_bw * eff))``.
  [TFC]   torch.utils.flop_counter (PyTorch): ``flop_registry`` maps an aten OpOverloadPacket to a
          formula over shapes; a matmul of (m, k) x (k, n) counts 2 m k n (one multiply and one add
          per MAC). Attention counts its two batched matmuls and does not discount the causal mask,
          like Megatron's Eq. 3 (Narayanan et al., SC'21).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.flop_counter import (
    flop_registry,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)

import autopar.capture.experts  # noqa: F401  (registers autopar::grouped_mm, priced below)
from autopar.cost_models.topology import Topology

__all__ = [
    "DENSE_MATMULS",
    "TENSOR_CORE_ALIGNMENT_BYTES",
    "matmul_peak",
    "EXTRA_FLOP_FORMULAS",
    "FLOP_FORMULAS_BY_NAME",
    "op_time",
    "flops_of_node",
    "bytes_of_node",
    "graph_flops",
    "mfu",
]

aten = torch.ops.aten


def op_time(
    flops: float,
    bytes_moved: float,
    topology: Topology,
    dtype: str = "fp32",
    is_matmul: bool = True,
) -> float:
    """Roofline time in seconds of one op on one device of ``topology``.

    ``max(flops / (peak[dtype] * matmul_efficiency), bytes / (mem_bw * pointwise_efficiency))``
    for matmul-like ops ([ROOF], [DESIGN]). Non-matmul ops do not use the tensor cores: their
    FLOPs run at the fp32 (vector unit) peak, with no efficiency factor, since such ops are almost
    always bound by the memory term.
    """
    if flops < 0 or bytes_moved < 0:
        raise ValueError(f"op_time: flops and bytes must be >= 0, got {flops!r}, {bytes_moved!r}")
    if is_matmul:
        compute_rate = topology.peak_flops_for(dtype) * topology.matmul_efficiency
    else:
        compute_rate = topology.peak_flops_for("fp32")
    memory_rate = topology.mem_bandwidth_Bps * topology.pointwise_efficiency
    return max(flops / compute_rate, bytes_moved / memory_rate)


def _shape(x: Any) -> Any:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else x


def _sdpa_fwd(query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    # [TFC] sdpa_flop_count: QK^T and (attn @ V), 2 * b*h*s_q*s_k*d each; GQA allowed.
    return sdpa_flop_count(_shape(query), _shape(key), _shape(value))


def _sdpa_bwd(grad_out: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> int:
    # [TFC] sdpa_backward_flop_count: recomputed scores + four gradient matmuls.
    return sdpa_backward_flop_count(_shape(grad_out), _shape(query), _shape(key), _shape(value))


def _linear(inp: Any, weight: Any, *args: Any, **kwargs: Any) -> int:
    # y = x W^T: 2 * (rows of x) * in_features * out_features, bias ignored as in [TFC] addmm.
    x, w = _shape(inp), _shape(weight)
    out_features = w[0] if len(w) == 2 else 1
    return 2 * math.prod(x[:-1]) * x[-1] * out_features


def _matmul(a: Any, b: Any, *args: Any, **kwargs: Any) -> int:
    # torch.matmul with 1-D promotion and batch broadcasting: 2 * (output elements) * k.
    sa, sb = _shape(a), _shape(b)
    a2 = sa if len(sa) > 1 else (1, *sa)
    b2 = sb if len(sb) > 1 else (*sb, 1)
    batch = torch.broadcast_shapes(tuple(a2[:-2]), tuple(b2[:-2]))
    return 2 * math.prod(batch) * a2[-2] * b2[-1] * a2[-1]


def _grouped_mm(x: Any, w: Any, *args: Any, **kwargs: Any) -> int:
    # autopar::grouped_mm: each of the rows times its group's [in, out] weight, 2 * rows * in * out
    # whatever the routing (the groups partition the rows)
    rows, inner = _shape(x)
    return 2 * rows * inner * _shape(w)[2]


def _aten_grouped_mm(a: Any, b: Any, *args: Any, **kwargs: Any) -> int:
    # aten._grouped_mm (torch's grouped_mm; transformers' experts in bf16): groups along the
    # rows (2-D x 3-D), along the contracted dim (2-D x 2-D, a weight gradient: one [m, n] per
    # group), batched (3-D x 3-D) or along the columns (3-D x 2-D); each, 2 * the products summed
    sa, sb = _shape(a), _shape(b)
    if len(sa) == 2:  # [m, k] x [G, k, n] or [m, K] x [K, n]
        return 2 * sa[0] * sa[1] * sb[-1]
    if len(sb) == 3:  # [G, m, k] x [G, k, n]
        return 2 * math.prod(sa) * sb[-1]
    return 2 * math.prod(sa) // sa[0] * sb[-1]  # [G, m, k] x [k, N]


def _grouped_mm_backward(grad: Any, x: Any, w: Any, *args: Any, **kwargs: Any) -> int:
    # the input's gradient and the weights', each as many FLOPs as the forward
    return 2 * _grouped_mm(x, w)


# Formulas for ops torch's registry lacks (checked first in torch's registry, so a later torch
# that registers one of these takes precedence). Keys are OpOverloadPackets like torch's.
EXTRA_FLOP_FORMULAS: dict[Any, Callable[..., int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_fwd,
    aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_bwd,
    aten.scaled_dot_product_attention: _sdpa_fwd,
    aten.linear: _linear,
    aten.matmul: _matmul,
    aten._grouped_mm: _aten_grouped_mm,
    torch.ops.autopar.grouped_mm: _grouped_mm,  # the expert blocks' (capture.experts)
    torch.ops.autopar.grouped_mm_backward: _grouped_mm_backward,
}


# Formulas for custom ops of libraries autopar does not import, by the op's qualified name:
# transformers' grouped matmul of experts (its fallback of ``grouped_mm`` under export in fp32,
# transformers/integrations/moe.py; the backward takes the output's gradient last).
FLOP_FORMULAS_BY_NAME: dict[str, Callable[..., int]] = {
    "transformers::grouped_mm_fallback": _grouped_mm,
    "transformers::grouped_mm_fallback_backward": lambda x, w, *rest, **kw: 2 * _grouped_mm(x, w),
}


# Dense matmuls whose 16-bit operands must be row-aligned for the tensor cores (see
# :func:`matmul_peak`); packets, as the FX targets' ``overloadpacket``.
DENSE_MATMULS = frozenset({aten.mm, aten.addmm, aten.bmm, aten.baddbmm, aten.matmul, aten.linear})
# cuBLAS loads tensor-core tiles 16 bytes at a time ([UNAL] in topology.py)
TENSOR_CORE_ALIGNMENT_BYTES = 16


def matmul_peak(op: Any, tensors: Sequence[torch.Tensor]) -> str:
    """The peak a node of ``op`` with input and output ``tensors`` (real, fake or meta) runs at,
    as :meth:`Topology.peak_flops_for` names it: ``"fp32"`` unless its first tensor is 16-bit;
    then ``"bf16"``, or ``"bf16_unaligned"`` for a dense matmul (:data:`DENSE_MATMULS`) one of
    whose matrices has a row stride that is not a multiple of 16 bytes (a vocabulary of 50257:
    [UNAL], 7-10x slower on an H200)."""
    if not tensors or tensors[0].element_size() != 2:
        return "fp32"
    if getattr(op, "overloadpacket", op) not in DENSE_MATMULS:
        return "bf16"
    for t in tensors:
        if t.dim() >= 2 and any(size > 1 and stride != 1
                                and (stride * t.element_size()) % TENSOR_CORE_ALIGNMENT_BYTES
                                for size, stride in zip(t.shape, t.stride())):
            return "bf16_unaligned"
    return "bf16"


def _lookup(op: Any) -> tuple[Callable[..., Any] | None, bool]:
    """(formula, takes_out_val) for ``op`` (an OpOverload, OpOverloadPacket or HOP)."""
    candidates = [op]
    packet = getattr(op, "overloadpacket", None)
    if packet is not None:
        candidates.append(packet)
    for key in candidates:
        try:
            if key in flop_registry:
                return flop_registry[key], True
        except TypeError:  # unhashable target
            return None, False
    for key in candidates:
        if key in EXTRA_FLOP_FORMULAS:
            return EXTRA_FLOP_FORMULAS[key], False
    name = op.name() if packet is not None else None  # (an OpOverload: "namespace::op")
    if name in FLOP_FORMULAS_BY_NAME:
        return FLOP_FORMULAS_BY_NAME[name], False
    return None, False


def flops_of_node(op: Any, args: Any, kwargs: Any, out: Any) -> float:
    """FLOPs of one call ``op(*args, **kwargs) -> out``, 0.0 for ops without a formula.

    ``op`` is an aten OpOverload (an FX node's target, e.g. ``aten.mm.default``), its
    OpOverloadPacket, or a higher-order operator; ``args``/``kwargs``/``out`` may hold real tensors,
    FakeTensors or anything else torch's formulas accept. Formulas come from
    ``torch.utils.flop_counter.flop_registry`` ([TFC]) and then :data:`EXTRA_FLOP_FORMULAS`.
    """
    formula, takes_out = _lookup(op)
    if formula is None:
        return 0.0
    args = tuple(args) if args is not None else ()
    kwargs = dict(kwargs) if kwargs is not None else {}
    if takes_out:
        # Same call as FlopCounterMode._count_flops: formula(*args, **kwargs, out_val=out).
        value = formula(*args, **kwargs, out_val=out)
    else:
        value = formula(*args, **kwargs)
    return float(value)


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _tensors(item)


def bytes_of_node(args: Any, kwargs: Any, out: Any) -> float:
    """Bytes an op reads and writes: the sizes of all tensors in ``args``, ``kwargs`` and ``out``.

    An upper bound for the roofline's memory term (a tensor passed twice counts twice; views and
    in-place ops should be priced by the caller, usually as 0).
    """
    total = 0
    for t in _tensors((args, kwargs or {}, out)):
        total += t.numel() * t.element_size()
    return float(total)


def graph_flops(gm: Any, nodes: Any = None) -> float:
    """FLOPs of one run of ``gm`` (an FX graph with ``meta["val"]`` on its nodes, e.g. a traced
    joint forward+backward graph) on its global shapes: the sum of :func:`flops_of_node`, over
    the nodes named in ``nodes`` when given."""
    import torch.fx as fx

    total = 0.0
    for n in gm.graph.nodes:
        if n.op != "call_function" or (nodes is not None and n.name not in nodes):
            continue
        args = fx.node.map_arg(n.args, lambda a: a.meta.get("val"))
        kwargs = fx.node.map_arg(n.kwargs, lambda a: a.meta.get("val"))
        try:
            total += flops_of_node(n.target, args, kwargs, n.meta.get("val"))
        except (RuntimeError, TypeError, ValueError, IndexError, AssertionError):
            continue  # no usable formula for these arguments: counted as 0, as in pricing
    return total


def mfu(model_flops: float, step_time_s: float, devices: int, topology: Any, dtype: str) -> float:
    """Model FLOPs utilization: the model's FLOPs per step over what ``devices`` devices could
    do at ``dtype`` peak in the step time (Chowdhery et al., PaLM, arXiv:2204.02311, app. B;
    recomputation is not counted as model FLOPs there, and it is not here either)."""
    if step_time_s <= 0 or devices <= 0:
        return 0.0
    return model_flops / (step_time_s * devices * topology.peak_flops[dtype])

