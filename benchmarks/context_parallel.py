"""autopar's context parallelism: measured step against its prediction, and PyTorch's own.

    python benchmarks/context_parallel.py [--procs 2 4] [--repeats 10] [--no-compile] [--size long] [--json out.json]

starts one ``torchrun`` job per process count (CPU processes, gloo) and, on the GPT-2-style
model of ``runtime_vs_torch.py`` (:class:`BenchGPT`) at a long sequence for its size (dim 256,
4 heads, 2 layers, sequence 2048, batch 1: one sequence per step, as long-context
training runs; a batch of several has its linear layers flatten the batch and the sequence into
one dim, where the plan cannot keep the sequence split, docs/architecture.md), times

- autopar ``Config(cp=n, dp=1, tp=1, pp=1)`` in both forms of attention over cp
  (``cp_attention``): the keys and values all-gathered, or passed around the ring (ring
  attention, ``autopar.passes.ring_attention``), eager and compiled, the sequence held in the
  balanced chunk pairs (``cp_layout``, the default), and the ring once more with contiguous
  blocks (eager); the plan's predicted step on the ``cpu-gloo`` preset next to the measured
  one, and the bytes sent against the plan's;
- PyTorch's ``context_parallel`` (``torch.distributed.tensor.experimental``) on the same model
  and batch, where it runs; where it does not, the table gives what stopped it.

A step is the forward and backward of the batch (no optimizer), timed between barriers;
medians of ``--repeats`` steps after warm-up. CPU timings are noisy: compare within one run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
from tabulate import tabulate

import autopar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime_vs_torch import (  # noqa: E402
    backward_loss, job_main, make_batch, make_model, measure,
)

SIZES = {"default": dict(dim=256, heads=4, layers=2, seq=2048, batch=1, vocab=1024),
         # attention the larger part of the step (where the causal work's balance shows)
         "long": dict(dim=128, heads=2, layers=1, seq=8192, batch=1, vocab=1024),
         "tiny": dict(dim=32, heads=2, layers=2, seq=32, batch=2, vocab=64)}


def autopar_row(size: dict, form: str, compile: bool, repeats: int, warmup: int,
                layout: str = "balanced") -> dict:
    """autopar's cp plan in attention ``form`` and sequence ``layout`` on this job: measured
    and predicted step, collectives."""
    n = dist.get_world_size()
    batch = make_batch(size)
    mesh = autopar.Mesh.from_torchrun(topology="cpu-gloo")
    pm = autopar.parallelize(make_model(size), mesh, batch, compile=compile, plan_cache=False,
                             config=autopar.Config(cp=n, dp=1, tp=1, pp=1, cp_attention=form,
                                                   cp_layout=layout))
    res = measure({"autopar": (pm.step, list(pm.parameters()))}, batch, repeats, warmup)["autopar"]
    plan = pm.plan
    assert plan.techniques["cp_layout"] == layout, plan.techniques
    return {"procs": n, "form": form, "layout": layout, "mode": "compiled" if compile else "eager",
            "degrees": plan.degrees,
            "measured_s": res["median_s"], "predicted_s": plan.predicted["step_time_s"],
            "times": res["times"], "counts": res["counts"], "bytes": res["bytes"],
            "plan_counts": dict(plan.collective_counts()), "plan_bytes": dict(plan.collective_bytes())}


def torch_row(size: dict, repeats: int, warmup: int) -> dict:
    """PyTorch's ``context_parallel`` on the same model, or what stopped it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    n = dist.get_world_size()
    model = make_model(size)
    mesh = init_device_mesh("cpu", (n,))
    ids, tgt = make_batch(size)

    def step(ids: Any, tgt: Any) -> Any:
        # context_parallel shards the buffers in place on entry and restores them on exit; the
        # gradients are averaged over the ranks here (it leaves that to FSDP or DDP)
        a, b = ids.clone(), tgt.clone()
        with context_parallel(mesh, buffers=[a, b], buffer_seq_dims=[1, 1]):
            loss = backward_loss(model(a, b))
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= n
        return loss

    try:
        res = measure({"torch": (step, list(model.parameters()))}, (ids, tgt), repeats, warmup)
        loss = step(ids, tgt)
    except Exception as e:  # reported in the table: what stops PyTorch's own on this machine
        return {"procs": n, "torch": "stopped", "why": f"{type(e).__name__}: {str(e).splitlines()[0]}"}
    dist.all_reduce(loss)
    with torch.no_grad():
        whole = make_model(size)(ids, tgt).item()
    # the model's positions (wpe(arange(len))) are the rank's local ones under context_parallel:
    # its loss is not one process's unless the model is given its positions as a buffer
    return {"procs": n, "torch": "ran", "measured_s": res["torch"]["median_s"],
            "loss_rel_err": abs(loss.item() / n - whole) / abs(whole)}


def worker(args: argparse.Namespace) -> None:
    """Body of each rank."""
    size = SIZES[args.size]
    rows = [autopar_row(size, form, c, args.repeats, args.warmup) for form in ("gather", "ring")
            for c in ([False, True] if args.compile else [False])]
    rows.append(autopar_row(size, "ring", False, args.repeats, args.warmup, layout="contiguous"))
    theirs = torch_row(size, args.repeats, args.warmup)
    if dist.get_rank() == 0:
        table = [[r["procs"], r["form"], r["layout"], r["mode"], f"{r['measured_s'] * 1e3:.1f}",
                  f"{r['predicted_s'] * 1e3:.1f}", f"{r['measured_s'] / r['predicted_s']:.2f}",
                  sum(r["bytes"].values()), sum(r["plan_bytes"].values())] for r in rows]
        print(f"BenchGPT {size}, {rows[0]['procs']} processes (gloo), median of {args.repeats}")
        print(tabulate(table, headers=["procs", "form", "layout", "autopar", "measured ms",
                                       "predicted ms",
                                       "measured / predicted", "bytes", "plan bytes"]))
        ran = theirs.get("measured_s")
        print("torch context_parallel:", theirs.get("why") or
              f"{ran * 1e3:.1f} ms, loss relative error against one process "
              f"{theirs['loss_rel_err']:.2e}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": size, "autopar": rows, "torch": theirs}, f, indent=1)


def main(argv: list[str] | None = None) -> int:
    """Start one job per process count (or, inside one, run this rank)."""
    return job_main(__file__, __doc__, SIZES, worker, argv, repeats=10, warmup=2, before=lambda: torch.manual_seed(0))


if __name__ == "__main__":
    raise SystemExit(main())
