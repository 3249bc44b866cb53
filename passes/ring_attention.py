"""Ring attention: attention with its queries, keys and values all sharded on the sequence over
one mesh axis, the keys and values passed around the axis's ranks in blocks (Liu, Zaharia and
Abbeel, "Ring Attention with Blockwise Transformers for Near-Infinite Context", 2023; the
context parallelism of Megatron-LM and torchtitan).

Requires: a node of CPU flash attention (or its backward) whose planned strategy shards every
tensor on the sequence dim 2 over one mesh axis (:func:`autopar.strategies.rules._sdpa_cpu_rule`,
the ring form), an attention mask, if any, with its rows sharded and its key columns whole.
Guarantees: the planned outputs, equal to the rank's rows of one device's attention.

Forward (``autopar::ring_attention``): with ``n`` ranks on the axis, rank ``r`` starts with its
own block of keys and values; at step ``t`` it holds block ``(r - t) mod n``, starts sending it
to rank ``r + 1`` (and receiving the next from ``r - 1``), runs the kernel on its queries
against the block, and merges the block's output into its running one by their log-sum-exps
(``lse = logaddexp(lse, lse_t)``; ``out = out * exp(lse_old - lse) + out_t * exp(lse_t - lse)``,
in float32). A causal node skips the blocks after the rank's own (their scores are all masked)
and runs the kernel's own causal mask on the diagonal block, where queries and keys start at
the same position. ``n - 1`` sends and receives of the stacked keys and values per rank.

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

from typing import Any, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.comm_ops import group_rank_size, register_op_with_collectives
from autopar.cost_models.ring import ring_axis
from autopar.strategies.rules import (CPU_ATTENTION as _FORWARD, CPU_ATTENTION_BACKWARD as _BACKWARD,
                                      SEQ_DIM, attention_is_causal)

__all__ = ["needs_ring", "ring_attention", "ring_attention_backward", "run_ring"]



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


def _block_mask(mask: torch.Tensor | None, block: int, size: int) -> torch.Tensor | None:
    """The key columns of block ``block`` (of ``size`` keys) of a mask whose columns are whole."""
    return None if mask is None else mask[..., block * size:(block + 1) * size]


def _masked_rows(mask: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor | None:
    """Rows of an additive mask block with every key masked (the kernel returns 0 and a
    log-sum-exp of 0 for them, which must not count), broadcast to ``like`` ``[b, h, s]``."""
    if mask is None:
        return None
    rows = torch.isneginf(mask).all(-1)
    return rows.expand(like.shape) if rows.any() else None


def _merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_t: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge a block's output and log-sum-exp into the running ones (float32)."""
    new = torch.logaddexp(lse, lse_t)
    finite = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    keep = torch.exp(lse - finite).unsqueeze(-1)
    add = torch.exp(lse_t - finite).unsqueeze(-1)
    return out * keep + o.float() * add, new


def _ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                    scale: float | None, mask: torch.Tensor | None, group: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's rows of attention and their log-sum-exp (see the module docstring)."""
    ring = _Ring(group)
    kv = torch.stack([k, v])
    size = k.shape[SEQ_DIM]
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    layout = None  # the kernel's outputs on the rank's own block: the strides to return in
    for t in range(ring.size):
        src = (ring.me - t) % ring.size
        pending = ring.start(kv) if t < ring.size - 1 else None
        if not (causal and src > ring.me):
            m = _block_mask(mask, src, size)
            o, lse_t = _FORWARD(q, kv[0], kv[1], 0.0, causal and src == ring.me, attn_mask=m,
                                scale=scale)
            layout = layout or (o, lse_t)
            lse_t = lse_t.float()
            dead = _masked_rows(m, lse_t)
            if dead is not None:
                lse_t = lse_t.masked_fill(dead, float("-inf"))
            out, lse = _merge(out, lse, o, lse_t)
        if pending is not None:
            kv = _Ring.finish(pending)
    # a row with every key masked: output 0 and log-sum-exp 0, as the kernel gives it (with
    # -inf, the backward's exp(score - lse) would be NaN)
    lse = lse.masked_fill(torch.isneginf(lse), 0.0)
    return torch.empty_like(layout[0]).copy_(out), torch.empty_like(layout[1]).copy_(lse)


ring_attention = torch.library.custom_op("autopar::ring_attention", mutates_args=())(_ring_attention)


@ring_attention.register_fake
def _ring_attention_fake(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                         scale: float | None, mask: torch.Tensor | None, group: str
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    return _FORWARD(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)  # (its layouts)


def _ring_attention_backward(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                             v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                             scale: float | None, mask: torch.Tensor | None, group: str
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of the rank's queries, keys and values (see the module docstring)."""
    ring = _Ring(group)
    kv = torch.stack([k, v])
    size = k.shape[SEQ_DIM]
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    incoming = None  # the keys' and values' gradients of the block held, on their way here
    layout = None  # the kernel's gradients of the rank's own block: the strides to return in
    for t in range(ring.size):
        src = (ring.me - t) % ring.size
        pending = ring.start(kv) if t < ring.size - 1 else None
        share = None
        if not (causal and src > ring.me):
            share = _BACKWARD(grad, q, kv[0], kv[1], out, lse, 0.0, causal and src == ring.me,
                              attn_mask=_block_mask(mask, src, size), scale=scale)
        dkv = (_Ring.finish(incoming) if incoming is not None
               else torch.zeros(kv.shape, dtype=torch.float32, device=kv.device))
        if share is not None:
            layout = layout or share
            dq += share[0]
            dkv[0] += share[1]
            dkv[1] += share[2]
        incoming = ring.start(dkv)
        if pending is not None:
            kv = _Ring.finish(pending)
    dkv = _Ring.finish(incoming)
    return tuple(torch.empty_like(like).copy_(g) for like, g in zip(layout, (dq, dkv[0], dkv[1])))


ring_attention_backward = torch.library.custom_op(
    "autopar::ring_attention_backward", mutates_args=())(_ring_attention_backward)


@ring_attention_backward.register_fake
def _ring_attention_backward_fake(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                  causal: bool, scale: float | None, mask: torch.Tensor | None,
                                  group: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _BACKWARD(grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale)


register_op_with_collectives(torch.ops.autopar.ring_attention.default, _ring_attention)
register_op_with_collectives(torch.ops.autopar.ring_attention_backward.default,
                             _ring_attention_backward)


def needs_ring(target: Any, in_placements: Sequence[tuple]) -> bool:
    """Whether a node is attention in the ring form (its keys sharded on the sequence)."""
    return ring_axis(target, in_placements) is not None


# the flash kernels' leading tensor arguments: forward (q, k, v), backward (grad_out, q, k, v,
# out, logsumexp); dropout and is_causal follow, the mask and the scale are keywords
_TENSORS = {_FORWARD: 3, _BACKWARD: 6}


def run_ring(n: Any, args: tuple, kwargs: dict, out_placements: Sequence[tuple], mesh: Any
             ) -> tuple[DTensor, ...]:
    """Run the node as ring attention on the ring of its keys' sharded axis; the planned
    DTensors."""
    tensors = [a for a in args if isinstance(a, DTensor)]
    axis = ring_axis(n.target, [t.placements for t in tensors])
    group = mesh.get_group(axis).group_name
    causal = attention_is_causal(n.target, args)
    mask = kwargs.get("attn_mask")
    if mask is not None:
        mask = mask.to_local()
        dtype = tensors[0 if n.target is _FORWARD else 1].dtype
        if mask.dtype == torch.bool:  # (the kernel takes an additive mask of the queries' dtype)
            mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                ~mask, float("-inf"))
        mask = mask.to(dtype)
    local = [a.to_local() for a in args[:_TENSORS[n.target]]]
    op = ring_attention if n.target is _FORWARD else ring_attention_backward
    outs = op(*local, causal, kwargs.get("scale"), mask, group)
    vals = n.meta["val"]
    return tuple(DTensor.from_local(o, mesh, p, run_check=False, shape=v.shape, stride=v.stride())
                 for o, p, v in zip(outs, out_placements, vals))
