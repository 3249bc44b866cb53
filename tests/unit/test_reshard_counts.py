"""Every planned move issues exactly the collectives the plan predicts.

For every pair of placements of a tensor on a 2 x 2 mesh (replicate, shard either dim, partial),
the runtime's ``reshard`` (one DTensor redistribute per planned step) is run under the
single-process "fake" process group, and the collectives ``CommDebugMode`` counts are compared
with ``reshard_steps``: same kinds, same number.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.debug import CommDebugMode

from autopar import _torch_private as private
from autopar.passes.lower import reshard
from autopar.strategies.reshard import reshard_steps

KIND = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter"}
OPTIONS = [Replicate(), Shard(0), Shard(1), Partial("sum")]


@pytest.fixture(scope="module")
def mesh():
    if dist.is_initialized():
        pytest.skip("needs to own the default process group")
    private.init_fake_process_group(4)
    from torch.distributed.device_mesh import init_device_mesh

    yield init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dist.destroy_process_group()


def test_reshard_issues_the_planned_collectives(mesh):
    shape = (8, 12)
    checked = 0
    for src in itertools.product(OPTIONS, repeat=2):
        sizes = list(shape)
        for p in src:
            if isinstance(p, Shard):
                sizes[p.dim] //= 2
        x = DTensor.from_local(torch.zeros(sizes), mesh, src, run_check=False,
                               shape=torch.Size(shape), stride=(shape[1], 1))
        for dst in itertools.product(OPTIONS, repeat=2):
            steps = reshard_steps(tuple(src), tuple(dst), shape, 4, (2, 2))
            predicted = Counter(s.kind for s in steps if s.kind != "local")
            with CommDebugMode() as comm:
                y = reshard(x, tuple(dst), mesh)
            counted = Counter()
            for op, n in comm.get_comm_counts().items():
                counted[KIND[str(op).split(".")[-1]]] += n
            assert tuple(y.placements) == tuple(dst), (src, dst)
            assert counted == predicted, (src, dst, counted, predicted)
            checked += 1
    assert checked == 256
