"""One rank of a job in which one rank fails mid-step (launched by ``test_faults.py``).

Usage: python fault_worker.py MODE VICTIM TIMEOUT_S CHECK, with RANK, WORLD_SIZE, MASTER_ADDR
and MASTER_PORT set. ``CHECK`` is a worker check (``gpt:dp=2,tp=2``). Every rank trains; in its
second step, rank VICTIM stops at its second collective: ``die`` exits the process at once,
``hang`` sleeps forever. The other ranks must raise ``autopar.RankFailureError`` within about
TIMEOUT_S and exit non-zero. Prints ``FAULT <unix time>`` when the victim fails.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import autopar  # noqa: E402
from models import build  # noqa: E402
from worker import _parse, topology  # noqa: E402

DIE_EXIT = 17


class FailAt(TorchDispatchMode):
    """Dies or hangs at the ``at``-th collective op dispatched while active."""

    def __init__(self, mode: str, at: int) -> None:
        super().__init__()
        self.mode, self.at, self.seen = mode, at, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("c10d", "_c10d_functional") and "wait" not in func._opname:
            self.seen += 1
            if self.seen == self.at:
                print(f"FAULT {time.time()}", flush=True)
                if self.mode == "die":
                    os._exit(DIE_EXIT)
                time.sleep(3600)
        return func(*args, **(kwargs or {}))


def main() -> None:
    mode, victim, timeout_s, check = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    kind, cfg, mk, topo = _parse(check)
    mesh = autopar.Mesh.from_torchrun(topology=topology(topo), timeout_s=timeout_s)
    model, inputs = build(kind, **mk)
    pm = autopar.parallelize(model, mesh, inputs, config=autopar.Config(**cfg))
    opt = torch.optim.AdamW(pm.parameters())
    rank = int(os.environ["RANK"])
    for step in range(3):
        if rank == victim and step == 1:
            with FailAt(mode, at=2):
                loss = pm.step(*inputs)
        else:
            loss = pm.step(*inputs)
        opt.step()
        opt.zero_grad()
        print(f"rank {rank} step {step} loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
