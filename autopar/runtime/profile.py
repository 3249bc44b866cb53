"""Measuring a running step against what its plan predicts: times per stage and phase
(:func:`profile_step`), and the collectives it issues, count and bytes by kind
(:class:`CommMeter`). Under ``torch.profiler`` a step shows as an ``autopar step`` range, and a
pipeline stage's graphs as ``autopar stage J forward`` / ``backward`` ranges.

:class:`CommMeter` is a ``TorchDispatchMode``: every collective and point-to-point op that
reaches the dispatcher (``torch.distributed``'s ``c10d`` ops, which ``DistributedDataParallel``'s
reducer and ``torch.distributed.pipelining`` also use, and the functional collectives of
autopar's programs and of DTensor) is counted under the plan's kind names, with the plan's
definition of its bytes (:class:`autopar.plan.Collective`): the all-reduced tensor, the
all-gather's output, the reduce-scatter's input, the tensor sent or received::

    with CommMeter() as meter:
        pmodel.step(ids, labels)
    meter.counts, meter.bytes            # {"all_reduce": 8, ...}, {"all_reduce": 4194304, ...}
    pmodel.plan.collective_bytes()       # the prediction, the same keys
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
from autopar._torch_private import TorchDispatchMode
from autopar.comm_ops import OPS_WITH_COLLECTIVES

__all__ = ["CommMeter", "StepProfile", "profile_step"]


def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


# op name -> (kind, bytes of the op from its arguments)
_BY_NAME: dict[str, tuple[str, Callable[[tuple], int]]] = {
    # functional collectives (autopar's lowered programs, DTensor)
    "all_reduce": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_reduce_": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_reduce_coalesced": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_reduce_coalesced_": ("all_reduce", lambda a: _nbytes(a[0])),
    "all_gather_into_tensor": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "all_gather_into_tensor_out": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "all_gather_into_tensor_coalesced": ("all_gather", lambda a: _nbytes(a[0]) * a[1]),
    "reduce_scatter_tensor": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "reduce_scatter_tensor_out": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", lambda a: _nbytes(a[0])),
    "all_to_all_single": ("all_to_all", lambda a: _nbytes(a[0])),
    "broadcast": ("broadcast", lambda a: _nbytes(a[0])),
    "broadcast_": ("broadcast", lambda a: _nbytes(a[0])),
    "isend": ("send", lambda a: _nbytes(a[0])),
    "irecv": ("recv", lambda a: _nbytes(a[0])),
    # c10d ops (torch.distributed's eager API, DDP's reducer, pipelining's p2p)
    "allreduce_": ("all_reduce", lambda a: _nbytes(a[0])),
    "allreduce_coalesced_": ("all_reduce", lambda a: _nbytes(a[0])),
    "_allgather_base_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_": ("all_gather", lambda a: _nbytes(a[0])),
    "allgather_into_tensor_coalesced_": ("all_gather", lambda a: _nbytes(a[0])),
    "_reduce_scatter_base_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", lambda a: _nbytes(a[1])),
    "alltoall_base_": ("all_to_all", lambda a: _nbytes(a[1])),
    "alltoall_": ("all_to_all", lambda a: _nbytes(a[1])),
    "send": ("send", lambda a: _nbytes(a[0])),
    "recv_": ("recv", lambda a: _nbytes(a[0])),
    "recv_any_source_": ("recv", lambda a: _nbytes(a[0])),
}


# keyed on the op packets (every overload) of both namespaces that this torch release has
_OPS = {getattr(ns, name): entry for name, entry in _BY_NAME.items()
        for ns in (torch.ops.c10d, torch.ops._c10d_functional) if hasattr(ns, name)}


class CommMeter(TorchDispatchMode):
    """Counts the collectives dispatched while active: ``counts`` and ``bytes`` by kind, on
    this rank (see the module docstring). Barriers and waits are not counted."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter = Counter()
        self.bytes: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        body = OPS_WITH_COLLECTIVES.get(func)
        if body is not None:  # (an op that communicates inside: run its body under the meter)
            with self:
                return body(*args, **(kwargs or {}))
        entry = _OPS.get(getattr(func, "overloadpacket", None))
        if entry is not None:
            kind, size = entry
            self.counts[kind] += 1
            self.bytes[kind] += int(size(args))
        return func(*args, **(kwargs or {}))

    @property
    def total_bytes(self) -> int:
        """All bytes counted, every kind."""
        return sum(self.bytes.values())


@dataclass
class StepProfile:
    """Predicted and measured seconds of a training step and its parts, and its collectives.

    ``times``: ``(what, predicted s, measured s)`` rows: the step (the median of the measured
    steps, the slowest rank's), then per pipeline stage its forward and backward per microbatch
    (mean over microbatches and steps), or for a plan without a pipeline the forward and the
    backward of ``pmodel(...)`` / ``loss.backward()``. ``comm``: kind -> (predicted count,
    measured count, predicted bytes, measured bytes) on this rank."""

    times: list[tuple[str, float, float]] = field(default_factory=list)
    comm: dict[str, tuple[int, int, int, int]] = field(default_factory=dict)

    def __str__(self) -> str:
        from tabulate import tabulate

        rows = [[what, f"{p * 1e3:.3f}", f"{m * 1e3:.3f}", f"{m / p:.2f}" if p else ""]
                for what, p, m in self.times]
        comm = [[k, pc, mc, pb, mb, "yes" if (pc, pb) == (mc, mb) else "NO"]
                for k, (pc, mc, pb, mb) in sorted(self.comm.items())]
        return (tabulate(rows, headers=["", "predicted ms", "measured ms", "measured / predicted"])
                + "\n\n" + tabulate(comm, headers=["collective", "predicted", "measured",
                                                     "predicted bytes", "measured bytes", "equal"]))


def profile_step(pmodel: Any, *args: Any, steps: int = 3, **kwargs: Any) -> StepProfile:
    """Run ``steps`` training steps of ``pmodel`` (after one to warm up) on the batch
    ``args``/``kwargs`` and set what they take against the plan's predictions (see
    :class:`StepProfile`; ``print`` it). A collective: call it on every rank. It leaves every
    ``p.grad`` at ``None``.
    """
    plan = pmodel.plan
    pmodel.step(*args, **kwargs)  # compiles, exchanges the pipeline's shapes
    _clear_grads(pmodel)
    graphs = _stage_graphs(pmodel)
    for labelled in (g for phases in graphs.values() for gs in phases.values() for g in gs):
        labelled.times = []
    walls = []
    try:
        for _ in range(steps):
            walls.append(_timed(lambda: pmodel.step(*args, **kwargs)))
            _clear_grads(pmodel)
    finally:
        measured = {j: {ph: [t for g in gs for t in g.times] for ph, gs in phases.items()}
                    for j, phases in graphs.items()}
        for labelled in (g for phases in graphs.values() for gs in phases.values() for g in gs):
            labelled.times = None
    profile = StepProfile(times=[("step", plan.predicted["step_time_s"], statistics.median(walls))])
    if plan.pipeline is not None:
        profile.times += _stage_rows(plan, measured, steps)
    else:
        profile.times += _phase_rows(pmodel, plan, args, kwargs)
    with CommMeter() as meter:
        pmodel.step(*args, **kwargs)
    _clear_grads(pmodel)
    pp_rank = getattr(pmodel, "pp_rank", None) if plan.pipeline is not None else None
    counts, nbytes = plan.collective_counts(pp_rank=pp_rank), plan.collective_bytes(pp_rank=pp_rank)
    for kind in sorted(set(counts) | set(meter.counts)):
        profile.comm[kind] = (counts[kind], meter.counts[kind], nbytes[kind], meter.bytes[kind])
    return profile


def _clear_grads(pmodel: Any) -> None:
    for p in pmodel.parameters():
        p.grad = None


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn`` between barriers: the slowest rank's."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _stage_graphs(pmodel: Any) -> dict[int, dict[str, list[Any]]]:
    stages = getattr(pmodel, "_stage_modules", {})
    return {j: stage.graphs() for j, stage in stages.items()}


def _stage_rows(plan: Any, measured: dict[int, dict[str, list[float]]], steps: int
                ) -> list[tuple[str, float, float]]:
    """Per stage (every rank's, gathered): forward and backward seconds per microbatch."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, measured)
    merged: dict[int, dict[str, list[float]]] = {}
    for part in every:
        for j, phases in part.items():
            merged.setdefault(j, phases)  # (the ranks of one pipeline rank measure alike)
    pipe, m = plan.pipeline, plan.pipeline.microbatches
    rows = []
    for j in sorted(merged):
        fwd = pipe.stages[j].predicted.get("forward_s", 0.0)
        both = pipe.predicted["stage_time_s"][j]
        per_mb = {ph: sum(ts) / (m * steps) for ph, ts in merged[j].items()}
        rows += [(f"stage {j} forward / microbatch", fwd, per_mb["forward"]),
                 (f"stage {j} backward / microbatch", both - fwd, per_mb["backward"])]
    return rows


def _phase_rows(pmodel: Any, plan: Any, args: tuple, kwargs: dict) -> list[tuple[str, float, float]]:
    """A plan without a pipeline: its forward and backward, run apart (``pmodel(...)``, then
    ``backward()``)."""
    from autopar.capture import extract_loss

    out: list[Any] = []
    forward = _timed(lambda: out.append(pmodel(*args, **kwargs)))
    backward = _timed(lambda: extract_loss(out[0]).backward())
    _clear_grads(pmodel)
    predicted_fwd = plan.predicted["forward_s"]
    return [("forward", predicted_fwd, forward),
            ("backward", plan.predicted["step_time_s"] - predicted_fwd, backward)]

