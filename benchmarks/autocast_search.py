"""The setup search under bf16 autocast against its per-operator plans, without devices.

    python benchmarks/autocast_search.py              # every row (about 6 minutes here)
    python benchmarks/autocast_search.py --rows pp2-zero3

A Llama-shaped model (hidden 4,096, 32 heads, intermediate 11,008: Llama 7B's layer; 8 layers
unless the row says 32) at 4,096 tokens per sequence on 64 virtual H100s (8 DGX nodes), built
under ``FakeTensorMode`` twice: in bf16 (what the presets are) and in fp32 planned with
``Config(mixed_precision="bf16")`` (fp32 master weights, bf16 matmuls: what most training
scripts run). Each row forces the degrees and ZeRO stage named and lets ``autopar.plan`` choose
the rest; it prints the search's closed-form price of the chosen setup (step seconds, peak GB
per GPU) next to the per-operator plan's, which the search realizes. The search's peak is the
number it prunes setups with; the per-operator one is what the realized plan is checked
against. The row's planning seconds are this machine's.
"""

from __future__ import annotations

import argparse
import time

import torch
from tabulate import tabulate

import autopar
from autopar.model_presets import llama

_LAYER = dict(hidden=4096, heads=32, intermediate=11008)
ROWS = {
    "pp1-zero1": dict(layers=8, batch=128, config=dict(tp=1, pp=1, zero=1)),
    "pp1-zero3": dict(layers=8, batch=128, config=dict(tp=1, pp=1, zero=3)),
    "pp2-zero0": dict(layers=8, batch=128, config=dict(tp=1, pp=2, dp=32, zero=0)),
    "pp2-zero1": dict(layers=8, batch=128, config=dict(tp=1, pp=2, dp=32, zero=1)),
    "pp2-zero3": dict(layers=8, batch=128, config=dict(tp=1, pp=2, dp=32, zero=3)),
    "32-layers": dict(layers=32, batch=64, config=dict(tp=1, pp=1)),
}


def run_row(name: str, precision: str) -> list:
    """Plan one row in ``precision`` ("bf16": a bf16 model; "autocast": fp32 under autocast)."""
    row = ROWS[name]
    dtype, mp = (torch.bfloat16, None) if precision == "bf16" else (torch.float32, "bf16")
    model, inputs = llama(dict(_LAYER, layers=row["layers"]), batch=row["batch"], seq=4096,
                          dtype=dtype)
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=8, gpus_per_node=8)
    t0 = time.perf_counter()
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(mixed_precision=mp,
                                                                   **row["config"]))
    seconds = time.perf_counter() - t0
    pr = plan.predicted
    search_gb, per_op_gb = pr["search_peak_memory_bytes"] / 1e9, pr["peak_memory_bytes"] / 1e9
    return [name, precision, plan.solver["setup"], f"{pr['search_step_time_s']:.3f}",
            f"{pr['step_time_s'] + pr.get('optimizer_s', 0.0):.3f}", f"{search_gb:.2f}",
            f"{per_op_gb:.2f}", f"{(search_gb / per_op_gb - 1) * 100:+.1f}%", f"{seconds:.0f}"]


def main(argv: list[str] | None = None) -> list[list]:
    """Run the rows; print and return the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args(argv)
    table = [run_row(name, p) for name in args.rows for p in ("bf16", "autocast")]
    print(tabulate(table, headers=["row", "precision", "chosen setup", "search step s",
                                   "per-op step s", "search GB", "per-op GB", "search vs per-op",
                                   "plan s"]))
    return table


if __name__ == "__main__":
    main()
