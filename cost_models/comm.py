"""Alpha-beta costs of collectives on one mesh axis.

All times are seconds for one collective as seen by one device. ``nbytes`` is always the full,
unsharded buffer size S (for all-gather the gathered output, for reduce-scatter the input before
scattering), matching the nccl-tests convention (NVIDIA/nccl-tests doc/PERFORMANCE.md), and the
link bandwidth is the nccl-tests *bus* bandwidth, so the bandwidth terms below are exactly the
nccl-tests ideal times ``t = (S / busbw) * factor``.

Sources:
  [THAKUR] Thakur, Rabenseifner, Gropp, "Optimization of Collective Communication Operations in
           MPICH", IJHPCA 19(1), 2005, DOI 10.1177/1094342005051521: ring all-reduce
           ``2(p-1) alpha + 2 (p-1)/p n beta``; ring all-gather / reduce-scatter
           ``(p-1) alpha + (p-1)/p n beta``; pairwise-exchange all-to-all
           ``(p-1) alpha + (p-1)/p n beta``.
  [NCCLT]  NVIDIA/nccl-tests doc/PERFORMANCE.md: busbw factors 2(n-1)/n (AllReduce), (n-1)/n
           (AllGather, ReduceScatter, AlltoAll).
  [HOCKNEY] Hockney, "The communication challenge for MPP: Intel Paragon and Meiko CS-2",
           Parallel Computing 20(3), 1994: point-to-point ``alpha + n beta``.
  [HIER]   Hierarchical (2D) all-reduce over N nodes x g GPUs with one NIC rail per GPU:
           ``2 (g-1)/g S/B_intra + 2 (N-1)/N (S/g)/B_nic`` (benchmarks/data/calibration.json,
           derived from [THAKUR] + [NCCLT]; cf. Mikami et al. 2018, Jia et al. 2018).
The ``launch_s`` term is the fixed per-call overhead of the link (NCCL baseLat, see topology.py).
"""

from __future__ import annotations

from typing import Callable, Sequence

from autopar.cost_models.links import COLLECTIVE_KINDS, AxisLink
from autopar.cost_models.topology import Topology

__all__ = [
    "COLLECTIVE_KINDS",
    "all_reduce_time",
    "all_gather_time",
    "reduce_scatter_time",
    "all_to_all_time",
    "send_recv_time",
    "collective_time",
    "axis_collective_time",
    "axis_strides",
]


def _check(nbytes: float, n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"group size n must be an int >= 1, got {n!r}")
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes!r}")


def all_reduce_time(nbytes: float, n: int, link: AxisLink) -> float:
    """Ring all-reduce of an ``nbytes`` buffer over ``n`` ranks.

    ``launch + 2(n-1) * latency + 2(n-1)/n * nbytes / bw``; 0 when ``n == 1`` or nothing moves.
    A link with an all-reduce curve measured on ``n`` ranks (``AxisLink.busbw_by_size``) gives
    ``2(n-1)/n * nbytes / busbw(nbytes)`` instead (other rank counts keep the line: NVLS and
    the latency floor of fewer ranks are not measured).
    """
    _check(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    measured = link.busbw_at("all_reduce", nbytes, n)  # [NCCLT] time = factor * S / busbw(S)
    if measured is not None:
        return 2 * (n - 1) / n * nbytes / measured
    # [THAKUR] ring all-reduce = reduce-scatter + all-gather: 2(p-1) steps of n/p bytes each;
    # [NCCLT] busbw factor 2(n-1)/n.
    alpha = link.launch_s + 2 * (n - 1) * link.latency_s
    return alpha + 2 * (n - 1) / n * nbytes / link.bandwidth_for("all_reduce")


def all_gather_time(nbytes_out: float, n: int, link: AxisLink) -> float:
    """Ring all-gather producing an ``nbytes_out`` buffer (the full, gathered size) on ``n`` ranks.

    ``launch + (n-1) * latency + (n-1)/n * nbytes_out / bw``; 0 when ``n == 1``.
    """
    _check(nbytes_out, n)
    if n == 1 or nbytes_out == 0:
        return 0.0
    # [THAKUR] ring all-gather: p-1 steps, each forwarding one n/p shard; [NCCLT] factor (n-1)/n.
    return link.launch_s + (n - 1) * link.latency_s + (n - 1) / n * nbytes_out / link.bandwidth_for("all_gather")


def reduce_scatter_time(nbytes_in: float, n: int, link: AxisLink) -> float:
    """Ring reduce-scatter of an ``nbytes_in`` buffer (the full input size) over ``n`` ranks.

    ``launch + (n-1) * latency + (n-1)/n * nbytes_in / bw``; 0 when ``n == 1``. The reduction's
    arithmetic (Thakur's gamma term) is ignored: it is far below the transfer time on GPUs.
    """
    _check(nbytes_in, n)
    if n == 1 or nbytes_in == 0:
        return 0.0
    # [THAKUR] ring reduce-scatter: p-1 steps of n/p bytes; [NCCLT] factor (n-1)/n.
    return link.launch_s + (n - 1) * link.latency_s + (n - 1) / n * nbytes_in / link.bandwidth_for("reduce_scatter")


def all_to_all_time(nbytes: float, n: int, link: AxisLink) -> float:
    """Pairwise-exchange all-to-all; ``nbytes`` is what each rank sends in total (own chunk too).

    ``launch + (n-1) * latency + (n-1)/n * nbytes / bw``; 0 when ``n == 1``.
    """
    _check(nbytes, n)
    if n == 1 or nbytes == 0:
        return 0.0
    # [THAKUR] pairwise exchange: p-1 rounds, each sending one n/p chunk; [NCCLT] factor (n-1)/n.
    return link.launch_s + (n - 1) * link.latency_s + (n - 1) / n * nbytes / link.bandwidth_for("all_to_all")


def send_recv_time(nbytes: float, link: AxisLink) -> float:
    """Point-to-point transfer of ``nbytes`` between two ranks: ``launch + latency + nbytes/bw``."""
    _check(nbytes, 1)
    if nbytes == 0:
        return 0.0
    # [HOCKNEY] alpha + n * beta, alpha = launch + one hop.
    return link.launch_s + link.latency_s + nbytes / link.bandwidth_for("send_recv")


_FLAT: dict[str, Callable[[float, int, AxisLink], float]] = {
    "all_reduce": all_reduce_time,
    "all_gather": all_gather_time,
    "reduce_scatter": reduce_scatter_time,
    "all_to_all": all_to_all_time,
}


def _check_kind(kind: str) -> None:
    if kind not in COLLECTIVE_KINDS:
        raise ValueError(
            f"unknown collective kind {kind!r}; valid kinds: {', '.join(COLLECTIVE_KINDS)}"
        )


def collective_time(kind: str, nbytes: float, n: int, link: AxisLink) -> float:
    """Time of collective ``kind`` (one of :data:`COLLECTIVE_KINDS`) over ``n`` ranks on ``link``.

    ``send_recv`` is one point-to-point transfer of ``nbytes`` (0 when ``n == 1``: no peer).
    """
    _check_kind(kind)
    _check(nbytes, n)
    if n == 1:
        return 0.0
    if kind == "send_recv":
        return send_recv_time(nbytes, link)
    return _FLAT[kind](nbytes, n, link)


def axis_strides(mesh_shape: Sequence[int]) -> list[int]:
    """Each mesh axis's stride: the product of the sizes of the axes after it (the ``stride``
    :func:`axis_collective_time` takes)."""
    out, acc = [], 1
    for size in reversed(mesh_shape):
        out.append(acc)
        acc *= size
    return list(reversed(out))


def axis_collective_time(
    kind: str, nbytes: float, axis_size: int, stride: int, topology: Topology
) -> float:
    """Collective ``kind`` over one mesh axis, hierarchical when the axis spans nodes.

    ``stride`` is the product of the sizes of the inner (later) mesh axes (see
    :meth:`Topology.link_for_axis`). Cases, with g = ranks of the axis per node, N = nodes:

    * axis inside one node: flat ring on ``intra_node``;
    * one rank per node (``stride >= gpus_per_node``) or an irregular layout: flat ring on
      ``inter_node`` (every ring step crosses a NIC);
    * g > 1 ranks per node: two levels, with the g NIC rails of a node working in parallel
      ([HIER]): all-reduce = intra reduce-scatter(S) + inter all-reduce(S/g) + intra
      all-gather(S); all-gather = inter all-gather(S/g) + intra all-gather(S); reduce-scatter =
      intra reduce-scatter(S) + inter reduce-scatter(S/g); all-to-all sends (n-g)/n of S over the
      NIC and (g-1)/n of S over NVLink; send/recv crosses a NIC.
    """
    _check_kind(kind)
    _check(nbytes, axis_size)
    link = topology.link_for_axis(axis_size, stride)
    if axis_size == 1 or link is topology.intra_node:
        return collective_time(kind, nbytes, axis_size, link)
    gpn = topology.gpus_per_node
    g = gpn // stride if stride < gpn and gpn % stride == 0 else 1
    if g <= 1 or axis_size % g != 0 or kind == "send_recv":
        return collective_time(kind, nbytes, axis_size, topology.inter_node)
    n_nodes = axis_size // g
    intra, inter = topology.intra_node, topology.inter_node
    if kind == "all_reduce":
        return (
            reduce_scatter_time(nbytes, g, intra)
            + all_reduce_time(nbytes / g, n_nodes, inter)
            + all_gather_time(nbytes, g, intra)
        )
    if kind == "all_gather":
        return all_gather_time(nbytes / g, n_nodes, inter) + all_gather_time(nbytes, g, intra)
    if kind == "reduce_scatter":
        return reduce_scatter_time(nbytes, g, intra) + reduce_scatter_time(
            nbytes / g, n_nodes, inter
        )
    # all_to_all: pairwise exchange over n-1 peers; the chunks for the other nodes leave over this
    # rank's NIC rail, those for the g-1 local peers over NVLink ([THAKUR] per link class).
    if nbytes == 0:
        return 0.0
    n = axis_size
    return (
        inter.launch_s
        + (n - 1) * inter.latency_s
        + (n - g) / n * nbytes / inter.bandwidth_for("all_to_all")
        + (g - 1) / n * nbytes / intra.bandwidth_for("all_to_all")
    )
