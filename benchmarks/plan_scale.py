"""Planning time and peak memory of ``autopar.plan`` at scale, on this machine, without devices.

    python benchmarks/plan_scale.py                    # both rows, each in a fresh process
    python benchmarks/plan_scale.py --rows gpt3-175b   # one row

Rows: GPT-3 175B (96 identical blocks, fused QKV, batch 1,536 x 2,048) on 1,024 virtual A100s
(128 DGX nodes of 8), and a 1.5B GPT (48 blocks, hidden 1,600, batch 8 x 1,024) on 8 virtual
H100s (one node). Both models are built under ``FakeTensorMode`` (no weight is allocated). Each
row runs ``autopar.plan`` in a fresh Python process (so the peak RSS is that row's) and prints:
the seconds to plan (the setup search, then the per-operator placements of the chosen setup),
the chosen setup, the plan's predicted step next to the search's closed-form price of that
setup, and the process's peak RSS. The plan is saved and loaded back to check the round trip.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

from tabulate import tabulate

ROWS = {
    "gpt3-175b": dict(kind="preset", name="gpt3-175b", batch=1536, seq=2048,
                      hardware="a100-dgx", nodes=128, gpus_per_node=8),
    "gpt-1.5b": dict(kind="gpt", batch=8, seq=1024, hardware="h100-dgx", nodes=1,
                     gpus_per_node=8),
}

_CHILD = textwrap.dedent("""
    import json, os, resource, sys, tempfile, time
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    import autopar
    row = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    if row["kind"] == "preset":
        from autopar.model_presets import megatron_gpt
        model, inputs = megatron_gpt(row["name"], batch=row["batch"], seq=row["seq"])
    else:
        sys.path.insert(0, os.path.join(sys.argv[2], "tests"))
        from models import GPT
        with FakeTensorMode(allow_non_fake_inputs=True):
            model = GPT(vocab=50304, dim=1600, heads=25, layers=48, seq=row["seq"])
        ids = torch.zeros(row["batch"], row["seq"], dtype=torch.long)
        inputs = (ids, ids)
    built = time.perf_counter() - t0
    mesh = autopar.Mesh.virtual(row["hardware"], nodes=row["nodes"],
                                gpus_per_node=row["gpus_per_node"])
    t1 = time.perf_counter()
    plan = autopar.plan(model, mesh, inputs)
    plan_s = time.perf_counter() - t1
    path = os.path.join(tempfile.mkdtemp(), "plan.json")
    plan.save(path)
    again = autopar.Plan.load(path)
    print(json.dumps({
        "build_s": built, "plan_s": plan_s, "search_s": plan.solver.get("search_s", 0.0),
        "placement_s": plan.solver.get("placement_s", 0.0), "setup": plan.solver.get("setup", ""),
        "path": plan.solver.get("path", ""), "degrees": plan.degrees,
        "step_s": plan.predicted["step_time_s"],
        "search_step_s": plan.predicted.get("search_step_time_s", float("nan")),
        "stage_solves": (plan.pipeline.cut_solver.get("distinct_stage_solves")
                         if plan.pipeline else None),
        "round_trip": again == plan and again.digest() == plan.digest(),
        "rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
""")


def run_row(name: str) -> dict:
    """Plan one row in a fresh process; its JSON result."""
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(ROWS[name]), root],
                         capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"row {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> list[list]:
    """Run the rows; print and return the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    args = parser.parse_args(argv)
    table = []
    for name in args.rows:
        r = run_row(name)
        row = ROWS[name]
        table.append([name, f"{row['nodes']} x {row['gpus_per_node']} {row['hardware']}",
                      f"{r['plan_s']:.1f}", f"{r['search_s']:.1f}", f"{r['placement_s']:.1f}",
                      r["setup"] or r["path"], f"{r['step_s']:.3f}", f"{r['search_step_s']:.3f}",
                      r["stage_solves"], f"{r['rss_mib']:.0f}", r["round_trip"]])
    print(tabulate(table, headers=["model", "cluster", "plan s", "search s", "placements s",
                                   "chosen setup", "predicted step s", "search's price s",
                                   "stage ILPs", "peak RSS MiB", "JSON round trip"]))
    return table


if __name__ == "__main__":
    main()
