"""Context-parallel attention of ``n`` ranks run in one process, to check a kernel's blocks.

The context-parallel forms run attention in blocks (``autopar.passes.attention_blocks``,
``autopar.passes.ring_attention``) with code that only the cp ranks of a real run execute.
:func:`simulate` runs that same code for ``n`` ranks in one process, on one device: each rank
a thread, the ring's sends and receives handed between them in order (as
``batch_isend_irecv`` matches them), the gathered form's key and value gradients summed as
the plan's reduce-scatter sums them. On a single GPU this checks CUDA's kernels in both forms
and layouts against the kernel run once on the whole sequence (``benchmarks/gpu_check.py``);
on the CPU it checks the blocks' arithmetic (``tests/unit/test_ring_attention.py``).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.tensor import Shard

from autopar.passes.attention_blocks import (block_backward, block_forward, forward_extras,
                                             gathered_backward, gathered_forward, lse_rows)
from autopar.passes.ring_attention import ring_backward, ring_forward
from autopar.sequence_layout import SequenceLayout, query_runs
from autopar.strategies.rules import SEQ_DIM

__all__ = ["Attention", "simulate", "whole"]

_TIMEOUT_S = 120.0  # a rank waiting longer for its neighbour's block: a bug, not slowness


@dataclass(frozen=True)
class Attention:
    """Attention's results for the whole sequence: output, log-sum-exp and the gradients of
    the queries, keys and values."""

    out: torch.Tensor
    lse: torch.Tensor
    dq: torch.Tensor
    dk: torch.Tensor
    dv: torch.Tensor


class _ThreadRing:
    """A ring of threads: rank ``me`` sends to ``me + 1`` and receives from ``me - 1``."""

    def __init__(self, me: int, inboxes: list[queue.Queue]) -> None:
        self.me, self.size, self.inboxes = me, len(inboxes), inboxes

    def start(self, buf: torch.Tensor) -> queue.Queue:
        self.inboxes[(self.me + 1) % self.size].put(buf.clone())
        return self.inboxes[self.me]

    @staticmethod
    def finish(pending: queue.Queue) -> torch.Tensor:
        return pending.get(timeout=_TIMEOUT_S)


_SPLIT = (Shard(SEQ_DIM),)  # the sequence split on the one cp axis of the simulation


def _arranged(x: torch.Tensor, n: int, balanced: bool) -> list[torch.Tensor]:
    """``x``'s blocks of the sequence for ``n`` ranks, in the layout's order."""
    if balanced:
        x = SequenceLayout(0, n).arrange_input(x, _SPLIT)
    return [b.contiguous() for b in x.chunk(n, SEQ_DIM)]


def _natural(blocks: list[torch.Tensor], n: int, balanced: bool) -> torch.Tensor:
    """The inverse of :func:`_arranged`."""
    x = torch.cat(blocks, SEQ_DIM)
    return SequenceLayout(0, n).restore_input(x, _SPLIT) if balanced else x


def _in_threads(n: int, work: Any) -> list[Any]:
    """``work(rank)`` for every rank, each in a thread; their results in rank order."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            results[r] = work(r)
        except BaseException as e:  # (re-raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def simulate(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             grad: torch.Tensor, ranks: int, form: str, causal: bool, balanced: bool,
             scale: float | None = None) -> Attention:
    """Attention of ``q``, ``k``, ``v`` (``[batch, heads, seq, head_dim]``) and its backward
    for the output gradient ``grad``, computed as ``ranks`` cp ranks compute it in ``form``
    (``"ring"`` or ``"gather"``), the sequence held in chunk pairs (``balanced``) or
    contiguous blocks, by the ``kernel`` (``attention_blocks.KERNELS``); the results put back
    in natural order."""
    if form not in ("ring", "gather"):
        raise ValueError(f"form={form!r}; expected 'ring' or 'gather'")
    extra = forward_extras(kernel, q, k, v, causal)
    qs, ks, vs, gs = (_arranged(x, ranks, balanced) for x in (q, k, v, grad))
    length, size = q.shape[SEQ_DIM], q.shape[SEQ_DIM] // ranks
    layout = SequenceLayout(0, ranks) if balanced else None
    inboxes: list[queue.Queue] = [queue.Queue() for _ in range(ranks)]

    def rank(r: int) -> tuple[torch.Tensor, ...]:
        if form == "ring":
            ring = _ThreadRing(r, inboxes)
            out, lse = ring_forward(ring, kernel, qs[r], ks[r], vs[r], causal, scale, None,
                                    balanced)
            grads = ring_backward(ring, kernel, gs[r], qs[r], ks[r], vs[r], out, lse, causal,
                                  scale, None, balanced, extra)
            return (out, lse) + tuple(grads)
        runs = query_runs(length, r * size, size, layout)
        out, lse = gathered_forward(kernel, qs[r], k, v, causal, scale, runs)
        grads = gathered_backward(kernel, gs[r], qs[r], k, v, out, lse, causal, scale, runs,
                                  extra)
        return (out, lse) + tuple(grads)

    per_rank = _in_threads(ranks, rank)
    out, lse, dq = (_natural([p[i] for p in per_rank], ranks, balanced) for i in range(3))
    lse = lse_rows(kernel, lse)
    if form == "ring":
        dk, dv = (_natural([p[i] for p in per_rank], ranks, balanced) for i in (3, 4))
    else:  # (each rank's share of the whole keys' gradients, summed as the plan sums them)
        dk, dv = (torch.stack([p[i].float() for p in per_rank]).sum(0).to(per_rank[0][i].dtype)
                  for i in (3, 4))
    return Attention(out, lse, dq, dk, dv)


def whole(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, grad: torch.Tensor,
          causal: bool, scale: float | None = None) -> Attention:
    """The same by the kernel once on the whole sequence, the reference of :func:`simulate`."""
    out, lse = block_forward(kernel, q, k, v, causal, scale)
    extra = forward_extras(kernel, q, k, v, causal)
    dq, dk, dv = block_backward(kernel, grad, q, k, v, out, lse, causal, scale, None, extra)
    return Attention(out, lse, dq, dk, dv)
