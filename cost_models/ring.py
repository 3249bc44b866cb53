"""What ring attention (``autopar.passes.ring_attention``) sends and how long it takes.

With ``n`` ranks on the ring axis, a rank runs the kernel on ``n`` blocks (its queries against
each rank's keys), each taking ``t_block``, the kernel's time at the local shapes, as the
gathered form's kernel (queries against every key) is priced at once. Under a causal mask the
op skips the blocks above the diagonal and the kernel computes half of the diagonal block; the
last rank of the contiguous split skips none, so its time is the node's: its first block (the
diagonal) takes ``t_first = t_block / 2`` (``t_block`` without a causal mask). With the
balanced split (``autopar.sequence_layout``: rank r holds chunks r and 2n-1-r) every step of
every rank computes half a block: ``t_first`` and each ``t_block`` are half the kernel's time
on a block. Each block's
exchange is issued before its kernel and waited for after it, so a step lasts as long as the
longer of the two (Liu et al., 2023, sec. 3: the exchange hides behind the blockwise compute
when the block is long enough):

- forward: ``max(t_first, t_kv) + (n - 2) * max(t_block, t_kv) + t_block``, ``t_kv`` the send
  of the stacked keys and values of one block to the next rank
  (:func:`~autopar.cost_models.comm.send_recv_time`; over a NIC when the axis spans nodes);
- backward: ``max(t_first, t_kv) + (n - 2) * max(t_block, t_kv + t_dkv) + max(t_block, t_dkv)
  + t_dkv``: the keys' and values' gradients (float32, ``t_dkv``) travel with them, each sent
  after its block's kernel while the next block computes, and the last exchange brings them
  home after the last kernel.
"""

from __future__ import annotations

from typing import Any, Sequence

from torch.distributed.tensor import Shard

from autopar.cost_models.comm import axis_collective_time, axis_strides
from autopar.cost_models.topology import Topology
from autopar.strategies.reshard import local_shape
from autopar.strategies.rules import ATTENTION_FORWARD, SEQ_DIM, SEQUENCE_ATTENTION_QUERY

__all__ = ["RING_GRAD_ITEMSIZE", "ring_axis", "ring_exchanges", "ring_seconds",
           "ring_workspace_bytes"]

RING_GRAD_ITEMSIZE = 4  # the keys' and values' gradients travel in float32


def ring_axis(target: Any, placements: Sequence[Sequence[Any]]) -> int | None:
    """The mesh axis over which an attention node's strategy (``placements`` of its tensor
    inputs) runs the ring, its keys sharded on the sequence there; ``None``: not the ring
    form. More than one such axis is refused (the ring runs on one)."""
    if target not in SEQUENCE_ATTENTION_QUERY or len(placements) <= SEQUENCE_ATTENTION_QUERY[target] + 1:
        return None
    keys = placements[SEQUENCE_ATTENTION_QUERY[target] + 1]
    axes = [a for a, p in enumerate(keys) if isinstance(p, Shard) and p.dim == SEQ_DIM]
    if len(axes) > 1:
        raise ValueError(f"attention's keys are sharded on the sequence over mesh axes {axes} "
                         f"({tuple(keys)}); ring attention runs over one axis (the cp axis).")
    return axes[0] if axes else None


def _block_bytes(target: Any, placements: Sequence[Sequence[Any]], shapes: Sequence[tuple],
                 itemsize: int, mesh_shape: Sequence[int]) -> tuple[float, float]:
    """Bytes of one block's stacked keys and values, and of their gradients (float32)."""
    key = SEQUENCE_ATTENTION_QUERY[target] + 1
    numel = 1
    for d in local_shape(shapes[key], placements[key], tuple(mesh_shape)):
        numel *= d
    return float(2 * numel * itemsize), float(2 * numel * RING_GRAD_ITEMSIZE)


def ring_exchanges(target: Any, placements: Sequence[Sequence[Any]], shapes: Sequence[tuple],
                   itemsize: int, mesh_shape: Sequence[int]) -> list[tuple[str, int, float]]:
    """The messages of one ring-attention node as ``(kind, axis, bytes)`` in the order a rank
    issues them, a ``send`` and a ``recv`` per exchange; none for another node."""
    axis = ring_axis(target, placements)
    if axis is None:
        return []
    kv, dkv = _block_bytes(target, placements, shapes, itemsize, mesh_shape)
    n = mesh_shape[axis]
    # backward, per step: the next block's keys and values, then this block's gradients
    steps = [kv] * (n - 1) if target in ATTENTION_FORWARD else [kv, dkv] * (n - 1) + [dkv]
    return [(kind, axis, nbytes) for nbytes in steps for kind in ("send", "recv")]


def ring_seconds(target: Any, placements: Sequence[Sequence[Any]], shapes: Sequence[tuple],
                 itemsize: int, mesh_shape: Sequence[int], topology: Topology,
                 block_s: float, causal: bool = False, balanced: bool = False) -> float:
    """Seconds of one ring-attention node on a rank (see the module docstring), ``block_s``
    the kernel's time on one block (its local shapes), ``causal``: the node's ``is_causal``,
    ``balanced``: the sequence held in chunk pairs (``autopar.sequence_layout``), where every
    step of a causal node computes half a block."""
    axis = ring_axis(target, placements)
    n = mesh_shape[axis]
    if causal and balanced:
        block_s = block_s / 2
    first = block_s / 2 if causal and not balanced else block_s
    if n == 1:
        return first
    kv, dkv = _block_bytes(target, placements, shapes, itemsize, mesh_shape)
    stride = axis_strides(mesh_shape)[axis]
    t_kv, t_dkv = (axis_collective_time("send_recv", b, n, stride, topology) for b in (kv, dkv))
    if target in ATTENTION_FORWARD:
        return max(first, t_kv) + (n - 2) * max(block_s, t_kv) + block_s
    return (max(first, t_kv) + (n - 2) * max(block_s, t_kv + t_dkv) + max(block_s, t_dkv)
            + t_dkv)


def ring_workspace_bytes(target: Any, placements: Sequence[Sequence[Any]],
                         shapes: Sequence[tuple], itemsize: int, mesh_shape: Sequence[int]) -> float:
    """Bytes a ring-attention node holds while it runs beyond its inputs and outputs: the
    block of stacked keys and values it holds and the one arriving, a block's kernel outputs,
    and the float32 accumulators (the output and its log-sum-exp in the forward; the queries'
    gradient and the keys' and values' gradients held and arriving in the backward); 0 for
    another node."""
    if ring_axis(target, placements) is None:
        return 0.0
    kv, dkv = _block_bytes(target, placements, shapes, itemsize, mesh_shape)
    query = SEQUENCE_ATTENTION_QUERY[target]
    q_numel = 1
    for d in local_shape(shapes[query], placements[query], tuple(mesh_shape)):
        q_numel *= d
    q = q_numel * itemsize
    if target in ATTENTION_FORWARD:  # kv held and arriving; the block's output; out and lse in float32
        return 2 * kv + q + q_numel * RING_GRAD_ITEMSIZE * (1 + 1 / shapes[query][-1])
    # kv held and arriving, dkv held and arriving, the block's three gradients, dq in float32
    return 2 * kv + 2 * dkv + q + kv + q_numel * RING_GRAD_ITEMSIZE
