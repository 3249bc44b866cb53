"""Ring attention: attention with its queries, keys and values all sharded on the sequence over
one mesh axis, the keys and values passed around the axis's ranks in blocks (Liu, Zaharia and
Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context", 2023; the
context parallelism of Megatron-LM and torchtitan).

Requires: a node of fused attention (CPU's flash kernel, CUDA's cuDNN, FlashAttention or
memory-efficient kernel; or a backward) whose planned strategy shards every tensor on the
sequence dim 2 over one mesh axis (the rules' ring form, ``autopar.strategies.rules``), an
attention mask, if any (CPU's kernel only), with its rows sharded and its key columns whole.
Guarantees: the planned outputs, equal to the rank's rows of one device's attention.

Forward (``autopar::ring_attention``): with ``n`` ranks on the axis, rank ``r`` starts with its
own block of keys and values; at step ``t`` it holds block ``(r - t) mod n``, starts sending it
to rank ``r + 1`` (and receiving the next from ``r - 1``), runs the kernel on its queries
against the block, and merges the block's output into its running one by their log-sum-exps
(``lse = logaddexp(lse, lse_t)``; ``out = out * exp(lse_old - lse) + out_t * exp(lse_t - lse)``,
in float32). A causal node runs the kernel's own causal mask on the diagonal block (the rank's
own positions, ascending, for queries and keys) and of every other block only what the mask
keeps (:class:`RingStep`): with contiguous blocks, the blocks before the rank's own whole and
none after; with the balanced chunk pairs (``autopar.sequence_layout``), half of every block.
``n - 1`` sends and receives of the stacked keys and values per rank.

Backward (``autopar::ring_attention_backward``): the same ring; with the whole row's output and
log-sum-exp, the kernel's backward on a block gives that block's exact share of every gradient
(its softmax probabilities are the whole row's), so the rank adds the queries' share to its own
and adds the keys' and values' share to an accumulator (float32) that travels with them and is
back at its owner after ``n`` exchanges. ``n - 1`` exchanges of the keys and values and ``n``
of their gradients per rank.

The ops run their sends and receives on the group inside themselves (``batch_isend_irecv``,
each issued before the block's kernel and waited for after it), so the traced per-rank program
holds one opaque node per attention; :data:`autopar.comm_ops.OPS_WITH_COLLECTIVES` lists them
so that the collective meter sees their messages. The plan lists them too
(:func:`autopar.cost_models.ring.ring_exchanges`).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.comm_ops import group_rank_size, register_op_with_collectives
from autopar.cost_models.ring import ring_axis
from autopar.passes.attention_blocks import (KERNELS, block_backward, block_forward,
                                             extra_arguments, kernel_tensors, lse_native,
                                             lse_rows, merge, wrap_outputs)
from autopar.sequence_layout import SequenceLayout
from autopar.strategies.rules import (ATTENTION_FORWARD, SEQ_DIM, SEQUENCE_ATTENTION_QUERY,
                                      attention_is_causal)

__all__ = ["RingStep", "needs_ring", "ring_attention", "ring_attention_backward", "ring_backward",
           "ring_forward", "run_ring"]


class _Ring:
    """The neighbours of this rank on the ring of a process group."""

    def __init__(self, group: str) -> None:
        self.pg, self.me, self.size = group_rank_size(group)
        if self.pg is not None:
            self.next = dist.get_global_rank(self.pg, (self.me + 1) % self.size)
            self.prev = dist.get_global_rank(self.pg, (self.me - 1) % self.size)

    def start(self, buf: torch.Tensor) -> tuple[torch.Tensor, list]:
        """Send ``buf`` to the next rank and receive the previous rank's (not waited for); a
        ring of one rank (no group) hands ``buf`` back."""
        if self.pg is None:
            return buf, []
        got = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, self.next, self.pg),
               dist.P2POp(dist.irecv, got, self.prev, self.pg)]
        return got, dist.batch_isend_irecv(ops)

    @staticmethod
    def finish(pending: tuple[torch.Tensor, list]) -> torch.Tensor:
        got, works = pending
        for w in works:
            w.wait()
        return got


class RingStep:
    """What a rank computes on the block of keys that rank ``src`` started with: its query rows
    ``rows`` against the block's keys ``keys`` (slices of the local sequence, ``None`` for the
    step skipped), with the kernel's own causal mask or not, and the block's key columns of a
    mask whose columns are whole.

    Contiguous split: block ``src`` holds positions ``[src * size, (src + 1) * size)``; under a
    causal mask the blocks after the rank's own are skipped and the diagonal one is causal.
    Balanced split (``autopar.sequence_layout``: rank r holds chunks r and 2n-1-r, each half
    a block, ascending): under a causal mask the diagonal block is causal as a whole; a block of
    an earlier rank is seen whole by every query, but only through its first chunk (its second
    is after both of the rank's); a later rank's block is seen whole by the rank's second chunk
    only (its first is before both of that block's). Every step computes half a block."""

    def __init__(self, src: int, me: int, n: int, size: int, causal: bool, balanced: bool) -> None:
        whole, half = slice(0, size), size // 2
        self.src, self.n, self.size, self.balanced = src, n, size, balanced
        self.rows, self.keys, self.causal = whole, whole, causal and src == me
        if causal and src != me:
            if not balanced:
                self.rows = None if src > me else whole
            elif src < me:
                self.keys = slice(0, half)
            else:
                self.rows = slice(half, size)

    def mask(self, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The mask's block: the step's key columns (and query rows, when it has them)."""
        if mask is None:
            return None
        if self.balanced:
            h = self.size // 2
            first, second = self.src * h, (2 * self.n - 1 - self.src) * h
            cols = torch.cat([mask[..., first:first + h], mask[..., second:second + h]], -1)
        else:
            cols = mask[..., self.src * self.size:(self.src + 1) * self.size]
        cols = cols[..., self.keys]
        return cols[..., self.rows, :] if cols.shape[-2] > 1 else cols


def _masked_rows(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """Rows of an additive mask block with every key masked (the kernel returns 0 and a
    log-sum-exp of 0 for them, which must not count), broadcast to ``like`` ``[b, h, s]``."""
    if mask is None:
        return None
    rows = torch.isneginf(mask).all(-1)
    return rows.expand(like.shape) if rows.any() else None


def ring_forward(ring: Any, kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 causal: bool, scale: float | None, mask: torch.Tensor | None, balanced: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's rows of attention and their log-sum-exp (see the module docstring) on
    ``ring`` (``me``, ``size``, ``start(buf)`` and ``finish(pending)``, as a process group's
    ring has them), each block by the ``kernel`` (``attention_blocks.KERNELS``)."""
    kv = torch.stack([k, v])
    size = k.shape[SEQ_DIM]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    like = None  # the kernel's outputs on the rank's own block: the strides to return in
    for t in range(ring.size):
        step = RingStep((ring.me - t) % ring.size, ring.me, ring.size, size, causal, balanced)
        pending = ring.start(kv) if t < ring.size - 1 else None
        if step.rows is not None:
            rows, keys = step.rows, step.keys
            m = step.mask(mask)
            o, lse_t = block_forward(kernel, q[..., rows, :], kv[0][..., keys, :],
                                     kv[1][..., keys, :], step.causal, scale, m)
            like = like or (o, lse_t)
            lse_t = lse_t.float()
            dead = _masked_rows(m, lse_t)
            if dead is not None:
                lse_t = lse_t.masked_fill(dead, float("-inf"))
            out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], o, lse_t)
        if pending is not None:
            kv = ring.finish(pending)
    # a row with every key masked: output 0 and log-sum-exp 0, as the kernel gives it (with
    # -inf, the backward's exp(score - lse) would be NaN)
    lse = lse.masked_fill(torch.isneginf(lse), 0.0)
    return (torch.empty_like(like[0]).copy_(out),
            lse_native(kernel, torch.empty_like(like[1]).copy_(lse)))


def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float | None, mask: torch.Tensor | None, group: str, balanced: bool,
                    kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    return ring_forward(_Ring(group), kernel, q, k, v, causal, scale, mask, balanced)


ring_attention = torch.library.custom_op("autopar::ring_attention", mutates_args=())(_ring_attention)


@ring_attention.register_fake
def _ring_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         scale: float | None, mask: torch.Tensor | None, group: str,
                         balanced: bool, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    out, lse = block_forward(kernel, q, k, v, causal, scale, mask)  # (its layouts)
    return out, lse_native(kernel, lse)


def ring_backward(ring: Any, kernel: str, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                  scale: float | None, mask: torch.Tensor | None, balanced: bool,
                  extra: Sequence[Any] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of the rank's queries, keys and values (see the module docstring) on
    ``ring`` (as :func:`ring_forward`'s); ``extra``: ``attention_blocks.extra_arguments`` of
    the backward node."""
    lse = lse_rows(kernel, lse)
    kv = torch.stack([k, v])
    size = k.shape[SEQ_DIM]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    incoming = None  # the keys' and values' gradients of the block held, on their way here
    like = None  # the kernel's gradients of the rank's own block: the strides to return in
    for t in range(ring.size):
        step = RingStep((ring.me - t) % ring.size, ring.me, ring.size, size, causal, balanced)
        pending = ring.start(kv) if t < ring.size - 1 else None
        share = None
        if step.rows is not None:
            rows, keys = step.rows, step.keys
            share = block_backward(kernel, grad[..., rows, :], q[..., rows, :],
                                   kv[0][..., keys, :], kv[1][..., keys, :], out[..., rows, :],
                                   lse[..., rows], step.causal, scale, step.mask(mask), extra)
        dkv = (ring.finish(incoming) if incoming is not None
               else torch.zeros(kv.shape, dtype=torch.float32, device=kv.device))
        if share is not None:
            like = like or share
            dq[..., rows, :] += share[0]
            dkv[0][..., keys, :] += share[1]
            dkv[1][..., keys, :] += share[2]
        incoming = ring.start(dkv)
        if pending is not None:
            kv = ring.finish(pending)
    dkv = ring.finish(incoming)
    return tuple(torch.empty_like(t).copy_(g) for t, g in zip(like, (dq, dkv[0], dkv[1])))


def _ring_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                             scale: float | None, mask: torch.Tensor | None, group: str,
                             balanced: bool, kernel: str, extra: list[Optional[torch.Tensor]]
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return ring_backward(_Ring(group), kernel, grad, q, k, v, out, lse, causal, scale, mask,
                         balanced, extra)


ring_attention_backward = torch.library.custom_op(
    "autopar::ring_attention_backward", mutates_args=())(_ring_attention_backward)


@ring_attention_backward.register_fake
def _ring_attention_backward_fake(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                  causal: bool, scale: float | None, mask: torch.Tensor | None,
                                  group: str, balanced: bool, kernel: str,
                                  extra: list[Optional[torch.Tensor]]
                                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return block_backward(kernel, grad, q, k, v, out, lse, causal, scale, mask, extra)


register_op_with_collectives(torch.ops.autopar.ring_attention.default, _ring_attention)
register_op_with_collectives(torch.ops.autopar.ring_attention_backward.default,
                             _ring_attention_backward)


def needs_ring(target: Any, in_placements: Sequence[tuple]) -> bool:
    """Whether a node is attention in the ring form (its keys sharded on the sequence)."""
    return ring_axis(target, in_placements) is not None




def run_ring(n: Any, args: tuple, kwargs: dict, out_placements: Sequence[tuple], mesh: Any,
             layout: SequenceLayout | None = None) -> tuple[DTensor, ...]:
    """Run the node as ring attention on the ring of its keys' sharded axis; the planned
    DTensors. ``layout``: the plan's balanced cp layout, if any (each block a chunk pair)."""
    tensors = [a for a in args if isinstance(a, DTensor)]
    axis = ring_axis(n.target, [t.placements for t in tensors])
    forward = n.target in ATTENTION_FORWARD
    query = SEQUENCE_ATTENTION_QUERY[n.target]
    keys = tensors[query + 1]  # (forward: q, k, v; backward: grad, q, k)
    balanced = (layout is not None and layout.axis == axis
                and layout.follows(keys.placements[axis], keys.shape))
    group = mesh.get_group(axis).group_name
    causal = attention_is_causal(n.target, args)
    mask = kwargs.get("attn_mask")
    if mask is not None:
        mask = mask.to_local()
        dtype = tensors[query].dtype
        if mask.dtype == torch.bool:  # (the kernel takes an additive mask of the queries' dtype)
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, float("-inf"))
        mask = mask.to(dtype)
    local = [a.to_local() for a in kernel_tensors(n.target, args)]
    extra = [a.to_local() if isinstance(a, DTensor) else a
             for a in extra_arguments(n.target, args)]
    kernel = KERNELS[n.target]
    if forward:
        outs = ring_attention(*local, causal, kwargs.get("scale"), mask, group, balanced, kernel)
    else:
        outs = ring_attention_backward(*local, causal, kwargs.get("scale"), mask, group, balanced,
                                       kernel, extra)
    return wrap_outputs(outs, out_placements, n.meta["val"], mesh)
