"""Measured vs predicted step time of every pipeline schedule on this machine's CPU processes.

    torchrun --standalone --nproc_per_node=2 benchmarks/pipeline_schedules.py [--steps 5] [--topology my.json]
    torchrun --standalone --nproc_per_node=4 benchmarks/pipeline_schedules.py --zero 3

Plans a GPT (tied embedding and LM head) with pp=2 and each schedule on the ``cpu-gloo``
topology, runs two warm-up steps and times ``--steps`` more; rank 0 prints a table of the
measured median step time next to the plan's prediction. ``--zero``: the stage's data-parallel
ranks (the processes over pp = 2, tp = 1) shard with this ZeRO stage. Timings on a shared
machine are noisy: compare the schedules with each other within one run.
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
from models import build  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--microbatch", type=int, default=4)
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=None,
                        help="ZeRO stage over the data-parallel ranks (tp = 1); default: one "
                             "pipeline rank per stage, as the planner places it")
    parser.add_argument("--topology", default="cpu-gloo",
                        help="price the plans on this preset or topology JSON file (`python -m "
                             "autopar calibrate --out F` writes one); default cpu-gloo")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = autopar.Mesh.from_torchrun(topology=args.topology)
    rows = []
    for schedule, v in SCHEDULES:
        model, inputs = build("gpt", dim=args.dim, layers=args.layers, batch=args.batch, seq=64)
        zero = {} if args.zero is None else dict(dp=dist.get_world_size() // 2, tp=1,
                                                 zero=args.zero)
        config = autopar.Config(pp=2, schedule=schedule, virtual_stages=v,
                                microbatch_size=args.microbatch, **zero)
        pm = autopar.parallelize(model, mesh, inputs, config=config)
        times = []
        for i in range(args.steps + 2):
            dist.barrier()
            t0 = time.perf_counter()
            pm.step(*inputs)
            dist.barrier()
            if i >= 2:
                times.append(time.perf_counter() - t0)
        pipe = pm.plan.pipeline
        rows.append([schedule, v, pipe.microbatches, f"{statistics.median(times) * 1e3:.1f}",
                     f"{pm.plan.predicted['step_time_s'] * 1e3:.1f}",
                     f"{pipe.predicted['bubble_fraction']:.0%}"])
    if dist.get_rank() == 0:
        zero = "" if args.zero is None else f", dp={dist.get_world_size() // 2} ZeRO-{args.zero}"
        print(f"GPT dim={args.dim} layers={args.layers} batch={args.batch} seq=64, pp=2{zero}, "
              f"microbatch {args.microbatch}, {dist.get_world_size()} CPU processes (gloo)")
        print(tabulate(rows, headers=["schedule", "v", "microbatches", "measured ms",
                                      "predicted ms", "predicted bubble"]))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
