"""Long-context training on virtual H100 clusters: the planner's price of a published 131K-token
run, and what the setup search chooses for the same model and cluster.

    python benchmarks/long_context.py [--search] [--json out.json]

The published run is Llama 3 405B's long-context stage (Llama Team, "The Llama 3 Herd of
Models", arXiv:2407.21783, Table 4, row 3: 16,384 H100s, TP 8, CP 16, PP 16, sequence
131,072, 16 sequences per data-parallel replica, 16M tokens a batch, 380 TFLOP/s per GPU; the
row as copied, with its caveats, is in ``data/published_runs.json``, source ``llama3_herd``).
Its printed DP (4) does not multiply out to its GPUs: DP 8 does, and gives its 16M tokens
(8 x 16 x 131,072), so DP 8 is priced. What the paper leaves out is assumed and printed: one
sequence per microbatch, the interleaved schedule with 2 or 4 virtual stages (it says
interleaved, not how many), each recomputation setting in turn, sequence parallelism, and
ZeRO-1 (its FSDP shards the optimizer states and gradients and keeps the weights whole after
the forward: ZeRO-2, which autopar runs as the same program as ZeRO-1, ``Config.zero``).

The paper gives TFLOP/s, not seconds; turning them into a step time needs its FLOP count,
which it does not print. Two counts bracket it: the matmuls (6 FLOPs per weight per token,
forward and backward) plus attention's score and value products over every key (12 x layers x
sequence x hidden per token, the usual convention), or over the causal half (what the kernels
compute). At 131K tokens attention is a large share: the first count is 40% above the second,
so the comparison is a range.

``--search`` also runs the setup search on the same model, cluster and batch (tensor
parallelism pinned to 8, one node, as every published run of this size has it), which prints
its best setups and whether they take cp > 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autopar  # noqa: E402
from autopar.cost_models.training_step import Setup  # noqa: E402
from autopar.model_presets import llama  # noqa: E402
from autopar.planning.search import LayerSolver, search  # noqa: E402

# Llama 3 405B (the paper's Table 3)
SIZES = dict(hidden=16384, layers=126, heads=128, kv_heads=8, intermediate=53248)
VOCAB, SEQ = 128000, 131072
GPUS, TP, CP, PP, DP, PER_REPLICA = 16384, 8, 16, 16, 8, 16
PUBLISHED_TFLOPS = 380.0


def flops_per_token(causal_half: bool) -> float:
    """Training FLOPs per token (forward and backward: 3 x the forward) of the model above."""
    h, layers, kv = SIZES["hidden"], SIZES["layers"], SIZES["kv_heads"]
    head_dim = h // SIZES["heads"]
    weights = layers * (2 * h * h + 2 * h * kv * head_dim + 3 * h * SIZES["intermediate"])
    weights += h * VOCAB  # (the output projection; the embedding is a lookup)
    attention = layers * 2 * 2 * SEQ * h * (0.5 if causal_half else 1.0)
    return 3 * (2 * weights + attention)


def published_step_s(causal_half: bool) -> float:
    """The published run's seconds per step under one FLOP count."""
    tokens = DP * PER_REPLICA * SEQ
    return tokens * flops_per_token(causal_half) / (PUBLISHED_TFLOPS * 1e12 * GPUS)


def price_published(solver: LayerSolver, recompute: str, virtual: int) -> dict[str, Any]:
    """The published layout priced by the planner with ``recompute`` and ``virtual`` stages per
    pipeline rank."""
    setup = Setup(dp=DP, tp=TP, pp=PP, cp=CP, microbatch_size=1, microbatches=PER_REPLICA,
                  schedule="interleaved-1f1b", virtual_stages=virtual, recompute=recompute, zero=1,
                  sequence_parallel=True, even_split=True)
    t0 = time.perf_counter()
    cost = solver.price(setup)
    row = {"setup": setup.describe(), "predicted_s": cost.step_time_s, "fits": bool(cost.fits),
           "peak_gib": max(cost.rank_memory_bytes) / 2**30, "price_s": time.perf_counter() - t0,
           "parts_s": {k: float(v) for k, v in cost.parts.items()},
           "stage_time_s": [float(t) for t in cost.stage_time_s[:2]]}
    for name, causal in (("all keys", False), ("causal half", True)):
        published = published_step_s(causal)
        row[f"published_s ({name})"] = published
        row[f"error ({name})"] = cost.step_time_s / published - 1
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--search", action="store_true", help="also run the setup search")
    ap.add_argument("--json", help="write the figures to this file")
    args = ap.parse_args(argv)
    model, inputs = llama(SIZES, batch=DP * PER_REPLICA, seq=SEQ, vocab=VOCAB)
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=GPUS // 8, gpus_per_node=8)
    solver = LayerSolver(model, inputs, mesh, autopar.Config(mixed_precision="bf16"), ())
    rows = [price_published(solver, r, v) for r in ("none", "selective", "full") for v in (2, 4)]
    for r in rows:
        print(json.dumps(r, default=str))
    out: dict[str, Any] = {"published_layout": rows}
    if args.search:
        t0 = time.perf_counter()
        result = search(model, inputs, mesh, autopar.Config(tp=TP, mixed_precision="bf16"),
                        layers=solver, progress=print)
        out["search_s"] = time.perf_counter() - t0
        out["search"] = [{"setup": c.setup.describe(), "step_s": c.step_time_s}
                         for c in result.ranked[:5]]
        for r in out["search"]:
            print(json.dumps(r))
        print(f"searched in {out['search_s']:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
