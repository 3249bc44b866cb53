"""autopar's step against the same model parallelised by hand with PyTorch's own APIs.

    python benchmarks/runtime_vs_torch.py [--repeats 25] [--no-compile] [--json out.json] \\
        [--topology my.json]

starts ``torchrun`` with 2 CPU processes (gloo) and, on one GPT-2-style model (:class:`BenchGPT`)
and one batch, compares

- tp=2: autopar ``Config(tp=2)`` against ``parallelize_module`` with ``ColwiseParallel`` for the
  q, k, v projections and the first MLP GEMM and ``RowwiseParallel`` for the attention output
  projection and the second GEMM (Megatron-LM's layout; embeddings, norms and LM head replicated);
- dp=2: autopar ``Config(dp=2)`` against ``DistributedDataParallel`` (25 MiB buckets);
- pp=2: autopar ``Config(pp=2, schedule="1f1b")`` against the model cut by hand into two
  ``torch.distributed.pipelining`` stages (embeddings and the first half of the blocks; the rest,
  the final norm and the LM head) under ``Schedule1F1B``, with the same microbatches;

each eager and under ``torch.compile``. A step is the forward and backward of the global batch
with the gradients synchronised (what ``pmodel.step`` does; the optimizer is left out, it is the
same code in both). Every step is timed between two barriers on every rank; after warm-up the
variants of one comparison run interleaved, ``--repeats`` times, and the table gives medians and
their ratio. Communication is measured on every rank with :class:`autopar.runtime.profile.CommMeter`
(count and bytes per step) and set against the plan's prediction.

:class:`BenchGPT` is written the way a hand parallelisation needs it: separate q, k and v
projections (a fused one cannot be column-sharded by ``ColwiseParallel`` without reordering its
rows) and head counts read from the tensor (``view(b, t, -1, d)``), so the same module runs
whole, tensor-parallel by hand and under autopar. Its LM head is not tied to the embedding, so
the hand pipeline needs no gradient exchange between its stages. CPU timings are noisy: compare
the ratios of one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.runtime.profile import CommMeter

Step = Callable[[torch.Tensor, torch.Tensor], Any]

SIZES = {  # dim, heads, layers, seq, batch, vocab
    "default": dict(dim=512, heads=8, layers=4, seq=128, batch=8, vocab=1024),
    "tiny": dict(dim=32, heads=2, layers=2, seq=8, batch=4, vocab=64),
}


class Block(nn.Module):
    """Pre-norm GPT-2 block: separate q, k, v projections, causal SDPA, GELU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.q, self.k, self.v = (nn.Linear(dim, dim) for _ in range(3))
        self.proj = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class BenchGPT(nn.Module):
    """A GPT-2-style language model returning its mean cross-entropy loss."""

    def __init__(self, dim: int, heads: int, layers: int, seq: int, vocab: int, **_: Any) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        return self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(x))

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return cross_entropy(self.logits(x), targets)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def make_model(size: dict) -> BenchGPT:
    torch.manual_seed(0)  # the same weights on every rank and in every variant
    return BenchGPT(**size)


def calibration_model(batch: int, seq: int) -> tuple[BenchGPT, tuple[torch.Tensor, torch.Tensor]]:
    """The default model at ``batch`` x ``seq`` with its batch, for ``python -m autopar
    calibrate --model benchmarks.runtime_vs_torch:calibration_model``."""
    size = dict(SIZES["default"], batch=batch, seq=seq)
    return make_model(size), make_batch(size)


def make_batch(size: dict) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, size["vocab"], (size["batch"], size["seq"] + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


# ---- hand-written parallelisations -----------------------------------------------------------

def hand_tp(size: dict, compile: bool) -> tuple[Step, list[nn.Parameter]]:
    """Megatron-LM's layout with ``parallelize_module``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    model = make_model(size)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    layout = {}
    for i in range(len(model.blocks)):
        layout.update({f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc1")})
        layout.update({f"blocks.{i}.{n}": RowwiseParallel() for n in ("proj", "fc2")})
    parallelize_module(model, mesh, layout)
    run = torch.compile(model) if compile else model
    return (lambda ids, tgt: backward_loss(run(ids, tgt))), list(model.parameters())


def hand_dp(size: dict, compile: bool) -> tuple[Step, list[nn.Parameter]]:
    """``DistributedDataParallel``: each rank its half of the batch, gradients all-reduced in
    buckets during the backward."""
    from torch.nn.parallel import DistributedDataParallel

    model = make_model(size)
    ddp = DistributedDataParallel(model)
    run = torch.compile(ddp) if compile else ddp
    world, rank = dist.get_world_size(), dist.get_rank()

    def step(ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0] // world
        return backward_loss(run(ids[rank * n:(rank + 1) * n], tgt[rank * n:(rank + 1) * n]))

    return step, list(model.parameters())


class _FirstStage(nn.Module):
    def __init__(self, model: BenchGPT, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.wte, self.wpe, self.blocks = model.wte, model.wpe, blocks

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return x


class _LastStage(nn.Module):
    def __init__(self, model: BenchGPT, blocks: nn.ModuleList) -> None:
        super().__init__()
        self.blocks, self.ln_f, self.head = blocks, model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def hand_pp(size: dict, compile: bool, microbatches: int) -> tuple[Step, list[nn.Parameter]]:
    """Two stages cut by hand (half the blocks each) under ``Schedule1F1B``."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    model = make_model(size)
    rank, half = dist.get_rank(), len(model.blocks) // 2
    stage_mod: nn.Module = (_FirstStage(model, model.blocks[:half]) if rank == 0
                            else _LastStage(model, model.blocks[half:]))
    run = torch.compile(stage_mod) if compile else stage_mod
    stage = PipelineStage(run, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, microbatches, loss_fn=cross_entropy)  # grads scaled by 1/m

    def step(ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        if rank == 0:
            schedule.step(ids)
            return torch.zeros(())
        losses: list[torch.Tensor] = []
        schedule.step(target=tgt, losses=losses)
        return torch.stack(losses).mean()

    return step, list(stage_mod.parameters())


def backward_loss(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss.detach()


# ---- autopar ---------------------------------------------------------------------------------

# the topology the plans are priced on (``--topology``: a preset or a calibrated JSON file)
TOPOLOGY = {"name": "cpu-gloo"}


def autopar_variant(size: dict, config: autopar.Config, compile: bool
                    ) -> tuple[Step, list[nn.Parameter], Any]:
    """autopar's plan for ``config`` on this job; its step, parameters and the module."""
    model = make_model(size)
    mesh = autopar.Mesh.from_torchrun(topology=TOPOLOGY["name"])
    pm = autopar.parallelize(model, mesh, make_batch(size), config=config, compile=compile)
    return pm.step, list(pm.parameters()), pm


# ---- measuring -------------------------------------------------------------------------------

def timed(step: Step, params: list[nn.Parameter], batch: tuple) -> float:
    """Seconds of one step, between barriers (the slowest rank's time)."""
    for p in params:
        p.grad = None
    dist.barrier()
    t0 = time.perf_counter()
    step(*batch)
    dist.barrier()
    return time.perf_counter() - t0


def measure(variants: dict[str, tuple[Step, list]], batch: tuple, repeats: int, warmup: int
            ) -> dict[str, dict]:
    """Median step time of each variant (run interleaved, the order alternating), and the
    collectives of one step on this rank."""
    out: dict[str, dict] = {}
    for name, (step, params) in variants.items():
        for _ in range(warmup):
            timed(step, params, batch)
        for p in params:
            p.grad = None
        with CommMeter() as meter:
            step(*batch)
        out[name] = {"times": [], "counts": dict(meter.counts), "bytes": dict(meter.bytes)}
    names = list(variants)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            out[name]["times"].append(timed(*variants[name], batch))
    for rec in out.values():
        rec["median_s"] = statistics.median(rec["times"])
    return out


def per_rank(x: dict) -> list[dict]:
    """Every rank's ``x``, gathered on each (in rank order)."""
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, x)
    return every


def compare(name: str, size: dict, config: autopar.Config, hand: Callable[[bool], tuple],
            compile: bool, repeats: int, warmup: int) -> dict:
    """One row of the table: autopar and the hand-written version, both eager or compiled."""
    batch = make_batch(size)
    step, params, pm = autopar_variant(size, config, compile)
    variants = {"autopar": (step, params), "torch": hand(compile)}
    res = measure(variants, batch, repeats, warmup)
    pp_rank = pm.pp_rank if pm.plan.pipeline is not None else None
    predicted = {"counts": dict(pm.plan.collective_counts(pp_rank=pp_rank)),
                 "bytes": dict(pm.plan.collective_bytes(pp_rank=pp_rank))}
    ranks = per_rank({k: {"counts": v["counts"], "bytes": v["bytes"]} for k, v in res.items()}
                      | {"plan": predicted})
    return {"comparison": name, "compiled": compile, "degrees": pm.plan.degrees,
            "autopar_s": res["autopar"]["median_s"], "torch_s": res["torch"]["median_s"],
            "ratio": res["autopar"]["median_s"] / res["torch"]["median_s"],
            "predicted_s": pm.plan.predicted["step_time_s"],
            "ranks": ranks, "times": {k: v["times"] for k, v in res.items()}}


def rows(size: dict, compile_modes: list[bool], microbatch_size: int,
         only: list[str] | None = None) -> list[tuple]:
    """The comparisons to run: (name, autopar config, hand-written builder, compiled)."""
    m = size["batch"] // microbatch_size
    setups = [
        ("tp=2", autopar.Config(tp=2), lambda c: hand_tp(size, c)),
        ("dp=2", autopar.Config(dp=2), lambda c: hand_dp(size, c)),
        ("pp=2 1f1b", autopar.Config(pp=2, schedule="1f1b", microbatch_size=microbatch_size),
         lambda c: hand_pp(size, c, m)),
    ]
    return [(name, cfg, hand, c) for c in compile_modes for name, cfg, hand in setups
            if not only or name.split()[0] in only]


def _bytes_cell(r: dict, who: str) -> str:
    totals = [sum(rank[who]["bytes"].values()) if who != "plan" else sum(rank["plan"]["bytes"].values())
              for rank in r["ranks"]]
    return "/".join(f"{t / 2**20:.2f}" for t in totals)


def table(results: list[dict]) -> str:
    """The benchmark's table (rank 0)."""
    from tabulate import tabulate

    lines = []
    for r in results:
        exact = all(rank["autopar"]["bytes"] == {k: v for k, v in rank["plan"]["bytes"].items() if v}
                    and rank["autopar"]["counts"] == {k: v for k, v in rank["plan"]["counts"].items() if v}
                    for rank in r["ranks"])
        lines.append([r["comparison"], "compiled" if r["compiled"] else "eager",
                      f"{r['autopar_s'] * 1e3:.1f}", f"{r['torch_s'] * 1e3:.1f}", f"{r['ratio']:.3f}",
                      f"{r['predicted_s'] * 1e3:.1f}", _bytes_cell(r, "autopar"),
                      _bytes_cell(r, "plan"), "yes" if exact else "NO", _bytes_cell(r, "torch")])
    return tabulate(lines, headers=[
        "setup", "mode", "autopar ms", "torch ms", "ratio", "plan ms", "autopar MiB/rank",
        "plan MiB/rank", "= plan", "torch MiB/rank"])


def worker(args: argparse.Namespace) -> None:
    """Body of each rank."""
    size = SIZES[args.size]
    modes = [False] + ([True] if args.compile else [])
    results = [compare(name, size, cfg, hand, c, args.repeats, args.warmup)
               for name, cfg, hand, c in rows(size, modes, args.microbatch_size, args.only)]
    report(results, size, args)


def report(results: list[dict], size: dict, args: argparse.Namespace, torch_is: str = "") -> None:
    """Print the table on rank 0 (and write every figure to ``args.json``)."""
    if dist.get_rank() == 0:
        print(f"BenchGPT {size}, {dist.get_world_size()} processes (gloo){torch_is}, median of "
              f"{args.repeats} interleaved steps after {args.warmup} warm-up steps")
        print(table(results))
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"size": size, "processes": dist.get_world_size(), "results": results},
                          f, indent=1)


def as_rank(body: Callable[[argparse.Namespace], None], args: argparse.Namespace) -> int:
    """Run ``body(args)`` as this rank of a gloo job (inside ``torchrun``)."""
    dist.init_process_group("gloo")
    try:
        body(args)
    finally:
        dist.destroy_process_group()
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", choices=sorted(SIZES), default="default")
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--microbatch-size", type=int, default=2)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--only", nargs="*", choices=("tp=2", "dp=2", "pp=2"), default=None,
                   help="run these comparisons only")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--topology", default="cpu-gloo",
                   help="price the plans on this preset or topology JSON file (`python -m "
                        "autopar calibrate --out F` writes one); default cpu-gloo")
    return p


def jobs_parser(doc: str, sizes: dict, repeats: int, warmup: int) -> argparse.ArgumentParser:
    """The options of a benchmark that runs one job per process count (:func:`launch_jobs`)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4],
                   help="process counts, one job each (default 2 4)")
    p.add_argument("--size", choices=sorted(sizes), default="default")
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--no-compile", dest="compile", action="store_false")
    p.add_argument("--json", default=None, help="write every figure to this file (one per "
                   "process count: the count is added to the name)")
    return p


def job_main(script: str, doc: str, sizes: dict, worker: Callable[[argparse.Namespace], None],
             argv: list[str] | None, repeats: int, warmup: int,
             before: Callable[[], None] | None = None) -> int:
    """A benchmark's ``main``: inside ``torchrun``, run ``worker`` as this rank (after
    ``before``, e.g. seeding); outside, start one job of ``script`` per process count."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = jobs_parser(doc, sizes, repeats=repeats, warmup=warmup).parse_args(argv)
    if "RANK" in os.environ:
        if before is not None:
            before()
        return as_rank(worker, args)
    return launch_jobs(script, args)


def launch_jobs(script: str, args: argparse.Namespace) -> int:
    """Start one ``torchrun`` job of ``script`` per process count in ``args.procs``, passing
    on ``--size``, ``--repeats``, ``--warmup``, ``--no-compile`` and ``--json`` (one file per
    count: the count is added to the name); the jobs' exit statuses or-ed."""
    status = 0
    for n in args.procs:
        inner = ["--size", args.size, "--repeats", str(args.repeats), "--warmup", str(args.warmup)]
        inner += [] if args.compile else ["--no-compile"]
        if args.json:
            stem, ext = os.path.splitext(args.json)
            inner += ["--json", f"{stem}_{n}{ext}"]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={n}", os.path.abspath(script), *inner]
        status |= subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return status


def main(argv: list[str] | None = None) -> int:
    """Start the 2-process job (or, inside it, run this rank)."""
    args = _parser().parse_args(argv)
    if "RANK" not in os.environ:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
               os.path.abspath(__file__), *(argv if argv is not None else sys.argv[1:])]
        return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    TOPOLOGY["name"] = args.topology
    return as_rank(worker, args)


if __name__ == "__main__":
    raise SystemExit(main())
