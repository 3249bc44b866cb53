"""Start-up cost of the demo model, on a first launch and on a second one that finds the caches.

    python benchmarks/startup.py [--nproc 4] [--topology a100-dgx] [--no-compile]

Launches the demo's job (``autopar.demo.DemoGPT``, its batch and topology) twice with
``torchrun``, each time parallelizing with ``compile=True`` and running one step, with the plan
cache (``AUTOPAR_CACHE_DIR``) and inductor's cache (``TORCHINDUCTOR_CACHE_DIR``) in a fresh
directory shared by the two launches: the first launch searches and compiles from nothing, the
second reads its plan from the cache and inductor's compiled graphs from its own. Rank 0 of
each launch reports the seconds of each phase (``pmodel.startup``: capture, plan, lower,
compile) and of the first step; the table sets the launches side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist

PHASES = ("capture_s", "plan_s", "lower_s", "compile_s")


def worker(args: argparse.Namespace) -> None:
    """One rank of one launch: parallelize the demo model, run a step, write the timings."""
    import autopar
    from autopar.demo import DemoGPT, _batch

    torch.manual_seed(0)
    model = DemoGPT()
    batch = _batch(0, 8, 64, 256)
    mesh = autopar.Mesh.from_torchrun(topology=args.topology)
    t0 = time.perf_counter()
    pmodel = autopar.parallelize(model, mesh, batch, compile=args.compile)
    pmodel.step(*batch)
    total = time.perf_counter() - t0
    if dist.get_rank() == 0:
        record = dict(pmodel.startup, total_s=total, degrees=pmodel.plan.degrees)
        with open(args.out, "w") as f:
            json.dump(record, f)


def launch(args: argparse.Namespace, cache: str, out: str) -> dict:
    """One ``torchrun`` launch sharing the cache directory ``cache``; rank 0's timings."""
    env = dict(os.environ, OMP_NUM_THREADS="1", AUTOPAR_CACHE_DIR=cache,
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={args.nproc}", os.path.abspath(__file__), "--worker", "--out", out,
           f"--topology={args.topology}"] + ([] if args.compile else ["--no-compile"])
    subprocess.run(cmd, check=True, env=env)
    with open(out) as f:
        return json.load(f)


def table(runs: list[tuple[str, dict]]) -> str:
    from tabulate import tabulate

    rows = [[name, r["plan_cache"]] + [f"{r.get(k, 0.0):.2f}" for k in PHASES] + [f"{r['total_s']:.2f}"]
            for name, r in runs]
    return tabulate(rows, headers=["launch", "plan cache", "capture s", "plan s", "lower s",
                                   "compile s", "to end of step 1 s"])


def main(argv: list[str] | None = None) -> int:
    """Two launches (see the module docstring), or inside one, a rank."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--topology", default="a100-dgx")
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        dist.init_process_group("gloo")
        try:
            worker(args)
        finally:
            dist.destroy_process_group()
        return 0
    with tempfile.TemporaryDirectory(prefix="autopar-startup-") as cache:
        runs = [(name, launch(args, cache, os.path.join(cache, f"{name}.json")))
                for name in ("first", "second")]
    print(f"demo model on {args.nproc} processes, {args.topology} costs, "
          f"compile={args.compile}, degrees {runs[0][1]['degrees']}")
    print(table(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
