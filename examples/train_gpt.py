"""Train a small GPT written in plain PyTorch with the plan autopar chooses.

    torchrun --standalone --nproc_per_node=4 examples/train_gpt.py [--topology cpu-gloo]

On CPU processes this uses gloo; on GPUs (``--device cuda``) one GPU per rank and NCCL. Rank 0
prints the plan, then the loss of every step.
"""

from __future__ import annotations

import argparse
from typing import Sequence

import torch
import torch.distributed as dist

import autopar
from autopar.demo import DemoGPT
from train_hf import _init, add_job_flags, train


def main(argv: Sequence[str] | None = None) -> list[float]:
    """Plan, parallelize and train; returns the loss of every step."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--topology", default=None, help="cost preset (default: this hardware)")
    add_job_flags(parser)
    args = parser.parse_args(argv)
    created = not dist.is_initialized()
    _init(args.device)
    try:
        mesh = autopar.Mesh.from_torchrun(topology=args.topology, timeout_s=args.timeout)
        torch.manual_seed(0)
        model = DemoGPT()
        example = (torch.randint(0, 256, (8, 64)), torch.randint(0, 256, (8, 64)))
        pmodel = autopar.parallelize(model, mesh, example)

        def batch(step: int) -> tuple[tuple, dict]:
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 256, (8, 65), generator=g)
            return (ids[:, :-1].contiguous(), ids[:, 1:].contiguous()), {}

        return train(pmodel, batch, args.steps, 1e-3, args.checkpoint)
    finally:
        if created:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
