"""Built-in model presets for planning: GPT models as Megatron-LM built them in 2021.

:class:`MegatronGPT` follows Megatron-LM's GPT of the SC'21 paper (Narayanan et al.,
arXiv:2104.04473; Megatron-LM ``megatron/model/transformer.py`` of that time): pre-LayerNorm
blocks, a fused QKV projection, attention written out (scores ``QK^T / sqrt(d)``, causal mask,
softmax, dropout, ``attn @ V``; no flash attention, which came later), a GELU MLP of 4h,
learned position embeddings, and the LM head tied to the word embedding. Build it under
``FakeTensorMode`` to plan models of any size without memory:

    with FakeTensorMode(allow_non_fake_inputs=True):
        model = MegatronGPT(**TABLE1[6], seq=2048)

:data:`GPT_CONFIGS` names the sizes used by the benchmarks and examples.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MegatronBlock", "MegatronGPT", "GPT_CONFIGS", "megatron_gpt"]


class MegatronBlock(nn.Module):
    """One transformer layer: ``x + drop(proj(attn(ln1(x))))``, then ``x + drop(mlp(ln2(x)))``."""

    def __init__(self, hidden: int, heads: int, dropout: float,
                 dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} must be divisible by heads {heads}")
        self.heads, self.dropout = heads, dropout
        self.ln1 = nn.LayerNorm(hidden, dtype=dtype)
        self.qkv = nn.Linear(hidden, 3 * hidden, dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, dtype=dtype)
        self.ln2 = nn.LayerNorm(hidden, dtype=dtype)
        self.fc1 = nn.Linear(hidden, 4 * hidden, dtype=dtype)
        self.fc2 = nn.Linear(4 * hidden, hidden, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """One layer on ``x`` of shape (batch, seq, hidden)."""
        b, s, h = x.shape
        d = h // self.heads
        q, k, v = self.qkv(self.ln1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, d).transpose(1, 2) for t in (q, k, v))
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
        mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
        probs = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        probs = F.dropout(probs, self.dropout, self.training)
        y = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(y), self.dropout, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.dropout, self.training)


class MegatronGPT(nn.Module):
    """GPT language model returning the mean next-token cross-entropy of ``(ids, targets)``."""

    def __init__(self, hidden: int, layers: int, heads: int, seq: int = 2048,
                 vocab: int = 51200, dropout: float = 0.1, dtype: torch.dtype = torch.bfloat16
                 ) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden, dtype=dtype)
        self.wpe = nn.Embedding(seq, hidden, dtype=dtype)
        self.blocks = nn.ModuleList(MegatronBlock(hidden, heads, dropout, dtype)
                                    for _ in range(layers))
        self.ln_f = nn.LayerNorm(hidden, dtype=dtype)
        self.head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)
        self.head.weight = self.wte.weight  # Megatron shares the word embedding with the head
        self.dropout = dropout

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of predicting ``targets`` (batch, seq) from ``ids`` (batch, seq)."""
        s = ids.shape[1]
        x = self.wte(ids) + self.wpe(torch.arange(s, device=ids.device))
        x = F.dropout(x, self.dropout, self.training)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


# Named sizes: Megatron-LM SC'21 Table 1 (hidden, layers, heads) and GPT-3 175B (Brown et al.
# 2020, Table 2.1: 96 layers, d_model 12288, 96 heads).
GPT_CONFIGS: dict[str, dict[str, int]] = {
    "gpt-1.7b": dict(hidden=2304, layers=24, heads=24),
    "gpt-3.6b": dict(hidden=3072, layers=30, heads=32),
    "gpt-7.5b": dict(hidden=4096, layers=36, heads=32),
    "gpt-18b": dict(hidden=6144, layers=40, heads=48),
    "gpt-39b": dict(hidden=8192, layers=48, heads=64),
    "gpt-76b": dict(hidden=10240, layers=60, heads=80),
    "gpt-145b": dict(hidden=12288, layers=80, heads=96),
    "gpt3-175b": dict(hidden=12288, layers=96, heads=96),
    "gpt-310b": dict(hidden=16384, layers=96, heads=128),
    "gpt-530b": dict(hidden=20480, layers=105, heads=128),
    "gpt-1t": dict(hidden=25600, layers=128, heads=160),
}


def megatron_gpt(name_or_sizes: str | dict[str, int], batch: int, seq: int = 2048,
                 vocab: int = 51200, **kw: Any) -> tuple[MegatronGPT, tuple[torch.Tensor, ...]]:
    """A :class:`MegatronGPT` built under ``FakeTensorMode`` (no memory) and fake example inputs
    of ``batch`` sequences; ``name_or_sizes`` is a key of :data:`GPT_CONFIGS` or a dict with
    ``hidden``, ``layers``, ``heads``."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    sizes = GPT_CONFIGS[name_or_sizes] if isinstance(name_or_sizes, str) else dict(name_or_sizes)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = MegatronGPT(seq=seq, vocab=vocab, **sizes, **kw)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids, ids)
