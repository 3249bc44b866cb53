"""Published training runs the cost model was not fitted on: predicted vs published step time.

    python benchmarks/published_runs.py [--sources korthikanti2022 dgxc_v24_11_1] [--json out.json]

The rows are in ``benchmarks/data/published_runs.json``, each copied from its source with the
source's own words (``quote``) and every value the source does not print marked "not given"
(``sources`` names the papers, READMEs and commits). This script prices the rows whose model and
parallel layout the sources give, with 16-bit weights (bf16 or "mixed precision"; the FP8 rows
are left out): the model (a Megatron GPT or a Llama of the row's sizes, built under
FakeTensorMode) on a virtual mesh of the row's GPUs (``a100-dgx`` or ``h100-dgx``, 8 per node),
its layout as a fixed :class:`~autopar.cost_models.training_step.Setup` (the row's tp, pp, cp,
dp, microbatch, global batch, interleaving, recomputation and sequence parallelism; the same
number of layers on every stage, as Megatron-LM splits them), through the planner's own pricing
(:meth:`autopar.planning.search.LayerSolver.price`). What a source leaves out is assumed and
listed per row (``assumed``). A source that gives TFLOP/s per GPU is turned into a step time with
that source's FLOP count (Megatron-LM's ``72 B s l h^2 (1 + s/(6h) + V/(12 l h))``, without
recomputation: its README's TFLOP/s divided by its MFU is 989, the H100's peak).

Reported: each row's error (predicted / published - 1), the median |error| over the rows and
per source, and per source the rank correlation (Spearman) of predicted and published times.
The only fitted constant involved is ``a100-dgx``'s matmul efficiency (SC'21 Table 1 rows 1, 3,
5, 7, 9: none of these rows).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import numpy as np
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autopar  # noqa: E402
from autopar.cost_models.training_step import Setup  # noqa: E402
from autopar.model_presets import llama, megatron_gpt  # noqa: E402
from autopar.planning.search import LayerSolver  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "published_runs.json")
# the sources whose rows give the model, the layout and a step time or TFLOP/s per GPU
PRICED = ("korthikanti2022", "dgxc_v24_11_1", "megatron_readme_2024")


def value(v: Any) -> Any:
    """A row field's value: the number itself, a derived or cross-referenced ``{"value": ...}``'s
    value, or None for "not given" (and other text)."""
    if isinstance(v, dict):
        return value(v.get("value"))
    if isinstance(v, bool) or v is None:
        return v
    if isinstance(v, (int, float)):
        return v
    return None


def priced_rows(path: str = DATA, sources: tuple[str, ...] = PRICED) -> list[dict]:
    """The rows of ``sources`` this script can price: 16-bit, with tp and pp given, a step time
    or TFLOP/s per GPU, and a model of known layers, hidden size and heads."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    out = []
    for r in rows:
        p, m = r["parallel"], r["model"]
        if r["source_id"] not in sources or "fp8" in str(p.get("precision", "")).lower():
            continue
        if None in (value(p.get("tp")), value(p.get("pp")), value(m.get("layers")), value(m.get("hidden")),
                    value(m.get("heads")), value(p.get("global_batch"))):
            continue  # (the dgxc GPT-3 and Nemotron-4 rows print no heads)
        if "nemotron" in m["name"].lower():
            continue  # squared-ReLU MLP: no preset model
        if r["metric"]["unit"] not in ("s", "TFLOP/s/GPU"):
            continue
        out.append(r)
    return out


def megatron_model_flops(batch: int, seq: int, layers: int, hidden: int, vocab: int) -> float:
    """Megatron-LM's model FLOPs of one iteration without recomputation (Korthikanti et al.,
    arXiv:2205.05198, sec. 6, the MFU numerator; Megatron-LM ``num_floating_point_operations``
    for a GPT): ``72 B s l h^2 (1 + s / (6 h) + V / (12 l h))``."""
    return 72 * batch * seq * layers * hidden**2 * (1 + seq / (6 * hidden) + vocab / (12 * layers * hidden))


def published_seconds(row: dict) -> float:
    """The row's published seconds per iteration (its own, or from its TFLOP/s per GPU)."""
    metric = row["metric"]
    if metric["unit"] == "s":
        return float(metric["value"])
    m, p = row["model"], row["parallel"]
    flops = megatron_model_flops(value(p["global_batch"]), value(m["seq_len"]), value(m["layers"]),
                                 value(m["hidden"]), value(m["vocab"]))
    return flops / (float(metric["value"]) * 1e12 * value(p["gpus"]))


def layout(row: dict) -> tuple[Setup, list[str]]:
    """The row's parallel layout as a Setup, and what was assumed where the source is silent."""
    p = row["parallel"]
    assumed = []
    tp, pp, gpus = value(p["tp"]), value(p["pp"]), value(p["gpus"])
    cp = value(p.get("cp")) or 1
    dp = gpus // (tp * pp * cp)
    mbs = value(p.get("microbatch"))
    if mbs is None:
        mbs = 1
        assumed.append("microbatch 1")
    gbs = value(p["global_batch"])
    vp = value(p.get("virtual_pipeline_interleave")) or 1
    recompute = str(p.get("recomputation", "")).lower()
    if recompute.startswith("full"):
        recompute = "full"
    elif recompute.startswith("selective"):
        recompute = "selective"
    else:
        assumed.append("no recomputation")
        recompute = "none"
    sp = p.get("sequence_parallel")
    if not isinstance(sp, bool):
        sp = tp > 1
        assumed.append(f"sequence parallel {'on' if sp else 'off'}")
    dist_opt = p.get("distributed_optimizer")
    if isinstance(dist_opt, bool):
        zero = int(dist_opt)
    elif row["source_id"] == "korthikanti2022":  # (2022 Megatron-LM: no distributed optimizer)
        zero = 0
    else:
        zero = 1
        assumed.append("distributed optimizer (ZeRO-1)")
    schedule = "none" if pp == 1 else "interleaved-1f1b" if vp > 1 else "1f1b"
    setup = Setup(dp=dp, tp=tp, pp=pp, cp=cp, microbatch_size=mbs, microbatches=gbs // (dp * mbs),
                  schedule=schedule, virtual_stages=vp if pp > 1 else 1, recompute=recompute,
                  zero=zero, sequence_parallel=sp, even_split=True)
    return setup, assumed


def build(row: dict) -> tuple[Any, Any]:
    """The row's model (under FakeTensorMode) and example inputs of its global batch."""
    m, p = row["model"], row["parallel"]
    sizes = dict(hidden=value(m["hidden"]), layers=value(m["layers"]), heads=value(m["heads"]))
    seq, vocab, batch = value(m["seq_len"]), value(m["vocab"]), value(p["global_batch"])
    if "llama" in m["name"].lower():
        # (the 405B's 8 key-value heads: the README's "16" is a typo, its own FLOP count uses 8)
        sizes.update(intermediate=value(m["ffn"]), kv_heads=8)
        return llama(sizes, batch=batch, seq=seq, vocab=vocab)
    # Megatron-Core (2023 on) runs attention as one fused kernel; SC'21-era Megatron-LM did not
    flash = row["source_id"] != "korthikanti2022"
    return megatron_gpt(sizes, batch=batch, seq=seq, vocab=vocab, flash=flash)


def price(row: dict) -> dict:
    """Predicted seconds of the row's layout, with the row's published seconds."""
    setup, assumed = layout(row)
    topology = "a100-dgx" if "A100" in row["hardware"] else "h100-dgx"
    gpus = value(row["parallel"]["gpus"])
    model, inputs = build(row)
    mesh = autopar.Mesh.virtual(topology, nodes=max(1, gpus // 8), gpus_per_node=min(8, gpus))
    t0 = time.perf_counter()
    cost = LayerSolver(model, inputs, mesh, autopar.Config(), ()).price(setup)
    published = published_seconds(row)
    return {"source": row["source_id"], "model": row["model"]["name"], "gpus": gpus,
            "setup": setup.describe(), "topology": topology, "assumed": assumed,
            "published_s": published, "predicted_s": cost.step_time_s,
            "error": cost.step_time_s / published - 1, "price_s": time.perf_counter() - t0}


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of ``a`` and ``b`` (ties at their mean rank)."""
    def ranks(x: list[float]) -> np.ndarray:
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=float)
        for v in set(x):  # ties share their mean rank
            idx = [i for i, y in enumerate(x) if y == v]
            r[idx] = r[idx].mean()
        return r
    ra, rb = ranks(a), ranks(b)
    return float(np.corrcoef(ra, rb)[0, 1]) if len(a) > 2 else float("nan")


def summary(results: list[dict]) -> list[list[Any]]:
    """Per source and overall: rows, median |error|, Spearman of predicted and published."""
    out = []
    for src in [*dict.fromkeys(r["source"] for r in results), None]:
        rs = [r for r in results if src is None or r["source"] == src]
        out.append([src or "all", len(rs), statistics.median(abs(r["error"]) for r in rs),
                    spearman([r["published_s"] for r in rs], [r["predicted_s"] for r in rs])])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sources", nargs="+", default=list(PRICED), choices=PRICED)
    ap.add_argument("--json", help="write every row's figures to this file")
    args = ap.parse_args(argv)
    results = []
    for row in priced_rows(sources=tuple(args.sources)):
        r = price(row)
        results.append(r)
        print(f"{r['source']:22s} {r['model'][:28]:28s} {r['gpus']:5d}  published {r['published_s']:8.3f} s"
              f"  predicted {r['predicted_s']:8.3f} s  {r['error']:+.1%}  ({r['price_s']:.0f} s)", flush=True)
    print(tabulate([[r["source"], r["model"][:30], r["gpus"], r["setup"], r["published_s"], r["predicted_s"],
                     f"{r['error']:+.1%}", "; ".join(r["assumed"])] for r in results],
                   headers=["source", "model", "GPUs", "layout", "published s", "predicted s", "error",
                            "assumed"], floatfmt=".3f"))
    print(tabulate(summary(results), headers=["source", "rows", "median |error|", "Spearman"],
                   floatfmt=".3f"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
