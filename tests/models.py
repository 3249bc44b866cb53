"""Models used across the tests: plain-torch MLP and GPT, and Hugging Face GPT-2 / Llama built
from small configs (never downloaded). Every model returns its scalar training loss."""

from __future__ import annotations

import os

import torch
import torch.nn as nn
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")


class MLP(nn.Module):
    """Two-layer MLP regression model with a mean-squared-error loss."""

    def __init__(self, d_in: int = 64, d_hidden: int = 256, d_out: int = 32) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.fc2(F.gelu(self.fc1(x))), y)


class Block(nn.Module):
    """GPT-2 block: LayerNorm, fused QKV projection, SDPA (causal), GELU MLP; ``explicit``
    computes attention as matmul, mask, softmax, matmul (its s x s values are saved);
    ``kernel`` 1-3 calls CUDA's cuDNN, FlashAttention or memory-efficient op instead of SDPA
    (run on the CPU by ``tests/cuda_kernels_on_cpu.py``)."""

    def __init__(self, dim: int, heads: int, explicit: bool = False, kernel: int = 0) -> None:
        super().__init__()
        self.heads, self.explicit, self.kernel = heads, explicit, kernel
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        shape = (b, t, self.heads, c // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        if self.explicit:
            scores = (q @ k.transpose(-2, -1)) * (c // self.heads) ** -0.5
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1) @ v
        elif self.kernel:
            from cuda_kernels_on_cpu import attention

            y = attention(q, k, v, self.kernel)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """A GPT-2-style language model in plain torch, its embedding and LM head tied unless
    ``tied=0``."""

    def __init__(self, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 2,
                 seq: int = 16, explicit: int = 0, tied: int = 1, kernel: int = 0) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, bool(explicit), kernel) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def hf_gpt2(vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 32) -> nn.Module:
    """Hugging Face GPT2LMHeadModel from a small config, dropouts off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=vocab, n_positions=seq, n_embd=dim, n_layer=layers, n_head=heads,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(cfg)
    model.loss_type = "ForCausalLM"
    return model


def hf_llama(vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 2, seq: int = 32) -> nn.Module:
    """Hugging Face LlamaForCausalLM (RoPE, RMSNorm, SwiGLU) from a small config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=dim, intermediate_size=2 * dim,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=seq)
    model = LlamaForCausalLM(cfg)
    model.loss_type = "ForCausalLM"
    return model


# encoder-decoder families of transformers, each from a tiny config (dropouts off); the labels
# are the input ids, shifted into decoder inputs by the model itself (``shift_tokens_right``)
SEQ2SEQ = ("t5", "bart", "pegasus", "marian", "mbart")


def hf_seq2seq(kind: str, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 2,
               seq: int = 32) -> nn.Module:
    """A transformers encoder-decoder model (``SEQ2SEQ``) from a small config."""
    import transformers as tf

    if kind == "t5":
        cfg = tf.T5Config(vocab_size=vocab, d_model=dim, d_kv=dim // heads, d_ff=2 * dim,
                          num_layers=layers, num_heads=heads, dropout_rate=0.0,
                          decoder_start_token_id=0, pad_token_id=0)
        return tf.T5ForConditionalGeneration(cfg)
    names = {"bart": ("BartConfig", "BartForConditionalGeneration"),
             "pegasus": ("PegasusConfig", "PegasusForConditionalGeneration"),
             "marian": ("MarianConfig", "MarianMTModel"),
             "mbart": ("MBartConfig", "MBartForConditionalGeneration")}[kind]
    cfg = getattr(tf, names[0])(
        vocab_size=vocab, d_model=dim, encoder_layers=layers, decoder_layers=layers,
        encoder_attention_heads=heads, decoder_attention_heads=heads, encoder_ffn_dim=2 * dim,
        decoder_ffn_dim=2 * dim, max_position_embeddings=seq, dropout=0.0, attention_dropout=0.0,
        activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2, bos_token_id=0,
        eos_token_id=2)
    return getattr(tf, names[1])(cfg)


# mixture-of-experts families of transformers, each from a tiny config: 4 routed experts, 2 a
# token (DeepSeek-V3: one dense layer first, a shared expert, grouped routing)
MOE = ("mixtral", "qwen2moe", "qwen3moe", "granitemoe", "olmoe", "phimoe", "jetmoe", "dbrx",
       "deepseekv3")


def hf_moe(kind: str, vocab: int = 128, dim: int = 64, heads: int = 4, layers: int = 2,
           seq: int = 32, experts: int = 4, dense: int = 1) -> nn.Module:
    """A transformers mixture-of-experts causal LM (``MOE``) from a small config (``dense``:
    DeepSeek-V3's dense first layers)."""
    import transformers as tf

    base = dict(vocab_size=vocab, hidden_size=dim, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                num_experts_per_tok=2, pad_token_id=0, bos_token_id=0, eos_token_id=0)
    routed = dict(num_experts=experts, moe_intermediate_size=dim, intermediate_size=2 * dim)
    extra = {
        "mixtral": ("Mixtral", dict(num_local_experts=experts, intermediate_size=2 * dim)),
        "qwen2moe": ("Qwen2Moe", dict(routed, shared_expert_intermediate_size=dim)),
        "qwen3moe": ("Qwen3Moe", dict(routed, head_dim=dim // heads)),
        "granitemoe": ("GraniteMoe", dict(num_local_experts=experts, intermediate_size=2 * dim)),
        "olmoe": ("Olmoe", dict(num_experts=experts, intermediate_size=dim)),
        "phimoe": ("Phimoe", dict(num_local_experts=experts, intermediate_size=2 * dim)),
        "jetmoe": ("JetMoe", dict(num_local_experts=experts, intermediate_size=2 * dim,
                                  kv_channels=dim // heads)),
        "deepseekv3": ("DeepseekV3", dict(
            n_routed_experts=experts, n_shared_experts=1, moe_intermediate_size=dim,
            intermediate_size=2 * dim, first_k_dense_replace=dense, n_group=2, topk_group=1,
            kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=16)),
    }
    if kind == "dbrx":
        cfg = tf.DbrxConfig(d_model=dim, n_heads=heads, n_layers=layers, max_seq_len=seq,
                            vocab_size=vocab, attn_config={"kv_n_heads": heads, "rope_theta": 10000.0,
                                                           "clip_qkv": 8.0},
                            ffn_config={"moe_num_experts": experts, "moe_top_k": 2,
                                        "ffn_hidden_size": 2 * dim})
        return tf.DbrxForCausalLM(cfg)
    name, more = extra[kind]
    if kind == "jetmoe":
        base.pop("num_attention_heads")
    cfg = getattr(tf, f"{name}Config")(**{**base, **more})
    model = getattr(tf, f"{name}ForCausalLM")(cfg)
    if kind == "phimoe":
        # its router samples the experts in training (Gumbel noise, SparseMixer): random like
        # dropout, so compared with one process with the routing of inference (the top-k)
        model.eval()
    return model


def slow_compute():
    """A cost topology with compute 1e4x slower than an A100 and links 10x faster than its
    NVLink: the solver shards every op it can, which exercises sharding on small models."""
    from autopar.cost_models.links import AxisLink
    from autopar.cost_models.topology import custom

    fast = AxisLink(bandwidth_Bps=2e12, latency_s=1e-9, launch_s=1e-9)
    return custom("slow-compute", base="a100-dgx", peak_flops={"fp32": 2e9, "bf16": 3e10},
                  mem_bandwidth_Bps=2e8, intra_node=fast, inter_node=fast)


def build(kind: str, seed: int = 0, **kw: int) -> tuple[nn.Module, object]:
    """A model of ``kind`` with deterministic weights and a matching example batch."""
    torch.manual_seed(seed)
    if kind == "mlp":
        model = MLP(**kw)
        g = torch.Generator().manual_seed(seed + 1)
        inputs = (torch.randn(8, model.fc1.in_features, generator=g),
                  torch.randn(8, model.fc2.out_features, generator=g))
        return model, inputs
    batch = kw.pop("batch", 4)
    seq = kw.pop("seq", 16)
    if kind in SEQ2SEQ:
        model = hf_seq2seq(kind, seq=seq, **kw)
    elif kind in MOE:
        model = hf_moe(kind, seq=seq, **kw)
    else:
        model = {"gpt": GPT, "gpt2": hf_gpt2, "llama": hf_llama}[kind](seq=seq, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 128, (batch, seq), generator=g)
    if kind == "gpt":
        tgt = torch.randint(0, 128, (batch, seq), generator=g)
        return model, (ids, tgt)
    return model, {"input_ids": ids, "labels": ids}
