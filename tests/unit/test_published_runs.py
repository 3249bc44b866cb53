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
