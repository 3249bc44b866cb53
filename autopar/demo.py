"""The demo: train a small GPT on 4 CPU processes with the plan autopar chose, next to one process.

Run ``python -m autopar demo`` (it starts ``torchrun`` with 4 gloo processes on this machine).
The plan is made for the ``a100-dgx`` cost model by default, so it is the plan 4 A100s would
get; the numbers are computed on the CPU either way.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["LOSS_RTOL", "DemoGPT", "check_losses", "launch", "main"]


class _Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(b, t, c))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class DemoGPT(nn.Module):
    """A GPT-2-style model (tied embeddings, fused QKV, SDPA) returning its training loss."""

    def __init__(self, vocab: int = 256, dim: int = 512, heads: int = 8, layers: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(_Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight
        for emb in (self.wte, self.wpe):  # GPT-2's initialisation (Radford et al. 2019)
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def _batch(step: int, batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def worker(steps: int, topology: str, compile: bool) -> None:
    """Body of each rank: plan, train ``steps`` steps, compare with a single-process run."""
    import autopar

    torch.manual_seed(0)
    model = DemoGPT()
    reference = DemoGPT()
    reference.load_state_dict(model.state_dict())
    mesh = autopar.Mesh.from_torchrun(topology=topology)
    rank = dist.get_rank()
    t0 = time.perf_counter()
    pmodel = autopar.parallelize(model, mesh, _batch(0, 8, 64, 256), compile=compile)
    if rank == 0:
        print(pmodel.plan)
        st = pmodel.startup
        print(f"\nplanned and lowered in {time.perf_counter() - t0:.1f} s (capture "
              f"{st['capture_s']:.1f} s, plan {st['plan_s']:.1f} s with the plan cache: "
              f"{st['plan_cache']}, lower {st['lower_s']:.1f} s)\n")
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    rows = []
    for step in range(steps):
        ids, tgt = _batch(step, 8, 64, 256)
        opt.zero_grad()
        loss = pmodel.step(ids, tgt)
        opt.step()
        ref_opt.zero_grad()
        ref_loss = reference(ids, tgt)
        ref_loss.backward()
        ref_opt.step()
        rows.append((step, loss.item(), ref_loss.item()))
    if rank == 0:
        from tabulate import tabulate

        print(tabulate([(s, f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.2e}") for s, a, b in rows],
                       headers=["step", f"autopar ({mesh.size} ranks)", "single process", "|diff|"]))
    check_losses(rows, rank)


# fp32 on both sides; the parallel program sums the same products in another order (a few ulp,
# 2**-24 relative, per sum) and AdamW carries the difference from step to step: 1e-4 relative
# bounds five steps with a wide margin (seen: below 1e-6).
LOSS_RTOL = 1e-4


def check_losses(rows: list[tuple[int, float, float]], rank: int) -> None:
    """Every rank's losses against the single process; a mismatch ends the demo with an error."""
    bad = [(s, a, b) for s, a, b in rows if abs(a - b) > LOSS_RTOL * max(1.0, abs(b))]
    if bad:
        raise SystemExit(f"rank {rank}: losses differ from one process by more than {LOSS_RTOL:g} "
                         f"(relative) at steps {[s for s, _, _ in bad]}: {bad}")
    if rank == 0:
        print(f"\nevery step's loss equals one process's within {LOSS_RTOL:g} (relative), on every rank")


def launch(nproc: int = 4, steps: int = 5, topology: str = "a100-dgx", compile: bool = False) -> int:
    """Start the demo under ``torchrun --standalone`` with ``nproc`` CPU processes (gloo)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           "-m", "autopar.demo", "--worker", f"--steps={steps}", f"--topology={topology}"]
    if compile:
        cmd.append("--compile")
    return subprocess.call(cmd, env=dict(os.environ, OMP_NUM_THREADS="1"))


def main(argv: list[str] | None = None) -> int:
    """Command line of the demo (also reached through ``python -m autopar demo``)."""
    from autopar.cost_models.topology import preset_names

    parser = argparse.ArgumentParser(prog="python -m autopar demo", description=__doc__)
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--topology", default="a100-dgx", choices=preset_names(), metavar="NAME",
                        help="cost-model preset to plan for: %(choices)s (default %(default)s)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the per-rank program")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        dist.init_process_group("gloo")
        try:
            worker(args.steps, args.topology, args.compile)
        finally:
            dist.destroy_process_group()
        return 0
    return launch(args.nproc, args.steps, args.topology, args.compile)


if __name__ == "__main__":
    sys.exit(main())
