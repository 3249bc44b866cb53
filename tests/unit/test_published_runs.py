"""The published-runs benchmark's reading of its rows (benchmarks/published_runs.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import published_runs as pr  # noqa: E402


def test_rows_priced_per_source() -> None:
    rows = pr.priced_rows()
    by_source = {s: [r for r in rows if r["source_id"] == s] for s in pr.PRICED}
    # Korthikanti et al. 2022: 4 models x 2 recomputation settings, and the 530B on 2,240 GPUs;
    # the 2024 Megatron-LM README's 9 table rows; dgxc's bf16 Llama 3.1 rows (Nemotron-4 and
    # GPT-3 print no heads: not priced)
    assert (len(by_source["korthikanti2022"]), len(by_source["megatron_readme_2024"])) == (9, 9)
    assert len(by_source["dgxc_v24_11_1"]) == 17
    assert not any("fp8" in str(r["parallel"].get("precision", "")).lower() for r in rows)


def test_layout_of_a_row_follows_the_source() -> None:
    row = next(r for r in pr.priced_rows() if r["source_id"] == "korthikanti2022"
               and r["model"]["name"].startswith("GPT 175B") and "selective" in r["parallel"]["recomputation"])
    setup, assumed = pr.layout(row)
    assert (setup.dp, setup.tp, setup.pp, setup.virtual_stages, setup.microbatches) == (1, 8, 8, 3, 64)
    assert setup.recompute == "selective" and setup.sequence_parallel and setup.schedule == "interleaved-1f1b"
    assert assumed == []  # (the paper gives every field this script reads)


def test_readme_tflops_use_megatrons_flop_count() -> None:
    """The README's TFLOP/s divided by its MFU is the H100's 989 TFLOP/s, and the step time this
    script derives from them with Megatron's FLOP count gives that MFU back."""
    row = next(r for r in pr.priced_rows() if r["source_id"] == "megatron_readme_2024"
               and r["model"]["name"] == "GPT 177B")
    mfu = next(m["value"] for m in row["other_metrics"] if m["name"] == "MFU") / 100
    assert row["metric"]["value"] / mfu == pytest.approx(989, rel=0.02)
    m, p = row["model"], row["parallel"]
    flops = pr.megatron_model_flops(p["global_batch"], m["seq_len"], m["layers"], m["hidden"], m["vocab"])
    assert flops / pr.published_seconds(row) / p["gpus"] / 989e12 == pytest.approx(mfu, rel=0.02)


def test_spearman() -> None:
    assert pr.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert pr.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert pr.spearman([1, 2, 3, 4], [1, 3, 2, 4]) == pytest.approx(0.8)


def test_flash_gpt_and_grouped_llama_compute_the_same_model() -> None:
    """The layouts the published rows are priced with are the same functions: Megatron-Core's
    fused attention equals SC'21's materialised one (no dropout), and the Llama preset's grouped
    QKV equals attention over separately projected q, k and v of the same weights."""
    import torch
    import torch.nn.functional as F

    from autopar.model_presets import Llama, MegatronGPT

    torch.manual_seed(0)
    ids, tgt = torch.randint(0, 100, (2, 32)), torch.randint(0, 100, (2, 32))
    plain = MegatronGPT(hidden=64, layers=2, heads=4, seq=32, vocab=100, dropout=0.0, dtype=torch.float32)
    flash = MegatronGPT(hidden=64, layers=2, heads=4, seq=32, vocab=100, dropout=0.0, dtype=torch.float32,
                        flash=True)
    flash.load_state_dict(plain.state_dict())
    torch.testing.assert_close(flash(ids, tgt), plain(ids, tgt))

    model = Llama(hidden=64, layers=1, heads=8, intermediate=96, seq=32, vocab=100, dtype=torch.float32,
                  kv_heads=2)
    block, d, g = model.blocks[0], 8, 4
    x = torch.randn(2, 32, 64)
    s = torch.arange(32, dtype=torch.float32)[:, None] * 10000.0 ** (-torch.arange(0, d, 2) / d)
    cos, sin = torch.cat((s, s), -1).cos(), torch.cat((s, s), -1).sin()
    w = block.qkv.weight.view(2, g + 2, d, 64)  # per k/v group: its g query heads, k, v
    q = (block.norm1(x) @ w[:, :g].reshape(-1, 64).T).view(2, 32, 8, d).transpose(1, 2)
    k, v = ((block.norm1(x) @ w[:, j].reshape(-1, 64).T).view(2, 32, 2, d).transpose(1, 2)
            for j in (g, g + 1))
    from autopar.model_presets import _rotate
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    k, v = (t.repeat_interleave(g, dim=1) for t in (k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 32, 64)
    h = x + block.proj(y)
    gate, up = block.gate_up(block.norm2(h)).chunk(2, dim=-1)
    torch.testing.assert_close(block(x, cos, sin), h + block.down(F.silu(gate) * up))
