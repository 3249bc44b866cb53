"""NCCL's measured collective times by message size, for links whose bus bandwidth depends on it.

An alpha-beta line (``launch + hops * latency + bytes / bandwidth``, :mod:`autopar.cost_models.comm`)
misses two things NCCL does: it switches protocol with the message size (LL, LL128, Simple), so
the bus bandwidth climbs over three decades of sizes instead of reaching its peak at once, and
inside an H100 node it runs all-reduce on NVLink SHARP (NVLS: the switch reduces), which reaches
about 480 GB/s where the ring tops out at 370. Where a measured sweep exists, a link carries it
(``AxisLink.busbw_by_size``) and the collective is priced by interpolating it.

``[DGXC]`` NVIDIA/dgxc-benchmarking, ``nccl/README.md`` at commit 46e420155bec6e791fd720f1ce7430781271d5e6,
"View sample output (AllReduce excerpt)": ``all_reduce_perf`` on 8 NVIDIA H100 80GB HBM3 of one
node, float sum, out-of-place, 8 B to 16 GiB (also in ``benchmarks/data/calibration.json``,
dataset ``nccl_allreduce_h100_8gpu_sweep``).
"""

from __future__ import annotations

__all__ = ["H100_NODE_ALL_REDUCE_US", "busbw_points"]

# (message bytes, out-of-place time in microseconds) for all_reduce over 8 ranks [DGXC].
H100_NODE_ALL_REDUCE_US: tuple[tuple[int, float], ...] = (
    (8, 13.67), (16, 13.00), (32, 68.14), (64, 14.92), (128, 15.87), (256, 16.10), (512, 16.70),
    (1024, 16.94), (2048, 17.14), (4096, 23.59), (8192, 17.40), (16384, 17.93), (32768, 19.33),
    (65536, 19.54), (131072, 19.89), (262144, 20.43), (524288, 20.66), (1048576, 27.37),
    (2097152, 42.21), (4194304, 54.19), (8388608, 83.04), (16777216, 123.8),
    (33554432, 199.3), (67108864, 324.7), (134217728, 586.4), (268435456, 1112.5),
    (536870912, 2151.0), (1073741824, 4029.4), (2147483648, 7939.1), (4294967296, 15749.0),
    (8589934592, 31307.0), (17179869184, 62648.0),
)


def busbw_points(sweep: tuple[tuple[int, float], ...], ranks: int, factor_of: str = "all_reduce"
                 ) -> tuple[tuple[float, float], ...]:
    """``sweep``'s ``(bytes, microseconds)`` on ``ranks`` ranks as ``(bytes, bus bandwidth in
    bytes/s)`` points (nccl-tests' busbw: ``factor * bytes / time``, factor ``2(n-1)/n`` for
    all-reduce, ``(n-1)/n`` otherwise). A sample slower than both its neighbours by over 30% is
    left out: in ``H100_NODE_ALL_REDUCE_US``, 32 B (68 us) and 4 KiB (24 us) against 13-17 us
    around them, noise rather than protocol."""
    factor = (2.0 if factor_of == "all_reduce" else 1.0) * (ranks - 1) / ranks
    points = []
    for i, (nbytes, us) in enumerate(sweep):
        around = [sweep[j][1] for j in (i - 1, i + 1) if 0 <= j < len(sweep)]
        if len(around) == 2 and us > 1.3 * max(around):
            continue  # slower than both neighbours by a third: a one-off sample
        points.append((float(nbytes), factor * nbytes / (us * 1e-6)))
    return tuple(points)
