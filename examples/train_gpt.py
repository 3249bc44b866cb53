"""Train a GPT-2-style model with the plan autopar chooses.

    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py [--topology cpu-gloo]

On CPU processes this uses gloo; on GPUs, torchrun with NCCL works the same way. The plan is
printed by rank 0; every rank prints nothing else but the loss.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import autopar
from autopar.demo import DemoGPT


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--topology", default=None, help="cost preset (default: this hardware)")
    args = parser.parse_args()
    mesh = autopar.Mesh.from_torchrun(topology=args.topology)
    torch.manual_seed(0)
    model = DemoGPT()
    batch = (torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64)))
    pmodel = autopar.parallelize(model, mesh, batch)
    if dist.get_rank() == 0:
        print(pmodel.plan)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)
    for step in range(args.steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, 256, (8, 65), generator=g)
        opt.zero_grad()
        loss = pmodel.step(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
        opt.step()
        if dist.get_rank() == 0:
            print(f"step {step}: loss {loss.item():.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
