"""Fit a topology's constants to timings measured on the user's own devices.

The measuring is :mod:`autopar.calibrate`'s (it runs kernels and collectives); this module only
fits, so it is tested on synthetic timings. Two fits, each in the cost model's own formulas:

- **compute** (:func:`fit_compute`): the roofline of :func:`autopar.cost_models.compute.op_time`,
  ``max(flops / (peak * matmul_efficiency), bytes / (bandwidth * pointwise_efficiency))``. Each
  efficiency is chosen so that the predicted *sum* of its kernels' times, each weighted by how
  often the model's step runs it, equals the measured sum: a step's compute is a sum, so that is
  the error that matters, and small kernels dominated by launch overhead weigh what they cost.
  Ops without FLOPs fit ``pointwise_efficiency`` first; matmuls then fit ``matmul_efficiency``
  (bisection: the predicted sum falls as the efficiency grows). Peaks and bandwidth are the base
  preset's datasheet figures on GPUs; on a CPU, which has none, they are the best rates measured
  (``peaks``), so each efficiency stays in (0, 1].
- **links** (:func:`fit_link`): the alpha-beta forms of :mod:`autopar.cost_models.comm`, ``t =
  launch + h * latency + g * nbytes / bandwidth`` with ``(h, g)`` of each collective kind on
  ``n`` ranks (ring all-reduce ``2(n-1), 2(n-1)/n``; all-gather, reduce-scatter and all-to-all
  ``n-1, (n-1)/n``; send/recv ``1, 1``; Thakur et al. 2005, nccl-tests PERFORMANCE.md). Least squares
  on ``(predicted - measured)^2 / measured`` over every sample (a relative error weighted by the
  time: the large messages that make most of a step's communication time fix the bandwidths),
  with one launch and latency and a bandwidth per collective kind (``AxisLink.bandwidth_by_kind``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from autopar.cost_models.attention import ATTENTION_KERNELS
from autopar.cost_models.compute import op_time
from autopar.cost_models.links import AxisLink
from autopar.cost_models.topology import Topology, custom

__all__ = ["KernelSample", "CollectiveSample", "ComputeFit", "fit_compute", "fit_link",
           "ring_terms", "predicted_kernel_time", "step_seconds", "LAUNCH_BOUND_S", "is_attention"]

# A GPU kernel call shorter than this is timed at the host's launch rate, not the GPU's: on an
# H200 (benchmarks/data/h200_kernel_sweep.json) back-to-back GEMMs of any size below it took
# 13-23 us a call, varying 2x between two runs; the roofline does not price launches.
LAUNCH_BOUND_S = 40e-6

_ATTENTION_NAMES = frozenset(str(op) for op in ATTENTION_KERNELS)  # (KernelSample.name: str(op))


@dataclass(frozen=True)
class KernelSample:
    """One kernel timed on the device: its roofline terms as the cost model counts them, the
    measured seconds of one call, and how many times a step runs it (``count``);
    ``fused_bytes``: its bytes as the planner prices them in its graph (the traffic a fusing
    compiler removes left out, ``cost_models.sharding.fused_edges``; the mean over the nodes it
    stands for), ``None`` when not counted (then ``bytes``)."""

    name: str
    flops: float
    bytes: float
    dtype: str  # "fp32" or "bf16": the matmul peak it runs at
    seconds: float
    count: int = 1
    fused_bytes: float | None = None  # per call, the traffic left where a compiler fuses it


@dataclass(frozen=True)
class CollectiveSample:
    """One collective timed over ``ranks`` processes: ``kind`` (``all_reduce``, ``all_gather``,
    ``reduce_scatter``, ``all_to_all``, ``send_recv``), ``nbytes`` as
    :mod:`autopar.cost_models.comm` counts it (the whole buffer), and the measured seconds of
    one call."""

    kind: str
    nbytes: float
    ranks: int
    seconds: float


@dataclass(frozen=True)
class ComputeFit:
    """The compute constants fitted (``peak_flops``, ``mem_bandwidth_Bps`` and the two
    efficiencies, as :class:`Topology` takes them) and ``clamped``: the efficiencies that the
    timings put above 1 (the device beat its datasheet), held at 1."""

    peak_flops: dict[str, float]
    mem_bandwidth_Bps: float
    matmul_efficiency: float
    pointwise_efficiency: float
    clamped: tuple[str, ...]


def predicted_kernel_time(k: KernelSample, topology: Topology) -> float:
    """The cost model's time of kernel ``k`` on ``topology`` (one call)."""
    return op_time(k.flops, k.bytes, topology, k.dtype, is_matmul=k.flops > 0)


def step_seconds(kernels: Sequence[KernelSample], topology: Topology | None = None) -> float:
    """The seconds ``kernels`` take in one step, each times its ``count``: as measured, or as
    ``topology`` prices them."""
    if topology is None:
        return sum(k.seconds * k.count for k in kernels)
    return sum(predicted_kernel_time(k, topology) * k.count for k in kernels)


def is_attention(k: KernelSample) -> bool:
    """Whether ``k`` is a fused attention kernel (:data:`ATTENTION_KERNELS`), which a topology
    with measured attention rates prices apart from the matmuls."""
    return k.name in _ATTENTION_NAMES


def fit_compute(kernels: Sequence[KernelSample], base: Topology,
                peaks: dict[str, float] | None = None,
                bandwidth_Bps: float | None = None,
                fused_seconds: float | None = None) -> ComputeFit:
    """Fit the two efficiencies of ``base`` to ``kernels`` (see the module's text).

    ``peaks`` / ``bandwidth_Bps``: measured best rates that replace the base's peaks and memory
    bandwidth (a CPU's); ``None`` keeps the base's (a GPU's datasheet). ``fused_seconds``: the
    seconds a step of the compiled program spends outside its GEMM and attention kernels
    (``autopar.calibrate.time_compiled_step``): the pointwise efficiency is then fitted on it,
    the ops' bytes as the planner prices them (``KernelSample.fused_bytes``: fused traffic left
    out) over the time of the kernels the compiler fused them into, instead of on the ops timed
    one by one (an op that could not be timed alone is missing from the bytes but not from the
    compiled step's time: it biases the efficiency low). When
    ``base`` has measured attention rates, attention kernels are left out of the matmul fit
    (they are priced by those rates). Raises ``ValueError`` when there is no kernel of either
    kind to fit on.
    """
    pointwise = [k for k in kernels if k.flops <= 0 and k.bytes > 0]
    matmuls = [k for k in kernels if k.flops > 0
               and not (base.attention_efficiency and is_attention(k))]
    if not pointwise or not matmuls:
        raise ValueError(f"fit_compute needs kernels with FLOPs (matmuls) and without (pointwise); "
                         f"got {len(matmuls)} and {len(pointwise)} of {len(kernels)}"
                         + (" (attention kernels are not matmuls here: the base prices them by "
                            "its measured rates)" if base.attention_efficiency else ""))
    peak = dict(base.peak_flops) | dict(peaks or {})
    bandwidth = float(bandwidth_Bps or base.mem_bandwidth_Bps)
    clamped = []
    if fused_seconds is not None and not fused_seconds > 0:
        raise ValueError(f"fit_compute: fused_seconds must be > 0, got {fused_seconds!r}")
    if fused_seconds is None:
        e_p = sum(k.bytes * k.count for k in pointwise) / bandwidth / step_seconds(pointwise)
    else:  # the bytes the planner prices a compiled step's ops with
        moved = sum((k.bytes if k.fused_bytes is None else k.fused_bytes) * k.count for k in pointwise)
        e_p = moved / bandwidth / fused_seconds
    if e_p > 1.0:
        clamped.append("pointwise_efficiency")
        e_p = 1.0
    topo = custom(base.name, base=base, peak_flops=peak, mem_bandwidth_Bps=bandwidth,
                  pointwise_efficiency=e_p, matmul_efficiency=1.0)
    measured = step_seconds(matmuls)

    def predicted(e_m: float) -> float:
        t = custom(base.name, base=topo, matmul_efficiency=e_m)
        return step_seconds(matmuls, t)

    lo, hi = 1e-4, 1.0
    if predicted(lo) < measured:
        raise ValueError(f"fit_compute: the matmuls took {measured:.3g} s, more than a matmul "
                         f"efficiency of {lo} explains on {base.name}'s peaks "
                         f"({predicted(lo):.3g} s); check the base preset (its peaks) and the "
                         f"timings")
    if predicted(hi) > measured:  # faster than the peak (or the memory term) allows: held at 1
        memory = sum(k.bytes * k.count for k in matmuls) / (bandwidth * e_p)
        clamped.append("matmul_efficiency" + (" (the matmuls' memory term alone is above their "
                                              "measured time)" if memory > measured else ""))
        e_m = hi
    else:
        for _ in range(60):  # predicted(e) falls as e grows; find predicted(e) = measured
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if predicted(mid) > measured else (lo, mid)
        e_m = hi
    return ComputeFit(peak, bandwidth, e_m, e_p, tuple(clamped))


def ring_terms(kind: str, ranks: int) -> tuple[float, float]:
    """``(h, g)`` of collective ``kind`` on ``ranks`` ranks in :mod:`autopar.cost_models.comm`'s
    form ``launch + h * latency + g * nbytes / bandwidth``."""
    n = ranks
    terms = {"all_reduce": (2.0 * (n - 1), 2.0 * (n - 1) / n),
             "all_gather": (n - 1.0, (n - 1.0) / n), "reduce_scatter": (n - 1.0, (n - 1.0) / n),
             "all_to_all": (n - 1.0, (n - 1.0) / n), "send_recv": (1.0, 1.0)}
    if kind not in terms:
        raise ValueError(f"ring_terms: unknown collective kind {kind!r}; one of {sorted(terms)}")
    return terms[kind]


def fit_link(samples: Sequence[CollectiveSample]) -> AxisLink:
    """The :class:`AxisLink` whose alpha-beta times best match ``samples`` (time-weighted
    relative error): one launch and one per-step latency, and a bus bandwidth per collective
    kind timed (gloo's reduce-scatter, say, is slower than its all-reduce). ``bandwidth_Bps`` is
    the all-reduce's (else the first kind's), the other kinds' go to ``bandwidth_by_kind``.
    Launch and latency are kept >= 0.

    Raises ``ValueError`` when a kind was timed at a single message size, or its timings do
    not grow with the size (no bandwidth can be fitted).
    """
    bad = [s for s in samples if not s.seconds > 0]
    if bad:
        raise ValueError(f"fit_link: {len(bad)} samples have no positive time (first: {bad[0]}); "
                         f"time each collective over several calls and pass seconds > 0")
    kinds = list(dict.fromkeys(s.kind for s in samples))
    for kind in kinds:
        if len({s.nbytes for s in samples if s.kind == kind}) < 2:
            raise ValueError(f"fit_link needs each kind at two sizes or more; {kind!r} has "
                             f"{sorted({s.nbytes for s in samples if s.kind == kind})}: time it "
                             f"at more message sizes")
    rows = np.zeros((len(samples), 2 + len(kinds)))
    for i, s in enumerate(samples):
        h, g = ring_terms(s.kind, s.ranks)
        rows[i, :2] = (1.0, h)
        rows[i, 2 + kinds.index(s.kind)] = g * s.nbytes
    t = np.array([s.seconds for s in samples])
    # squared error over the time: a relative error weighted by the time, so the large messages
    # that dominate a step's communication fix the bandwidths, and the small ones still count
    a, y = rows / np.sqrt(t)[:, None], np.sqrt(t)
    best, best_err = None, math.inf
    for keep in itertools.product((True, False), repeat=2):  # launch, latency >= 0
        cols = [i for i in range(2) if keep[i]] + list(range(2, 2 + len(kinds)))
        x = np.zeros(rows.shape[1])
        x[cols] = np.linalg.lstsq(a[:, cols], y, rcond=None)[0]
        if (x[:2] < 0).any() or (x[2:] <= 0).any():
            continue
        err = float(np.sum((a @ x - y) ** 2))
        if err < best_err:
            best, best_err = x, err
    if best is None:
        raise ValueError("fit_link: no fit with launch, latency >= 0 and a bandwidth for every "
                         "kind; the timings do not grow with the message size (too small "
                         "messages, or too noisy)")
    bandwidth = {kind: 1.0 / best[2 + i] for i, kind in enumerate(kinds)}
    main = "all_reduce" if "all_reduce" in bandwidth else kinds[0]
    return AxisLink(bandwidth_Bps=bandwidth[main], latency_s=float(best[1]),
                    launch_s=float(best[0]),
                    bandwidth_by_kind=tuple((k, b) for k, b in bandwidth.items() if k != main))
