"""Capture and planning time of a 1.5B-parameter GPT on virtual H100 clusters, without memory.

    python benchmarks/plan_scale.py [--nodes 1 2]

Builds the model under FakeTensorMode (no weights allocated), captures the joint graph once and
plans it for each cluster (pipelined plans are searched on clusters of more than one node);
prints capture time, plan time, the chosen degrees, the ILP size before and after linking
identical layers, and the peak RSS of the process (``--print-plan``: the last plan too).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from tabulate import tabulate

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

import autopar  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.solver.planner import make_plan  # noqa: E402
from models import GPT  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--print-plan", action="store_true", help="print the last plan")
    args = parser.parse_args()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = GPT(vocab=50304, dim=1600, heads=25, layers=48, seq=1024)
    ids = torch.randint(0, 50304, (args.batch, 1024))
    n_params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    traced = capture(model, (ids, ids))
    capture_s = time.perf_counter() - t0
    rows = []
    for nodes in args.nodes:
        mesh = autopar.Mesh.virtual("h100-dgx", nodes=nodes, gpus_per_node=8)
        t0 = time.perf_counter()
        plan = make_plan(traced, mesh, autopar.Config(), model=model, example_inputs=(ids, ids))
        rows.append([f"{nodes} x 8 h100-dgx", f"{capture_s:.1f}", f"{time.perf_counter() - t0:.1f}",
                     plan.degrees, plan.solver["ilp_variables_unlinked"], plan.solver["ilp_variables"],
                     f"{plan.predicted['step_time_s'] * 1e3:.1f}"])
    print(f"GPT with {n_params / 1e9:.2f} B parameters, batch {args.batch} x 1024 tokens")
    print(tabulate(rows, headers=["cluster", "capture s", "plan s", "degrees", "ILP vars unlinked",
                                  "ILP vars linked", "predicted step ms"]))
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    if args.print_plan:
        print(plan)


if __name__ == "__main__":
    main()
