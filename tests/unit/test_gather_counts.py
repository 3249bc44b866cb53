"""The plan's ZeRO-3 gathers equal those of the program it lowers to, where a parameter is
sharded over two data axes (dp and ep): rank 0's program traced under the single-process
"fake" process group, its all-gathers counted in the graph (after the runtime's gather buckets,
``passes/gather_buckets.py``) against ``plan.collectives`` (``planning/collectives.py``). Before
2026-11-28 the plan merged the first gathers of a layer's weights into one bucket where the
runtime, which waits for each weight's first gather before its second, cut the run: 56 planned
against 68 run here. The 4-process runs: tests/distributed/test_slow.py -k expert_parallel."""

from __future__ import annotations

import pytest
import torch.distributed as dist

import autopar
from autopar import Config, _torch_private as private
from autopar.capture import capture
from autopar.capture.remat import recompute_nodes, zero_gathers
from autopar.passes.lower import lower_to_local
from models import build


@pytest.fixture(scope="module")
def fake_world():
    if dist.is_initialized():
        pytest.skip("needs to own the default process group")
    private.init_fake_process_group(4)
    yield
    dist.destroy_process_group()


def test_zero3_gathers_over_dp_and_ep_are_planned_as_they_run(fake_world):
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = build("mixtral")
    traced = capture(model, inputs)
    plan = autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", 1, 4), inputs,
                        config=Config(dp=4, ep=2, zero=3))
    assert plan.axis_names == ("dp", "ep") and plan.techniques["zero"] == 3
    dm = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.axis_names)
    prefetch, regather = zero_gathers(traced, 3)
    local = lower_to_local(traced.gm, plan, dm, recompute_nodes(traced, plan.techniques["recompute"]),
                           regather, prefetch)
    run = sum("all_gather" in str(n.target) for n in local.graph.nodes)
    planned = sum(c.kind == "all_gather" for c in plan.collectives)
    # (both axes gather: the dense weights are sharded over dp and ep)
    assert {c.axis for c in plan.collectives if c.kind == "all_gather"} == {"dp", "ep"}
    assert planned == run, (planned, run)
