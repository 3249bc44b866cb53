"""autopar's ZeRO-3 against PyTorch's FSDP2 (``fully_shard``) on the same model.

    python benchmarks/fsdp2.py [--procs 2 4] [--repeats 15] [--no-compile] [--json out.json]

starts one ``torchrun`` job per process count (CPU processes, gloo) and, on the GPT-2-style
model of ``runtime_vs_torch.py`` (:class:`BenchGPT`) and one batch, compares

- autopar ``Config(dp=n, tp=1, pp=1, zero=3, dp_shard=n)``: parameters stored sharded over the n ranks,
  each layer's gathered as one flat all-gather a layer ahead of its use, freed after its last
  forward reader, gathered again for the backward, gradients reduce-scattered in the plan's
  buckets;
- FSDP2 as torchtitan applies it: ``fully_shard`` on every block and on the root (the
  embeddings, final norm and LM head), ``reshard_after_forward=True`` (ZeRO-3), its default
  prefetch of the next block's gather; each rank runs its 1/n of the batch; compiled, each block
  is compiled before it is sharded (torchtitan's order);

each eager and compiled. A step is the forward and backward of the global batch with the
gradients reduced into their shards; the optimizer, the same code on both sides (``AdamW``
over sharded DTensor parameters), is left out of both. The timing, interleaving and counting
are ``runtime_vs_torch.py``'s (:func:`runtime_vs_torch.compare`): medians of interleaved steps
between barriers, collectives counted on every rank with
:class:`autopar.runtime.profile.CommMeter` and set against the plan's. CPU timings are noisy:
compare the ratios of one run, not figures across runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch.distributed as dist

import autopar

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runtime_vs_torch import (  # noqa: E402
    SIZES, Step, backward_loss, compare, job_main, make_model, report,
)


def hand_fsdp(size: dict, compile: bool) -> tuple[Step, list]:
    """FSDP2 (``fully_shard``) on every block and the root; each rank its share of the batch."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = make_model(size)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for i, block in enumerate(model.blocks):
        if compile:
            model.blocks[i] = block = torch.compile(block)
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    fully_shard(model, mesh=mesh)
    world, rank = dist.get_world_size(), dist.get_rank()

    def step(ids: Any, tgt: Any) -> Any:
        n = ids.shape[0] // world
        return backward_loss(model(ids[rank * n:(rank + 1) * n], tgt[rank * n:(rank + 1) * n]))

    return step, list(model.parameters())


def worker(args: argparse.Namespace) -> None:
    """Body of each rank: the eager and compiled comparisons."""
    size, n = SIZES[args.size], dist.get_world_size()
    config = autopar.Config(dp=n, tp=1, pp=1, zero=3, dp_shard=n)
    results = [compare(f"dp={n} ZeRO-3", size, config, lambda c: hand_fsdp(size, c), c,
                       args.repeats, args.warmup)
               for c in ([False, True] if args.compile else [False])]
    report(results, size, args, ", FSDP2 as torch")


def main(argv: list[str] | None = None) -> int:
    """Start one job per process count (or, inside one, run this rank)."""
    return job_main(__file__, __doc__, SIZES, worker, argv, repeats=15, warmup=3)


if __name__ == "__main__":
    raise SystemExit(main())
