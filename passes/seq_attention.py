"""Attention with its queries sharded on the sequence (context parallelism), run locally.

Requires: a node of fused attention (or its backward) whose planned strategy shards the
queries (and the output, the log-sum-exp and, in the backward, the output's gradient) on the
sequence dim 2 over some mesh axes, with the keys and values whole along it
(``autopar.strategies.rules``: Llama 3's form, the keys and values all-gathered over the
context-parallel ranks before it, their gradients reduced after). Guarantees: the planned
outputs, equal to the slice of one device's attention that the rank's queries select. A causal
mask is the only thing that needs the rank's place in the sequence: the kernel's own
``is_causal`` aligns the queries' first row with the first key. CPU's kernel takes a mask, so
``is_causal`` is replaced by an explicit mask of the rank's query positions against every key
position; CUDA's kernels run in blocks of the rank's positions
(:func:`autopar.passes.attention_blocks.gathered_forward`), which skips the keys after them
as the kernel's causal mask does. Non-causal attention on CPU runs as DTensor runs it.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.fx as fx
from torch.distributed.tensor import DTensor, Shard

from autopar.passes.attention_blocks import (KERNELS, extra_arguments, gathered_backward,
                                             gathered_forward, kernel_tensors, wrap_outputs)
from autopar.sequence_layout import SequenceLayout, query_runs
from autopar.strategies.rules import (ATTENTION_CAUSAL_ARG, ATTENTION_FORWARD, SEQ_DIM,
                                      SEQUENCE_ATTENTION_QUERY, attention_is_causal)

__all__ = ["needs_local", "query_offset", "run_local"]

aten = torch.ops.aten
# where the queries are among the tensor inputs, and where is_causal is among the arguments
# (the rules' tables)
_QUERY = SEQUENCE_ATTENTION_QUERY
_CAUSAL = ATTENTION_CAUSAL_ARG


def needs_local(target: Any, in_placements: Sequence[tuple], args: tuple) -> bool:
    """Whether a node is attention with its queries sharded on the sequence that DTensor's
    dispatch cannot run: causal, or of a CUDA kernel (always run in blocks)."""
    if target not in _QUERY:
        return False
    blocks = attention_is_causal(target, args) or KERNELS[target] != "cpu"
    query = in_placements[_QUERY[target]]
    return blocks and any(isinstance(p, Shard) and p.dim == SEQ_DIM for p in query)


def query_offset(length: int, placements: Sequence[Any], mesh: Any) -> tuple[int, int]:
    """The first global position and the count of the rank's block of a dim of ``length``
    sharded by ``placements`` (DTensor's order: the first mesh axis splits first)."""
    start, size = 0, length
    for axis, p in enumerate(placements):
        if isinstance(p, Shard) and p.dim == SEQ_DIM:
            size //= mesh.size(axis)
            start += mesh.get_local_rank(axis) * size
    return start, size


def _additive(allowed: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A boolean mask as the kernel takes it: 0 where allowed, -inf elsewhere, in ``like``'s
    dtype."""
    zeros = torch.zeros(allowed.shape, dtype=like.dtype, device=like.device)
    return zeros.masked_fill(~allowed, float("-inf"))


def run_local(n: fx.Node, args: tuple, kwargs: dict, out_placements: Sequence[tuple],
              mesh: Any, layout: SequenceLayout | None = None) -> tuple[DTensor, ...]:
    """Run the node on local blocks (see the module docstring); the planned DTensors. With a
    balanced cp ``layout``, the rank's queries are its chunk pair (their positions from it)."""
    q = args[_QUERY[n.target]]
    k = args[_QUERY[n.target] + 1]
    start, size = query_offset(q.shape[SEQ_DIM], q.placements, mesh)
    arranged = (layout is not None and layout.follows(q.placements[layout.axis], q.shape)
                and q.placements[layout.axis].dim == SEQ_DIM)
    if KERNELS[n.target] != "cpu":
        runs = query_runs(q.shape[SEQ_DIM], start, size, layout if arranged else None)
        return _run_blocks(n, args, kwargs, out_placements, mesh, runs)
    keys = k.shape[SEQ_DIM]
    local = [a.to_local() if isinstance(a, DTensor) else a for a in args]
    query = local[_QUERY[n.target]]
    if arranged:
        rows = layout.positions(q.shape[SEQ_DIM], start, size, device=query.device)
    else:
        rows = torch.arange(start, start + size, device=query.device)
    mask = _additive(torch.arange(keys, device=query.device)[None, :] <= rows[:, None], query)
    given = kwargs.get("attn_mask")
    if given is not None:  # (the kernel takes an additive mask of the queries' dtype)
        given = given.to_local()
        mask = mask + (_additive(given, query) if given.dtype == torch.bool else given)
    local[_CAUSAL[n.target]] = False
    outs = n.target(*local, **{**kwargs, "attn_mask": mask})
    return wrap_outputs(outs, out_placements, n.meta["val"], mesh)


def _run_blocks(n: fx.Node, args: tuple, kwargs: dict, out_placements: Sequence[tuple | None],
                mesh: Any, runs: list[tuple[int, int, int]]) -> tuple[Any, ...]:
    """A CUDA kernel's node in blocks of the rank's positions ``runs``; the planned outputs."""
    local = [a.to_local() if isinstance(a, DTensor) else a for a in kernel_tensors(n.target, args)]
    causal, scale, kernel = attention_is_causal(n.target, args), kwargs.get("scale"), KERNELS[n.target]
    if n.target in ATTENTION_FORWARD:
        outs = gathered_forward(kernel, *local, causal, scale, runs)
    else:
        extra = [a.to_local() if isinstance(a, DTensor) else a
                 for a in extra_arguments(n.target, args)]
        outs = gathered_backward(kernel, *local, causal, scale, runs, extra)
    return wrap_outputs(outs, out_placements, n.meta["val"], mesh)
