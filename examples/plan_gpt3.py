"""Plan GPT-3 175B for a virtual cluster of 1,024 A100s (128 DGX nodes of 8), on this machine.

    python examples/plan_gpt3.py                       # about a minute on 2 CPU cores
    python examples/plan_gpt3.py --json plan.json --trace step.json --svg step.svg

The model is built under ``FakeTensorMode``: no weight is ever allocated. ``autopar.search``
(``autopar.plan`` with alternatives) searches degrees (tp inside a node), pipeline schedule and
microbatches, recomputation, ZeRO-1 and sequence parallelism from one per-layer ILP per
distinct layer shape, then solves the winner's per-operator placements (a runnable plan), and
prints it; Megatron-LM's authors used tp=8, pp=16, dp=8, microbatch 1 and the interleaved
schedule for this model (Narayanan et al., SC'21, Table 1).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Sequence

import autopar
from autopar.model_presets import megatron_gpt


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt3-175b", help="a GPT preset of autopar.model_presets")
    p.add_argument("--nodes", type=int, default=128)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--hardware", default="a100-dgx")
    p.add_argument("--batch", type=int, default=1536, help="global batch (sequences)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--json", type=Path)
    p.add_argument("--trace", type=Path, help="Chrome trace of the simulated step")
    p.add_argument("--svg", type=Path, help="SVG timeline of the simulated step")
    return p


def main(argv: Sequence[str] | None = None) -> autopar.Plan:
    """Search the cluster setup; print and optionally save the plan. Returns it."""
    args = _parser().parse_args(argv)
    model, inputs = megatron_gpt(args.preset, batch=args.batch, seq=args.seq)
    mesh = autopar.Mesh.virtual(args.hardware, nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    t0 = time.perf_counter()
    plan = autopar.search(model, mesh, inputs, progress=lambda msg: print("  " + msg, flush=True))
    print(f"planned in {time.perf_counter() - t0:.1f} s\n")
    print(plan)
    flops = plan.predicted["model_flops"] / plan.step_breakdown()["total_s"] / mesh.size
    print(f"\npredicted {flops / 1e12:.0f} TFLOP/s per GPU (model FLOPs, no recomputation)")
    if args.json:
        plan.save(args.json)
        print(f"plan saved to {args.json}")
    if args.trace:
        print(f"Chrome trace written to {plan.to_chrome_trace(args.trace)}")
    if args.svg:
        print(f"SVG timeline written to {plan.to_svg(args.svg)}")
    return plan


if __name__ == "__main__":
    main()
