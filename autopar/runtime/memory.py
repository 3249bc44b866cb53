"""Measure the peak memory of a real training step on this rank, to check the memory model.

:func:`measure_peak_memory` runs a step under PyTorch's ``MemTracker`` (a ``TorchDispatchMode``
that follows every tensor storage an op creates or touches, kept in
:mod:`autopar._torch_private`) and reports the peak live bytes on each device of this process,
split into parameters, gradients, activations, temporaries and optimizer state at the peak.
DTensor parameters count their local shard. It works on CPU, so the plan's
``predicted["peak_memory_bytes"]`` can be checked against a gloo job.

    report = measure_peak_memory(lambda: train_step(), pmodel, optimizer)
    print(report.peak_bytes, report.by_kind)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from autopar import _torch_private as private

__all__ = ["MemoryReport", "measure_peak_memory"]

_KINDS = {"Parameter": "parameters", "Buffer": "buffers", "Gradient": "gradients",
          "Activation": "activations", "Temp": "temporaries", "Optstate": "optimizer",
          "Other": "other"}


@dataclass(frozen=True)
class MemoryReport:
    """Peak live tensor bytes on one device during the measured step.

    ``by_kind``: the peak's bytes per kind (``parameters``, ``buffers``, ``gradients``,
    ``activations``, ``temporaries``, ``optimizer``, ``other``); ``device``: where.
    """

    device: str
    peak_bytes: int
    by_kind: dict[str, int]


def measure_peak_memory(step: Callable[[], Any], *track: Any,
                        per_module: bool = True) -> MemoryReport:
    """Run ``step()`` once and return the peak memory of this process's device.

    ``track``: modules, optimizers or tensors created before the step whose memory counts from
    the start (the model, its optimizer, the inputs); tensors created during the step are
    followed automatically. ``per_module=False`` for a step that calls a top-level module more
    than once (a pipeline's stages, once per microbatch), which the per-module statistics
    refuse. Raises ``ValueError`` if the step touched more than one device.
    """
    tracker = private.memory_tracker(per_module)
    if track:
        tracker.track_external(*track)
    with tracker:
        step()
    snapshot = tracker.get_tracker_snapshot("peak")
    if len(snapshot) != 1:
        raise ValueError(f"the step used {len(snapshot)} devices ({sorted(map(str, snapshot))}); "
                         f"measure one device per process.")
    device, stats = next(iter(snapshot.items()))
    by_kind = {_KINDS.get(getattr(k, "value", str(k)), str(k)): int(v) for k, v in stats.items()
               if k != "Total"}
    return MemoryReport(str(device), int(stats["Total"]), by_kind)
