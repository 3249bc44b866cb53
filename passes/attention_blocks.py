"""Fused attention kernels run on blocks of queries and keys, merged by their log-sum-exps.

Context parallelism computes attention in parts of the sequence: the ring form receives the
keys and values block by block (``autopar.passes.ring_attention``), and the gathered form of
CUDA's kernels runs the rank's queries against the whole keys in blocks of positions
(:func:`gathered_forward`), since FlashAttention takes no mask and its ``is_causal`` aligns
the first query with the first key. This module is the one place that knows how each kernel
is called on a block:

- CPU's flash kernel (``_scaled_dot_product_flash_attention_for_cpu``): a mask as a keyword;
- CUDA's FlashAttention (``_scaled_dot_product_flash_attention``): no mask; its backward takes
  the forward's cumulative lengths (undefined outside variable-length batches) and random
  state, passed through as the graph holds them;
- CUDA's memory-efficient kernel (``_scaled_dot_product_efficient_attention``): its
  log-sum-exp padded to a multiple of 32 rows (sliced off here, padded again for its
  backward); no bias (the rules offer no sequence split with one);
- cuDNN's (``_scaled_dot_product_cudnn_attention``, what torch 2.11 picks for bf16 causal
  attention on an H200): its log-sum-exp ``[batch, heads, queries, 1]``, its backward
  told the block's query and key lengths (``max_q``, ``max_k``); no bias.

Every block a CUDA kernel is given is copied contiguous. The kernels read their operands'
strides, and the efficient kernel's backward reads the output with the gradient's (a mismatch
gave wrong gradients on an H200 in bf16, torch 2.11; ``benchmarks/gpu_check.py``); whether the
others would take views into the longer sequence was not checked, and the copies are priced
(``cost_models.attention.gathered_seconds``).

A block's output merges into the running one by ``lse = logaddexp(lse, lse_b)``, ``out = out
* exp(lse_old - lse) + out_b * exp(lse_b - lse)`` in float32 (Milakov and Gimelshein, "Online
normalizer calculation for softmax", 2018; FlashAttention's outer loop). In the backward, a
block's kernel given the whole row's output and log-sum-exp gives that block's exact share of
every gradient (its probabilities are the whole row's).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Replicate

from autopar.cost_models.attention import gathered_calls
from autopar.strategies.rules import (CPU_ATTENTION, CPU_ATTENTION_BACKWARD, CUDNN_ATTENTION,
                                      CUDNN_ATTENTION_BACKWARD, EFFICIENT_ATTENTION,
                                      EFFICIENT_ATTENTION_BACKWARD, FLASH_ATTENTION,
                                      FLASH_ATTENTION_BACKWARD, SEQ_DIM)

__all__ = ["KERNELS", "block_backward", "block_forward", "extra_arguments", "forward_extras",
           "gathered_backward", "gathered_forward", "kernel_tensors", "lse_native", "lse_rows",
           "merge", "wrap_outputs"]

aten = torch.ops.aten

# each attention op's kernel family, by the name the ring's custom ops take
KERNELS = {CPU_ATTENTION: "cpu", CPU_ATTENTION_BACKWARD: "cpu", FLASH_ATTENTION: "flash",
           FLASH_ATTENTION_BACKWARD: "flash", EFFICIENT_ATTENTION: "efficient",
           EFFICIENT_ATTENTION_BACKWARD: "efficient", CUDNN_ATTENTION: "cudnn",
           CUDNN_ATTENTION_BACKWARD: "cudnn"}
_LSE_ALIGN = 32  # the memory-efficient kernel's log-sum-exp rows come in multiples of this
# where a backward node holds the tensors its kernel needs beyond the attention's own
# (FlashAttention: cum_seq_q, cum_seq_k, philox_seed, philox_offset; efficient: the philox
# pair; cuDNN: the philox pair, cum_seq_q, cum_seq_k)
_EXTRA = {FLASH_ATTENTION_BACKWARD: (6, 7, 12, 13), EFFICIENT_ATTENTION_BACKWARD: (7, 8),
          CUDNN_ATTENTION_BACKWARD: (6, 7, 9, 10)}
# where a backward node holds the output and its log-sum-exp (after grad_out, q, k, v; the
# efficient kernel's bias comes between)
_OUT_LSE = {CPU_ATTENTION_BACKWARD: (4, 5), FLASH_ATTENTION_BACKWARD: (4, 5),
            EFFICIENT_ATTENTION_BACKWARD: (5, 6), CUDNN_ATTENTION_BACKWARD: (4, 5)}


def lse_rows(kernel: str, lse: torch.Tensor) -> torch.Tensor:
    """A node's log-sum-exp as ``[batch, heads, queries]`` (cuDNN's has a trailing 1)."""
    return lse.squeeze(-1) if kernel == "cudnn" else lse


def lse_native(kernel: str, lse: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`lse_rows`: the shape the node's kernel gives (the efficient
    kernel's without its padding, which the sequence split leaves out)."""
    return lse.unsqueeze(-1) if kernel == "cudnn" else lse


def kernel_tensors(target: Any, args: Sequence[Any]) -> list[Any]:
    """The tensors of an attention node the blocks take: a forward's ``q, k, v``; a
    backward's ``grad_out, q, k, v, out, logsumexp``."""
    if target not in _OUT_LSE:
        return list(args[:3])
    out, lse = _OUT_LSE[target]
    return list(args[:4]) + [args[out], args[lse]]


def extra_arguments(target: Any, args: Sequence[Any]) -> list[Any]:
    """The arguments a backward node of ``target`` passes to its kernel beyond gradient,
    queries, keys, values, output and log-sum-exp (empty for the CPU kernel and forwards)."""
    return [args[i] if i < len(args) else None for i in _EXTRA.get(target, ())]


def forward_extras(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  causal: bool) -> list[Any]:
    """What a backward node of ``kernel`` holds beyond its attention tensors
    (:func:`extra_arguments`), as a forward call on ``q``, ``k``, ``v`` makes them:
    FlashAttention's cumulative lengths and random state, the efficient kernel's philox pair,
    cuDNN's philox pair and cumulative lengths; nothing for CPU's (for checks that call the
    kernels by themselves: ``passes.cp_simulation``, ``benchmarks/gpu_check.py``)."""
    if kernel == "flash":
        out = FLASH_ATTENTION(q, k, v, 0.0, causal, False)
        return [out[2], out[3], out[6], out[7]]
    if kernel == "efficient":
        out = EFFICIENT_ATTENTION(q, k, v, None, True, 0.0, causal)
        return [out[2], out[3]]
    if kernel == "cudnn":
        out = CUDNN_ATTENTION(q, k, v, None, True, 0.0, causal)
        return [out[6], out[7], out[2], out[3]]
    return []


def block_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float | None, mask: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``kernel``'s output and log-sum-exp (``[batch, heads, queries]``) of queries ``q``
    against keys ``k`` and values ``v``, causal only on a square block (the kernels align a
    causal mask differently when queries and keys differ in length)."""
    if kernel == "cpu":
        return CPU_ATTENTION(q, k, v, 0.0, causal, attn_mask=mask, scale=scale)
    _no_mask(kernel, mask)
    q, k, v = (x.contiguous() for x in (q, k, v))
    if kernel == "flash":
        out = FLASH_ATTENTION(q, k, v, 0.0, causal, False, scale=scale)
        return out[0], out[1]
    if kernel == "cudnn":
        out = CUDNN_ATTENTION(q, k, v, None, True, 0.0, causal, False, scale=scale)
        return out[0], out[1].squeeze(-1)
    out = EFFICIENT_ATTENTION(q, k, v, None, True, 0.0, causal, scale=scale)
    return out[0], out[1][..., :q.shape[SEQ_DIM]]


def block_backward(kernel: str, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                   v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                   scale: float | None, mask: torch.Tensor | None = None,
                   extra: Sequence[Any] = ()) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``kernel``'s gradients of ``q``, ``k`` and ``v`` for the block, given the rows'
    output ``out`` and log-sum-exp ``lse`` (``[batch, heads, queries]``) over every key;
    ``extra``: :func:`extra_arguments` of the backward node."""
    if kernel == "cpu":
        return CPU_ATTENTION_BACKWARD(grad, q, k, v, out, lse, 0.0, causal, attn_mask=mask,
                                      scale=scale)
    _no_mask(kernel, mask)
    grad, q, k, v, out, lse = (x.contiguous() for x in (grad, q, k, v, out, lse))
    if kernel == "cudnn":
        seed, offset, cum_q, cum_k = extra
        return CUDNN_ATTENTION_BACKWARD(grad, q, k, v, out, lse.unsqueeze(-1), seed, offset, None,
                                        cum_q, cum_k, q.shape[SEQ_DIM], k.shape[SEQ_DIM], 0.0,
                                        causal, scale=scale)
    if kernel == "flash":
        cum_q, cum_k, seed, offset = extra
        return FLASH_ATTENTION_BACKWARD(grad, q, k, v, out, lse, cum_q, cum_k, q.shape[SEQ_DIM],
                                        k.shape[SEQ_DIM], 0.0, causal, seed, offset, scale=scale)
    seed, offset = extra
    # (its backward reads the output with the gradient's strides: both as its forward lays
    # the output out, heads inside positions)
    grad, out = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (grad, out))
    rows = lse.shape[-1]
    padded = F.pad(lse, (0, -rows % _LSE_ALIGN))
    grads = EFFICIENT_ATTENTION_BACKWARD(grad, q, k, v, None, out, padded, seed, offset, 0.0,
                                         [True, True, True, False], causal, scale=scale)
    return grads[0], grads[1], grads[2]


def _no_mask(kernel: str, mask: torch.Tensor | None) -> None:
    if mask is not None:
        raise NotImplementedError(
            f"attention split on the sequence with the {kernel!r} kernel was given a mask; "
            f"autopar's rules offer that split only without one for this kernel. Use the "
            f"kernel's is_causal, or cp=1.")


def merge(out: torch.Tensor, lse: torch.Tensor, o: torch.Tensor, lse_b: torch.Tensor
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """A block's output ``o`` and log-sum-exp ``lse_b`` merged into the running ``out`` and
    ``lse`` (float32; a ``-inf`` log-sum-exp is a row that has seen no key yet)."""
    new = torch.logaddexp(lse, lse_b)
    finite = torch.where(torch.isneginf(new), torch.zeros_like(new), new)
    keep = torch.exp(lse - finite).unsqueeze(-1)
    add = torch.exp(lse_b - finite).unsqueeze(-1)
    return out * keep + o.float() * add, new


def gathered_forward(kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     causal: bool, scale: float | None, runs: Sequence[tuple[int, int, int]]
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rank's rows of attention and their log-sum-exp (the node's shape of it): queries
    ``q`` (the rank's, at the positions ``runs`` gives, see ``cost_models.attention.gathered_calls``) against the whole
    keys ``k`` and values ``v``, in the kernel's dtypes."""
    calls = gathered_calls(runs, causal, k.shape[SEQ_DIM])
    out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    lse = torch.full(q.shape[:-1], float("-inf"), dtype=torch.float32, device=q.device)
    like = None
    for rows, keys, c in calls:
        o, lse_b = block_forward(kernel, q[..., rows, :], k[..., keys, :], v[..., keys, :], c,
                                 scale)
        if len(calls) == 1:
            return o, lse_native(kernel, lse_b)
        like = like or (o, lse_b)
        out[..., rows, :], lse[..., rows] = merge(out[..., rows, :], lse[..., rows], o,
                                                  lse_b.float())
    return out.to(like[0].dtype), lse_native(kernel, lse.to(like[1].dtype))


def gathered_backward(kernel: str, grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                      v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                      scale: float | None, runs: Sequence[tuple[int, int, int]],
                      extra: Sequence[Any] = ()
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of the rank's queries and its share of the whole keys' and values' (the
    plan sums the shares over the cp ranks), by the blocks of :func:`gathered_forward`."""
    calls = gathered_calls(runs, causal, k.shape[SEQ_DIM])
    lse = lse_rows(kernel, lse)
    if len(calls) == 1 and calls[0][1] == slice(0, k.shape[SEQ_DIM]):  # (every key at once)
        return block_backward(kernel, grad, q, k, v, out, lse, calls[0][2], scale, None, extra)
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=k.device)
    dv = torch.zeros(v.shape, dtype=torch.float32, device=v.device)
    for rows, keys, c in calls:
        g = block_backward(kernel, grad[..., rows, :], q[..., rows, :], k[..., keys, :],
                           v[..., keys, :], out[..., rows, :], lse[..., rows], c, scale, None,
                           extra)
        dq[..., rows, :] += g[0]
        dk[..., keys, :] += g[1]
        dv[..., keys, :] += g[2]
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def wrap_outputs(outs: Sequence[torch.Tensor], out_placements: Sequence[tuple | None],
                 vals: Sequence[Any], mesh: Any) -> tuple[Any, ...]:
    """The node's outputs as the planned DTensors: ``outs`` are its attention output and
    log-sum-exp (or its gradients); the kernel's other outputs (``vals``, the node's traced
    values: cumulative lengths, random state, debug mask) are returned as the trace has them,
    ``None`` or an int as such and a tensor as an uninitialised one of its shape, replicated:
    with no dropout the backward, run by these blocks too, never reads them."""
    result = []
    for i, v in enumerate(vals):
        if not isinstance(v, torch.Tensor):
            result.append(v)
            continue
        p = out_placements[i] if i < len(out_placements) else None
        if i < len(outs):
            o = outs[i]
        else:
            o = torch.empty(v.shape, dtype=v.dtype, device=outs[0].device)
            p = None
        p = p if p is not None else tuple(Replicate() for _ in mesh.shape)
        result.append(DTensor.from_local(o, mesh, p, run_check=False, shape=v.shape,
                                         stride=v.stride()))
    return tuple(result)
