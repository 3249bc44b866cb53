"""Fused attention kernels priced at the rates measured for them, not as one more matmul.

A fused attention kernel (FlashAttention and its successors, cuDNN's) does not run at a dense
GEMM's efficiency, and with a causal mask it skips the key blocks wholly above the diagonal
([FA2] Dao 2023, section 3.1.1: "we only need to compute 1/2 of the blocks"). A topology may
carry ``attention_efficiency``: rows ``(direction, causal, head_dim, seq, efficiency)``, the
fraction of the bf16 peak the kernel reaches on the FLOPs it executes, measured at each head dim
and sequence. The FLOPs executed are torch's count (``sdpa_flop_count``, ``4 b h s_q s_k d``
forward, ``10 b h s_q s_k d`` backward, [TFC]) times :func:`causal_fraction`: with the mask,
the blocks on or below the diagonal of a square of ``TILE``-token blocks.

A topology without rows prices attention as before, as a matmul of all its FLOPs at the matmul
efficiency: right for kernels that compute the whole score matrix and mask it afterwards (the
unfused attention of Megatron-LM in 2021-2022, the ``a100-dgx`` rows) and for presets nobody
has measured. fp32 attention is priced that way too (the rows are bf16 kernels).

The H100 and H200 rows are the kernel sweeps' ``sdpa`` rows (``python
benchmarks/kernel_sweep.py``; ``benchmarks/data/h100_kernel_sweep.json`` and
``h200_kernel_sweep.json``, torch 2.11 ``scaled_dot_product_attention`` in bf16, 16,384 tokens
a call, heads of 64 and 128): measured, not fitted on any training run. A call between two
measured sequences or head dims is interpolated (linearly in log2 of the sequence, linearly in
the head dim) and one outside them takes the nearest measured value.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from autopar.sequence_layout import SequenceLayout, query_runs

__all__ = ["ATTENTION_KERNELS", "H100_SDPA", "H100_SDPA_TABLE", "H200_SDPA", "H200_SDPA_TABLE",
           "TILE", "AttentionCall", "attention_call", "attention_seconds", "causal_fraction",
           "check_rows", "efficiency", "gathered_calls", "gathered_seconds", "rows_from_table"]

aten = torch.ops.aten

# FlashAttention's query and key blocks are 64-128 tokens ([FA2] section 3.1; [FA3] 128 x 128
# and 128 x 176 for head dim 128); 128 is the block the causal skip is counted in.
TILE = 128

# The fused attention ops a graph holds: direction, the index of the query among the positional
# arguments, and the index of ``is_causal`` (read from each op's schema in torch 2.11-2.13).
ATTENTION_KERNELS: dict[Any, tuple[str, int, int]] = {
    aten._scaled_dot_product_flash_attention_for_cpu.default: ("fwd", 0, 4),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: ("bwd", 1, 7),
    aten._scaled_dot_product_flash_attention.default: ("fwd", 0, 4),
    aten._scaled_dot_product_flash_attention_backward.default: ("bwd", 1, 11),
    aten._scaled_dot_product_efficient_attention.default: ("fwd", 0, 6),
    aten._scaled_dot_product_efficient_attention_backward.default: ("bwd", 1, 11),
    aten._scaled_dot_product_cudnn_attention.default: ("fwd", 0, 6),
    aten._scaled_dot_product_cudnn_attention_backward.default: ("bwd", 1, 14),
}

_SEQS = (512, 1024, 2048, 4096, 8192)  # the sweeps' sequences, for the tables below

# Efficiency on the executed FLOPs, per (direction, causal, head dim), at the sequences _SEQS:
# benchmarks/data/h100_kernel_sweep.json (NVIDIA H100 80GB HBM3, 2026-11-27), on 989 TFLOP/s.
H100_SDPA_TABLE: Mapping[tuple[str, bool, int], tuple[float, ...]] = {
    ("fwd", False, 64): (0.390, 0.430, 0.463, 0.470, 0.468),
    ("fwd", False, 128): (0.519, 0.601, 0.643, 0.629, 0.632),
    ("fwd", True, 64): (0.327, 0.383, 0.424, 0.415, 0.464),
    ("fwd", True, 128): (0.398, 0.473, 0.554, 0.560, 0.609),
    ("bwd", False, 64): (0.217, 0.305, 0.374, 0.425, 0.459),
    ("bwd", False, 128): (0.246, 0.374, 0.443, 0.504, 0.550),
    ("bwd", True, 64): (0.134, 0.228, 0.302, 0.362, 0.411),
    ("bwd", True, 128): (0.190, 0.283, 0.332, 0.408, 0.478),
}
# benchmarks/data/h200_kernel_sweep.json (NVIDIA H200, 2026-11-27), on 989 TFLOP/s.
H200_SDPA_TABLE: Mapping[tuple[str, bool, int], tuple[float, ...]] = {
    ("fwd", False, 64): (0.389, 0.405, 0.458, 0.473, 0.488),
    ("fwd", False, 128): (0.510, 0.588, 0.616, 0.641, 0.677),
    ("fwd", True, 64): (0.319, 0.382, 0.422, 0.442, 0.461),
    ("fwd", True, 128): (0.433, 0.483, 0.533, 0.576, 0.589),
    ("bwd", False, 64): (0.265, 0.314, 0.382, 0.450, 0.474),
    ("bwd", False, 128): (0.298, 0.389, 0.451, 0.500, 0.560),
    ("bwd", True, 64): (0.173, 0.191, 0.290, 0.383, 0.426),
    ("bwd", True, 128): (0.253, 0.312, 0.379, 0.437, 0.510),
}

Row = tuple[str, bool, int, int, float]


def rows_from_table(table: Mapping[tuple[str, bool, int], Sequence[float]],
                    seqs: Sequence[int] = _SEQS) -> tuple[Row, ...]:
    """A table of efficiencies by sequence as the rows a :class:`Topology` holds."""
    return tuple((d, c, h, s, float(e)) for (d, c, h), es in table.items() for s, e in zip(seqs, es))


H100_SDPA = rows_from_table(H100_SDPA_TABLE)
H200_SDPA = rows_from_table(H200_SDPA_TABLE)


def check_rows(rows: Sequence[Sequence[Any]]) -> tuple[Row, ...]:
    """``rows`` as a tuple of ``(direction, causal, head_dim, seq, efficiency)``; raises
    ``ValueError`` naming the first row that is not one ("fwd"/"bwd", a bool, two ints >= 1, an
    efficiency in (0, 1])."""
    out = []
    for i, row in enumerate(rows):
        ok = (isinstance(row, (tuple, list)) and len(row) == 5 and row[0] in ("fwd", "bwd")
              and isinstance(row[1], bool) and all(isinstance(v, int) and v >= 1 for v in row[2:4])
              and isinstance(row[4], (int, float)) and 0 < row[4] <= 1)
        if not ok:
            raise ValueError(f"Topology.attention_efficiency[{i}] = {row!r}; each row must be "
                             f"(direction 'fwd' or 'bwd', causal bool, head_dim int, seq int, "
                             f"efficiency in (0, 1]), as cost_models/attention.py describes")
        out.append((row[0], row[1], row[2], row[3], float(row[4])))
    return tuple(out)


def causal_fraction(s_q: int, s_k: int, tile: int = TILE) -> float:
    """The share of the score matrix a causal kernel computes: of ``n x n`` blocks of ``tile``
    tokens, the ``n (n + 1) / 2`` on or below the diagonal. Queries and keys of different
    lengths are counted whole (:func:`attention_seconds` prices them as unmasked)."""
    if s_q != s_k:
        return 1.0
    n = max(1, math.ceil(s_q / tile))
    return (n + 1) / (2 * n)


def gathered_calls(runs: Sequence[tuple[int, int, int]], causal: bool, keys: int
                   ) -> list[tuple[slice, slice, bool]]:
    """The kernel calls of the gathered form run in blocks (``autopar.passes.attention_blocks``,
    CUDA's kernels): ``(rows, keys, causal)``. ``runs``: the rank's query rows as ``(first row,
    its position, count)``, consecutive positions each
    (:func:`autopar.sequence_layout.query_runs`). Without a causal mask, every row against
    every key at once; with it, each run against the keys before it (unmasked) and against its
    own positions (the kernel's causal mask on a square block, where every kernel aligns it
    alike), so the keys after a query are skipped as the whole kernel skips them."""
    total = sum(c for _, _, c in runs)
    if not causal:
        return [(slice(0, total), slice(0, keys), False)]
    calls = []
    for row, pos, count in runs:
        rows = slice(row, row + count)
        if pos:
            calls.append((rows, slice(0, pos), False))
        calls.append((rows, slice(pos, pos + count), True))
    return calls


def gathered_seconds(call: "AttentionCall", flops: float, batch_heads: int, itemsize: int,
                     balanced: bool, topology: Any,
                     kernel_seconds: Callable[["AttentionCall", float], float],
                     rank: int | None = None) -> float | None:
    """Seconds of a causal attention node of the gathered form (its queries ``call.s_q`` of
    the ``call.s_k`` positions, the keys whole) on a CUDA ``topology``, where the lowering runs
    it in blocks (:func:`gathered_calls`), on its slowest rank (or on ``rank``): each block's
    kernel at its own shape (``kernel_seconds(block call, its FLOPs)``, the caller's price of
    one kernel call) and the blocks' memory traffic at the pointwise rate (:func:`_block_bytes`).
    With the ``balanced`` chunk pairs every rank computes as many scores, in 2 to 4 calls (a
    rank whose chunks are neighbours joins them; rank 0's first chunk has no keys before it);
    with contiguous blocks the last rank computes the most. ``None`` for any other node (not
    causal, queries as many as the keys, a CPU topology: CPU's kernel takes an explicit mask
    and is priced as one call). ``flops``: torch's whole-matrix count of the node,
    ``batch_heads``: its local batch times heads."""
    if (topology.device_type == "cpu" or not call.causal or call.s_q >= call.s_k
            or call.s_k % call.s_q):
        return None
    n = call.s_k // call.s_q
    layout = SequenceLayout(0, n) if balanced and call.s_k % (2 * n) == 0 else None
    per_score = flops / (call.s_q * call.s_k)
    rate = topology.mem_bandwidth_Bps * topology.pointwise_efficiency
    times = []
    for r in range(n) if rank is None else [rank]:
        calls = gathered_calls(query_runs(call.s_k, r * call.s_q, call.s_q, layout), True,
                               call.s_k)
        kernels = sum(kernel_seconds(AttentionCall(call.direction, c, b.stop - b.start,
                                                   k.stop - k.start, call.head_dim),
                                     per_score * (b.stop - b.start) * (k.stop - k.start))
                      for b, k, c in calls)
        times.append(kernels + batch_heads * _block_bytes(call, calls, itemsize) / rate)
    return max(times)


def _block_bytes(call: "AttentionCall", calls: list[tuple[slice, slice, bool]],
                 itemsize: int) -> float:
    """Bytes the blocks move per batch and head beyond their kernels
    (``autopar.passes.attention_blocks``): each block's operands copied (read and written);
    in the forward, each block's float32 merge (the running output read and written, the
    block's output read), the accumulators zeroed and cast at the end (none for a single call,
    returned as the kernel gives it); in the backward, the float32 gradients of the queries and
    of the whole keys and values zeroed, each block's shares added and the sums cast."""
    d, forward = call.head_dim, call.direction == "fwd"
    moved = 0.0
    for rows, keys, _ in calls:
        r, k = rows.stop - rows.start, keys.stop - keys.start
        if forward:
            moved += 2 * (r + 2 * k) * d * itemsize + (r * d * (8 + itemsize) if len(calls) > 1 else 0)
        else:
            moved += 2 * (3 * r + 2 * k) * d * itemsize + (r + 2 * k) * d * (8 + itemsize)
    if forward and len(calls) == 1:
        return moved
    return moved + (call.s_q + (0 if forward else 2 * call.s_k)) * d * (4 + 4 + itemsize)


def _interp(points: Sequence[tuple[float, float]], x: float) -> float:
    """Linear interpolation over sorted ``(x, y)`` points, the nearest ``y`` outside them."""
    xs = [p[0] for p in points]
    i = bisect.bisect_left(xs, x)
    if i == 0:
        return points[0][1]
    if i == len(points):
        return points[-1][1]
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def efficiency(rows: Sequence[Row], direction: str, causal: bool, head_dim: int, seq: int
               ) -> float | None:
    """The rows' efficiency at ``head_dim`` and ``seq`` (see the module's text), ``None`` when
    no row has this direction and mask."""
    by_dim: dict[int, list[tuple[float, float]]] = {}
    for d, c, h, s, e in rows:
        if d == direction and c == causal:
            by_dim.setdefault(h, []).append((math.log2(s), e))
    if not by_dim:
        return None
    at_seq = sorted((h, _interp(sorted(pts), math.log2(max(seq, 1)))) for h, pts in by_dim.items())
    return _interp(at_seq, head_dim)


@dataclass(frozen=True)
class AttentionCall:
    """One fused attention node as the pricing sees it: direction ("fwd" or "bwd"), whether it
    asks for the causal mask, and its local query and key lengths and head dim."""

    direction: str
    causal: bool
    s_q: int
    s_k: int
    head_dim: int


def attention_call(target: Any, args: Sequence[Any], kwargs: Mapping[str, Any],
                   query_shape: Sequence[int], key_shape: Sequence[int]) -> AttentionCall | None:
    """The call of ``target`` (``None`` when it is not in :data:`ATTENTION_KERNELS`), with the
    local ``[batch, heads, seq, head_dim]`` shapes of its query and key."""
    spec = ATTENTION_KERNELS.get(target)
    if spec is None:
        return None
    direction, _, causal_at = spec
    causal = bool(args[causal_at]) if len(args) > causal_at else bool(kwargs.get("is_causal", False))
    return AttentionCall(direction, causal, int(query_shape[-2]), int(key_shape[-2]),
                         int(query_shape[-1]))


def attention_seconds(call: AttentionCall, flops: float, nbytes: float, dtype: str,
                      topology: Any) -> float | None:
    """Seconds of a fused attention kernel of ``flops`` (torch's whole-matrix count) on
    ``topology`` (a :class:`~autopar.cost_models.topology.Topology`; not imported here, the
    topology module imports this one), ``None`` when the topology has no measured rate for it
    (then it is priced as a matmul). ``dtype`` is the peak's name (:func:`autopar.cost_models.compute.matmul_peak`)."""
    rows = topology.attention_efficiency
    if not rows or dtype != "bf16":
        return None
    # queries fewer than the keys under a causal mask (context parallelism's gathered keys):
    # CPU's kernel runs them with an explicit mask (passes/seq_attention.py), an unmasked
    # kernel's work and rate; CUDA's in blocks, priced by gathered_seconds
    causal = call.causal and call.s_q == call.s_k
    e = efficiency(rows, call.direction, causal, call.head_dim, call.s_k)
    if e is None:
        return None
    executed = flops * (causal_fraction(call.s_q, call.s_k) if causal else 1.0)
    memory = nbytes / (topology.mem_bandwidth_Bps * topology.pointwise_efficiency)
    return max(executed / (topology.peak_flops_for("bf16") * e), memory)
