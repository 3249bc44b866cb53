"""One fixed setup of a Llama-shaped model on virtual H100s: the setup search's prediction
against the per-operator plan it realizes, and how long each took.

    python benchmarks/realize_setup.py --dp 4 --tp 4 --cp 2 --layers 2 --seq 8192

The model is the ``llama`` preset at the sizes given (default: Llama-3-8B-shaped, hidden 4,096,
32 heads, 8 key-value heads, FFN 14,336, vocabulary 128,256), planned by ``autopar.plan`` with
the degrees, full recomputation, ZeRO-1 and bf16 autocast fixed, on ``h100-dgx`` nodes of 8
GPUs. Printed: the search's predicted step and peak, the realized plan's, the seconds of each
phase (the planner's own progress lines), and the realized plan's five values of most memory
with their placements, where the two predictions differ. Planning only, no devices.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import autopar  # noqa: E402
from autopar.model_presets import llama  # noqa: E402
from autopar.placements import to_str  # noqa: E402
from autopar.plan_context import context_of  # noqa: E402


def largest_values(plan: autopar.Plan, count: int = 5) -> list[str]:
    """The plan's ``count`` nodes of most memory (as its ILP priced them), with placements."""
    ctx = context_of(plan)
    rows = []
    for name, ns in ctx.space.nodes.items():
        s = ns.strategies[ctx.choice[name]]
        outs = [tuple(map(to_str, p)) for p in s.outputs if p is not None]
        rows.append((float(ctx.costs.memory[name][ctx.choice[name]]), name, outs[:1]))
    rows.sort(reverse=True)
    return [f"{m / 1e6:10.1f} MB  {name}  {outs}" for m, name, outs in rows[:count]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("dp", 4), ("tp", 4), ("cp", 2), ("layers", 2), ("seq", 8192),
                          ("batch", 4), ("hidden", 4096), ("heads", 32), ("kv-heads", 8),
                          ("ffn", 14336), ("vocab", 128256)):
        ap.add_argument(f"--{name}", type=int, default=default)
    ap.add_argument("--cp-layout", choices=("balanced", "contiguous"), default=None)
    ap.add_argument("--memory-gib", type=float, default=None, help="the budget per device")
    ap.add_argument("--time-limit", type=float, default=None,
                    help="seconds per ILP solve (Config.solver_time_limit_s; default its own)")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    model, inputs = llama(dict(hidden=args.hidden, layers=args.layers, heads=args.heads,
                               kv_heads=args.kv_heads, intermediate=args.ffn),
                          batch=args.batch, seq=args.seq, vocab=args.vocab)
    devices = args.dp * args.tp * args.cp
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=max(1, devices // 8),
                                gpus_per_node=min(8, devices))
    config = autopar.Config(
        dp=args.dp, tp=args.tp, cp=args.cp, pp=1, recompute="full", zero=1,
        mixed_precision="bf16", cp_layout=args.cp_layout,
        memory_bytes=args.memory_gib * 2**30 if args.memory_gib else None,
        **({"solver_time_limit_s": args.time_limit} if args.time_limit else {}))
    plan = autopar.plan(model, mesh, inputs, config=config,
                        progress=lambda m: print(f"[{time.perf_counter() - t0:7.1f} s] {m}"))
    p = plan.predicted
    print(f"search:   {p.get('search_step_time_s', float('nan')) * 1e3:10.3f} ms  "
          f"{p.get('search_peak_memory_bytes', float('nan')) / 1e9:7.2f} GB")
    print(f"realized: {p['step_time_s'] * 1e3:10.3f} ms  {p['peak_memory_bytes'] / 1e9:7.2f} GB  "
          f"({plan.techniques.get('cp_layout')} layout; {plan.solver.get('path')})")
    print("solver: " + ", ".join(f"{k}={plan.solver[k]}" for k in
                                 ("status", "backend", "gap", "solve_s") if k in plan.solver))
    print("\n".join(largest_values(plan)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
