"""Predicted vs measured peak memory and step time of each memory/communication technique.

    torchrun --standalone --nproc_per_node=2 benchmarks/techniques.py [--steps 5] [--topology my.json]

Plans the GPT-2-style test model on this machine's CPU processes (``cpu-gloo`` topology) once
per technique: none, selective and full recomputation (tp=2), sequence parallelism (tp=2),
bf16 autocast (tp=2), and without / with ZeRO-1 and ZeRO-3 (dp=2). Each runs a warm-up step, then
``--steps`` timed steps; the peak memory of one more step is measured with
``autopar.runtime.memory``. Rank 0 prints the table. Like is compared with like: ``step`` is
``pmodel.step()`` alone (forward and backward) against the plan's ``step_time_s``, which excludes
the optimizer; ``with AdamW`` adds ``opt.step()`` on the measured side and ``optimizer_s`` on the
predicted one. CPU timings are noisy: compare the rows of one run with each other, not across
runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import autopar  # noqa: E402
from autopar.runtime.memory import measure_peak_memory  # noqa: E402
from models import build  # noqa: E402

TECHNIQUES = (
    ("none (tp=2)", dict(tp=2)),
    ("selective recompute (tp=2)", dict(tp=2, recompute="selective")),
    ("full recompute (tp=2)", dict(tp=2, recompute="full")),
    ("sequence parallel (tp=2)", dict(tp=2, sequence_parallel=True)),
    ("bf16 autocast (tp=2)", dict(tp=2, mixed_precision="bf16")),
    ("none (dp=2)", dict(dp=2)),
    ("ZeRO-1 (dp=2)", dict(dp=2, zero=1)),
    ("ZeRO-3 (dp=2)", dict(dp=2, zero=3)),
)


def run(name: str, cfg: dict, args: argparse.Namespace) -> list:
    """One row: predicted and measured step time and peak memory per rank (rank 0's)."""
    model, inputs = build("gpt", dim=args.dim, heads=4, layers=args.layers, batch=args.batch,
                          seq=args.seq)
    base = dict(recompute="none", zero=0)  # the row's technique only, nothing chosen for it
    pm = autopar.parallelize(model, autopar.Mesh.from_torchrun(topology=args.topology), inputs,
                             config=autopar.Config(**{**base, **cfg}))
    opt = torch.optim.AdamW(pm.parameters())

    def step() -> None:
        pm.step(*inputs)
        opt.step()
        opt.zero_grad(set_to_none=False)

    step()
    alone, with_opt = [], []
    for _ in range(args.steps):
        alone.append(_timed(lambda: pm.step(*inputs)))
        opt.zero_grad(set_to_none=False)
        with_opt.append(_timed(step))
    peak = measure_peak_memory(step, pm, opt, *inputs).peak_bytes
    p = pm.plan.predicted
    return [name, p["step_time_s"] * 1e3, statistics.median(alone) * 1e3,
            (p["step_time_s"] + p["optimizer_s"]) * 1e3, statistics.median(with_opt) * 1e3,
            p["peak_memory_bytes"] / 2**20, peak / 2**20,
            (p["peak_memory_bytes"] - peak) / peak * 100]


def _timed(fn) -> float:
    """Seconds of ``fn()`` between barriers (the slowest rank's time)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def main() -> None:
    """Run every technique's row on this torchrun job; rank 0 prints the table."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--topology", default="cpu-gloo",
                        help="price the plans on this preset or topology JSON file (`python -m "
                             "autopar calibrate --out F` writes one); default cpu-gloo")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rows = [run(name, cfg, args) for name, cfg in TECHNIQUES]
    if dist.get_rank() == 0:
        print(tabulate(rows, headers=["technique", "step predicted ms", "step measured ms",
                                      "with AdamW predicted ms", "with AdamW measured ms",
                                      "predicted MiB", "measured MiB", "memory error %"],
                       floatfmt=".1f"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
