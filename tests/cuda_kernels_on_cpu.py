"""CUDA's fused attention ops (cuDNN, FlashAttention, memory-efficient) given CPU kernels, for
tests: a model that calls them runs on CPU processes, so the planner's rules for these ops,
the lowering's blocks and the context-parallel runtime are checked end to end on gloo, as
autopar would run them on GPUs (where one GPU cannot run two cp ranks). Each emulation
computes with CPU's flash kernel and keeps the CUDA op's contract as the blocks rely on it:
the returned tuple, its shapes and layouts (cuDNN's log-sum-exp ``[b, h, s, 1]``, the efficient
kernel's padded to a multiple of 32 rows and its output laid out heads inside positions,
whatever the query's layout, as its meta kernel says), a causal mask only on square blocks
(where every kernel aligns it alike), and cuDNN's backward reading the sequence lengths from ``max_q`` and ``max_k`` (checked: a block given
the whole sequence's would be computed wrong on a GPU). Registered once, on import.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_CPU = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_CPU_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
_LIB = torch.library.Library("aten", "IMPL")


def _square(q: torch.Tensor, k: torch.Tensor, causal: bool) -> None:
    """The CUDA kernels align a causal mask differently when queries and keys differ in length
    (FlashAttention bottom-right, the CPU kernel top-left): refused here, so a test fails
    where a GPU would compute something else."""
    if causal and q.shape[2] != k.shape[2]:
        raise RuntimeError(f"causal attention of {q.shape[2]} queries against {k.shape[2]} keys: "
                           f"the CUDA kernels' masks differ there; autopar calls them causal on "
                           f"square blocks only")


def _extras() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros((), dtype=torch.long), torch.zeros((), dtype=torch.long)


def _cudnn(q, k, v, bias, lse, dropout_p=0.0, causal=False, debug=False, *, scale=None):
    _square(q, k, causal)
    out, logsumexp = _CPU(q, k, v, dropout_p, causal, attn_mask=bias, scale=scale)
    seed, offset = _extras()
    return (out, logsumexp.unsqueeze(-1), q.new_empty(0), q.new_empty(0), q.shape[2], k.shape[2],
            seed, offset, q.new_empty(0))


def _cudnn_backward(grad, q, k, v, out, lse, seed, offset, bias, cum_q, cum_k, max_q, max_k,
                    dropout_p, causal, *, scale=None):
    if (max_q, max_k) != (q.shape[2], k.shape[2]):
        raise RuntimeError(f"cuDNN's backward computes {max_q} queries against {max_k} keys "
                           f"(max_q, max_k), but was given {q.shape[2]} and {k.shape[2]}")
    _square(q, k, causal)
    return _CPU_BACKWARD(grad, q, k, v, out, lse.squeeze(-1), dropout_p, causal, attn_mask=bias,
                         scale=scale)


def _flash(q, k, v, dropout_p=0.0, causal=False, debug=False, *, scale=None):
    _square(q, k, causal)
    out, logsumexp = _CPU(q, k, v, dropout_p, causal, scale=scale)
    return (out, logsumexp, q.new_empty(0), q.new_empty(0), q.shape[2], k.shape[2],
            torch.zeros(2, dtype=torch.long), torch.zeros((), dtype=torch.long), q.new_empty(0))


def _flash_backward(grad, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, causal,
                    seed, offset, *, scale=None):
    _square(q, k, causal)
    return _CPU_BACKWARD(grad, q, k, v, out, lse, dropout_p, causal, scale=scale)


def _efficient(q, k, v, bias, lse, dropout_p=0.0, causal=False, *, scale=None):
    _square(q, k, causal)
    out, logsumexp = _CPU(q, k, v, dropout_p, causal, attn_mask=bias, scale=scale)
    rows = logsumexp.shape[-1]
    seed, offset = _extras()
    out = out.transpose(1, 2).contiguous().transpose(1, 2)  # (its layout: heads inside positions)
    return out, F.pad(logsumexp, (0, -rows % 32)), seed, offset


def _efficient_backward(grad, q, k, v, bias, out, lse, seed, offset, dropout_p, grad_mask,
                        causal=False, *, scale=None):
    _square(q, k, causal)
    if lse.shape[-1] % 32:
        raise RuntimeError(f"the efficient kernel's log-sum-exp has {lse.shape[-1]} rows; it "
                           f"reads them in multiples of 32")
    dq, dk, dv = _CPU_BACKWARD(grad, q, k, v, out, lse[..., :q.shape[2]], dropout_p, causal,
                               attn_mask=bias, scale=scale)
    return dq, dk, dv, q.new_empty(0)


for _name, _fn in (("_scaled_dot_product_cudnn_attention", _cudnn),
                   ("_scaled_dot_product_cudnn_attention_backward", _cudnn_backward),
                   ("_scaled_dot_product_flash_attention", _flash),
                   ("_scaled_dot_product_flash_attention_backward", _flash_backward),
                   ("_scaled_dot_product_efficient_attention", _efficient),
                   ("_scaled_dot_product_efficient_attention_backward", _efficient_backward)):
    _LIB.impl(_name, _fn, "CPU")

KERNELS = {1: "cudnn", 2: "flash", 3: "efficient"}


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kernel: int) -> torch.Tensor:
    """Causal attention by the CUDA op ``KERNELS[kernel]``, as SDPA would call it on a GPU."""
    aten = torch.ops.aten
    if KERNELS[kernel] == "cudnn":
        return aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)[0]
    if KERNELS[kernel] == "flash":
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False)[0]
    return aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[0]
