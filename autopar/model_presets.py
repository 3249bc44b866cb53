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

import importlib
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MegatronBlock", "MegatronGPT", "GPT_CONFIGS", "LlamaBlock", "Llama", "LLAMA_CONFIGS",
           "megatron_gpt", "llama", "preset", "load_model"]


class MegatronBlock(nn.Module):
    """One transformer layer: ``x + drop(proj(attn(ln1(x))))``, then ``x + drop(mlp(ln2(x)))``."""

    def __init__(self, hidden: int, heads: int, dropout: float,
                 dtype: torch.dtype = torch.bfloat16, flash: bool = False) -> None:
        super().__init__()
        if hidden % heads:
            raise ValueError(f"hidden size {hidden} must be divisible by heads {heads}")
        self.heads, self.dropout, self.flash = heads, dropout, flash
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
        if self.flash:  # one fused kernel (no s x s tensors), without attention dropout
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
            mask = torch.ones(s, s, dtype=torch.bool, device=x.device).triu(1)
            probs = F.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
            y = torch.matmul(F.dropout(probs, self.dropout, self.training), v)
        y = y.transpose(1, 2).reshape(b, s, h)
        x = x + F.dropout(self.proj(y), self.dropout, self.training)
        return x + F.dropout(self.fc2(F.gelu(self.fc1(self.ln2(x)))), self.dropout, self.training)


class MegatronGPT(nn.Module):
    """GPT language model returning the mean next-token cross-entropy of ``(ids, targets)``.

    ``flash``: attention as one fused kernel (``scaled_dot_product_attention``, no attention
    dropout), as Megatron-Core runs it since 2023; otherwise as SC'21's Megatron-LM did (the
    scores and probabilities materialised, dropout on them)."""

    def __init__(self, hidden: int, layers: int, heads: int, seq: int = 2048,
                 vocab: int = 51200, dropout: float = 0.1, dtype: torch.dtype = torch.bfloat16,
                 flash: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden, dtype=dtype)
        self.wpe = nn.Embedding(seq, hidden, dtype=dtype)
        self.blocks = nn.ModuleList(MegatronBlock(hidden, heads, dropout, dtype, flash)
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
    # GPT-2 sizes (Radford et al. 2019, Table 2), in Megatron's layout
    "gpt2-small": dict(hidden=768, layers=12, heads=12),
    "gpt2-medium": dict(hidden=1024, layers=24, heads=16),
    "gpt2-large": dict(hidden=1280, layers=36, heads=20),
    "gpt2-xl": dict(hidden=1600, layers=48, heads=25),
}


def megatron_gpt(name_or_sizes: str | dict[str, int], batch: int, seq: int = 2048,
                 vocab: int = 51200, **kw: Any) -> tuple[MegatronGPT, tuple[torch.Tensor, ...]]:
    """A :class:`MegatronGPT` built under ``FakeTensorMode`` (no memory) and fake example inputs
    of ``batch`` sequences; ``name_or_sizes`` is a key of :data:`GPT_CONFIGS` or a dict with
    ``hidden``, ``layers``, ``heads``."""
    from autopar._torch_private import FakeTensorMode

    sizes = GPT_CONFIGS[name_or_sizes] if isinstance(name_or_sizes, str) else dict(name_or_sizes)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = MegatronGPT(seq=seq, vocab=vocab, **sizes, **kw)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids, ids)


class LlamaBlock(nn.Module):
    """A Llama layer (Touvron et al., arXiv:2302.13971, sec. 2.2): RMSNorm before attention and
    MLP, rotary position embeddings on q and k, causal attention, SwiGLU MLP, no biases."""

    def __init__(self, hidden: int, heads: int, intermediate: int,
                 dtype: torch.dtype = torch.bfloat16, kv_heads: int | None = None) -> None:
        super().__init__()
        kv_heads = kv_heads or heads
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"hidden size {hidden} must be divisible by heads {heads}, and "
                             f"heads by kv_heads {kv_heads}")
        self.heads, self.kv_heads = heads, kv_heads
        self.norm1 = nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)
        # q, then k and v of kv_heads heads each (grouped-query attention, Ainslie et al.,
        # arXiv:2305.13245, as Llama 2 70B: Touvron et al., arXiv:2307.09288, sec. 2.2); with
        # fewer k/v heads, the output features grouped per k/v head (forward)
        self.qkv = nn.Linear(hidden, hidden + 2 * kv_heads * (hidden // heads), bias=False,
                             dtype=dtype)
        self.proj = nn.Linear(hidden, hidden, bias=False, dtype=dtype)
        self.norm2 = nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False, dtype=dtype)
        self.down = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """One layer on ``x`` (batch, seq, hidden) with the rotary tables ``cos``/``sin``."""
        b, s, h = x.shape
        d, kv = h // self.heads, self.kv_heads
        if kv < self.heads:  # grouped: each k/v head after its query heads, as Megatron-Core
            # lays out its fused QKV, so that a column split over tp (dividing kv) keeps groups
            g = self.heads // kv
            qkv = self.qkv(self.norm1(x)).view(b, s, kv, g + 2, d)
            q = qkv[:, :, :, :g].reshape(b, s, self.heads, d).transpose(1, 2)
            k, v = (qkv[:, :, :, j].transpose(1, 2) for j in (g, g + 1))
        else:
            q, k, v = self.qkv(self.norm1(x)).split((h, kv * d, kv * d), dim=2)
            q = q.view(b, s, self.heads, d).transpose(1, 2)
            k, v = (t.view(b, s, kv, d).transpose(1, 2) for t in (k, v))
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if kv < self.heads:  # each k/v head serves heads / kv query heads
            k, v = (t[:, :, None].expand(b, kv, self.heads // kv, s, d).reshape(b, self.heads, s, d)
                    for t in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, s, h))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al., arXiv:2104.09864, eq. 34), halves layout as in Llama."""
    a, b = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-b, a), dim=-1) * sin


class Llama(nn.Module):
    """Llama language model returning the mean next-token cross-entropy of ``(ids, targets)``."""

    def __init__(self, hidden: int, layers: int, heads: int, intermediate: int, seq: int = 2048,
                 vocab: int = 32000, dtype: torch.dtype = torch.bfloat16,
                 kv_heads: int | None = None) -> None:
        super().__init__()
        self.heads, self.seq = heads, seq
        self.embed = nn.Embedding(vocab, hidden, dtype=dtype)
        self.blocks = nn.ModuleList(LlamaBlock(hidden, heads, intermediate, dtype, kv_heads)
                                    for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)
        self.head = nn.Linear(hidden, vocab, bias=False, dtype=dtype)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Loss of predicting ``targets`` (batch, seq) from ``ids`` (batch, seq)."""
        s, d = ids.shape[1], self.embed.embedding_dim // self.heads
        # theta_i = 10000^(-2i/d) [Su et al., eq. 15]
        inv = 10000.0 ** (-torch.arange(0, d, 2, device=ids.device, dtype=torch.float32) / d)
        angles = torch.outer(torch.arange(s, device=ids.device, dtype=torch.float32), inv)
        angles = torch.cat((angles, angles), dim=-1)
        x = self.embed(ids)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


# Touvron et al., arXiv:2302.13971, Table 2 (intermediate size 2/3 * 4h rounded up to 256)
LLAMA_CONFIGS: dict[str, dict[str, int]] = {
    "llama-7b": dict(hidden=4096, layers=32, heads=32, intermediate=11008),
    "llama-13b": dict(hidden=5120, layers=40, heads=40, intermediate=13824),
    "llama-65b": dict(hidden=8192, layers=80, heads=64, intermediate=22016),
    # Llama 2 70B (Touvron et al., arXiv:2307.09288, Table 1 and sec. 2.2; its released config:
    # 8 key/value heads, intermediate size 28672): 69.0B parameters at vocabulary 32000
    "llama2-70b": dict(hidden=8192, layers=80, heads=64, intermediate=28672, kv_heads=8),
}


def llama(name_or_sizes: str | dict[str, int], batch: int, seq: int = 2048, vocab: int = 32000,
          **kw: Any) -> tuple[Llama, tuple[torch.Tensor, ...]]:
    """A :class:`Llama` built under ``FakeTensorMode`` and example inputs of ``batch``
    sequences; ``name_or_sizes`` is a key of :data:`LLAMA_CONFIGS` or a dict of its sizes."""
    from autopar._torch_private import FakeTensorMode

    sizes = LLAMA_CONFIGS[name_or_sizes] if isinstance(name_or_sizes, str) else dict(name_or_sizes)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = Llama(seq=seq, vocab=vocab, **sizes, **kw)
    ids = torch.zeros(batch, seq, dtype=torch.long)
    return model, (ids, ids)


def preset(name: str, batch: int, seq: int = 2048) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """A built-in model by name (:data:`GPT_CONFIGS` or :data:`LLAMA_CONFIGS`), under
    ``FakeTensorMode``, with example inputs of ``batch`` sequences of ``seq`` tokens."""
    if name in GPT_CONFIGS:
        return megatron_gpt(name, batch, seq)
    if name in LLAMA_CONFIGS:
        return llama(name, batch, seq)
    known = ", ".join([*GPT_CONFIGS, *LLAMA_CONFIGS])
    raise ValueError(f"unknown model preset {name!r}; built-in presets: {known}; or give "
                     f"'module:function' returning (model, example_inputs).")


def load_model(spec: str, batch: int, seq: int) -> tuple[Any, Any]:
    """The model and example inputs of ``spec``: a preset name (:func:`preset`) or
    ``module:function``, a function importable from the working directory that is called with
    ``batch=`` and ``seq=`` and returns ``(model, example_inputs)`` (the command line's MODEL).
    Raises ``ValueError`` saying what was given and what is needed."""
    if ":" not in spec:
        return preset(spec, batch, seq)
    module, _, fn = spec.partition(":")
    sys.path.insert(0, str(Path.cwd()))
    try:
        target = getattr(importlib.import_module(module), fn)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"MODEL {spec!r}: cannot load {fn!r} from module {module!r} ({e}); give "
                         f"'module:function' importable from the current directory.") from e
    out = target(batch=batch, seq=seq)
    if not (isinstance(out, tuple) and len(out) == 2):
        raise ValueError(f"MODEL {spec!r}: {fn}(batch=, seq=) must return (model, example_inputs), "
                         f"got {type(out).__name__}")
    return out
