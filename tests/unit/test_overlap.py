"""Gradient buckets and the overlap of collectives with compute, on lowered programs.

The plans are lowered under the single-process "fake" process group (nothing runs; the
programs are inspected). Numbers and the collectives counted at run time are checked on real
processes in ``tests/distributed`` (every plan there uses buckets and the overlap pass).
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar import _torch_private as private
from autopar.capture import capture
from autopar.capture.remat import recompute_nodes, zero_gathers
from autopar.passes.lower import lower_to_local
from autopar.planning.buckets import FIRST_BUCKET_BYTES
from autopar.planning.per_unit import make_plan
from models import build

WAIT = torch.ops._c10d_functional.wait_tensor.default
BUCKET = torch.ops._c10d_functional.all_reduce_.default
VIEWS = {torch.ops.aten.split_with_sizes.default, torch.ops.aten.view.default,
         torch.ops.aten.permute.default, operator.getitem}


@pytest.fixture(scope="module")
def fake_world():
    if dist.is_initialized():
        pytest.skip("needs to own the default process group")
    private.init_fake_process_group(2)
    yield
    dist.destroy_process_group()


def _lowered(kind: str, config: autopar.Config, topology: str = "a100-dgx", **model_kw):
    from torch.distributed.device_mesh import init_device_mesh

    model, inputs = build(kind, **model_kw)
    traced = capture(model, inputs, None)
    mesh = autopar.Mesh.virtual(topology, gpus_per_node=2)
    plan = make_plan(traced, mesh, config, (), None, model, inputs)
    dm = init_device_mesh("cpu", plan.mesh_shape, mesh_dim_names=plan.axis_names)
    prefetch, regather = zero_gathers(traced, plan.techniques["zero"])
    return plan, lower_to_local(traced.gm, plan, dm, recompute_nodes(traced, plan.techniques["recompute"]),
                                regather, prefetch)


# large batch, narrow layers on A100s: plain data parallelism (as in test_equivalence.py)
DP = dict(dim=64, layers=2, batch=256, seq=128)


@pytest.mark.parametrize("cap", [0, 40_000, 25 * 2**20])
def test_gradient_buckets_follow_the_cap_and_hold_every_gradient(fake_world, cap):
    plan, local = _lowered("gpt", autopar.Config(dp=2, bucket_bytes=cap), **DP)
    grads = [c for c in plan.collectives if c.phase == "backward" and c.node == "output"]
    # one all-reduce per bucket, every parameter's gradient in exactly one (28: one is tied)
    assert len(grads) == len(plan.grad_buckets)
    members = [i for b in plan.grad_buckets for i in b]
    assert len(members) == len(set(members)) == 28
    sizes = [c.bytes for c in grads]
    assert sum(sizes) == sum(4 * n for n in _param_numels())
    if cap == 0:
        assert len(grads) == 28  # every gradient alone
    else:  # a bucket closes once it holds the cap (the first one: 1 MiB); the last may not
        caps = [min(cap, FIRST_BUCKET_BYTES)] + [cap] * (len(sizes) - 1)
        assert all(s >= c for s, c in zip(sizes[:-1], caps)), (sizes, caps)
        assert len(grads) < 28
        if cap > sum(sizes):  # 25 MiB: all of them (466 KB) in the first bucket
            assert len(grads) == 1
    # the program issues exactly these buckets, in this order, in place on their buffers
    issued = [n for n in local.graph.nodes if n.target is BUCKET]
    assert [n.args[0].meta["val"].numel() * 4 for n in issued] == sizes
    # a gradient of at least the cap is a bucket of its own, reduced in its own memory; the
    # others are copied into one buffer (a cat)
    cat = torch.ops.aten.cat.default
    for n, members in zip(issued, plan.grad_buckets):
        if len(members) > 1:
            assert n.args[0].target is cat
    if cap == 40_000:  # (the MLP weights, 64 KiB, are over it)
        alone = [n for n, m in zip(issued, plan.grad_buckets) if len(m) == 1]
        assert alone and all(n.args[0].target is not cat for n in alone)


def _param_numels() -> list[int]:
    model, _ = build("gpt", **DP)
    return [p.numel() for p in model.parameters()]


def test_bucket_waits_come_after_the_backward(fake_world):
    _, local = _lowered("gpt", autopar.Config(dp=2, bucket_bytes=40_000), **DP)
    nodes = list(local.graph.nodes)
    waits = [i for i, n in enumerate(nodes) if n.target is WAIT and n.args[0].target is BUCKET]
    assert len(waits) > 1
    # after the first bucket's wait: only the waits and the views of the reduced buffers
    tail = nodes[min(waits):-1]
    assert all(n.target is WAIT or n.target in VIEWS for n in tail), \
        sorted({str(n.target) for n in tail if n.target is not WAIT and n.target not in VIEWS})
    # and the buckets were issued while the backward computes: all but perhaps the last one
    # before the last compute node
    issued = [i for i, n in enumerate(nodes) if n.target is BUCKET]
    compute = [i for i, n in enumerate(nodes) if n.op == "call_function" and n.target not in VIEWS
               and n.target is not WAIT and n.target is not BUCKET]
    assert sum(i < max(compute) for i in issued) >= len(issued) - 1


def test_tensor_parallel_waits_move_past_independent_compute(fake_world):
    # Megatron's layout (tp=2, a100 costs): the backward's all-reduce of a column-parallel
    # layer's input gradient is waited for after the weight gradient's GEMM, not right away
    plan, local = _lowered("gpt", autopar.Config(tp=2), dim=512, batch=2, seq=64, heads=8)
    nodes = list(local.graph.nodes)
    moved = 0
    for i, n in enumerate(nodes):
        if n.target is WAIT and n.meta.get("partitioner_tag") == "is_backward":
            collective = n.args[0]
            between = nodes[nodes.index(collective) + 1:i]
            moved += any(b.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
                         for b in between)
    assert moved >= 2 * 2  # two layers, at least two per layer
    # and no wait ever crosses from the forward into the backward
    for i, n in enumerate(nodes):
        if n.target is WAIT and n.meta.get("partitioner_tag") == "is_forward":
            assert all(m.meta.get("partitioner_tag") != "is_backward"
                       for m in nodes[nodes.index(n.args[0]):i])


GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
GATHER_OUT = torch.ops._c10d_functional.all_gather_into_tensor_out.default


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_gathers_each_layer_while_the_layer_before_computes(fake_world, zero):
    """ZeRO's prefetch (passes.overlap.prefetch_gathers): in the forward (and with ZeRO-3 again
    in the backward), the gathers of a block's parameters are issued before the block before
    it reads any gathered parameter (one layer ahead, as FSDP2); a block's gathers are never
    issued two layers ahead (which would hold more layers' copies at once)."""
    from autopar.capture.remat import regather_layer

    plan, local = _lowered("gpt", autopar.Config(dp=2, zero=zero), **DP)
    assert plan.techniques["zero"] == zero
    nodes = list(local.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    for part in ("is_forward", "is_backward") if zero == 3 else ("is_forward",):
        gathers = [n for n in nodes if n.target is GATHER and regather_layer(n) is not None
                   and (n.meta.get("partitioner_tag") == "is_backward") == (part == "is_backward")]
        runs: list[tuple[str, list]] = []
        for g in gathers:
            if not runs or runs[-1][0] != regather_layer(g):
                runs.append((regather_layer(g), []))
            runs[-1][1].append(g)
        blocks = [(layer, gs) for layer, gs in runs if layer.startswith("blocks.")]
        assert len(blocks) == 2, [r[0] for r in runs]

        copy_out = VIEWS | {torch.ops.aten.clone.default}  # (a flat bucket's, gather_buckets)

        def first_read(gs: list) -> int:  # the first op computing with a gathered copy of gs
            todo = [u for g in gs for u in g.users if u.target is WAIT]
            reads = []
            while todo:
                n = todo.pop()
                for u in n.users:
                    (todo if u.target in copy_out else reads).append(u)
            return min(pos[u] for u in reads)

        for (_, before), (_, after) in zip(runs, runs[1:]):
            assert max(pos[g] for g in after) < first_read(before)
        for (_, two_before), _, (_, after) in zip(runs, runs[1:], runs[2:]):
            assert min(pos[g] for g in after) > min(pos[g] for g in two_before)


SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_moves_each_layer_in_one_flat_gather_and_bucketed_reduce_scatters(fake_world, zero):
    """passes.gather_buckets and passes.grad_buckets: a block's parameters travel as one
    all-gather per part of the step (its shards packed with one cat, copied out of one flat
    buffer), the gradients as reduce-scatters of the plan's buckets, each waited for before the
    next is issued; the program's collectives are the plan's, kind by kind and in bytes."""
    plan, local = _lowered("gpt", autopar.Config(dp=2, zero=zero, bucket_bytes=40_000), **DP)
    assert plan.techniques["zero"] == zero
    nodes = list(local.graph.nodes)
    gathers = [n for n in nodes if n.target is GATHER]
    scatters = [n for n in nodes if n.target is SCATTER]
    planned = {k: [c for c in plan.collectives if c.kind == k] for k in ("all_gather", "reduce_scatter")}
    assert len(gathers) == len(planned["all_gather"]) and len(scatters) == len(planned["reduce_scatter"])
    assert sum(n.meta["val"].numel() * 4 for n in gathers) == sum(c.bytes for c in planned["all_gather"])
    params = {p.name: p for p in capture(*build("gpt", **DP)).params}
    for part in ("forward", "backward") if zero == 3 else ("forward",):
        per_block = [c for c in planned["all_gather"] if c.phase == part and c.layer.startswith("blocks.")]
        assert sorted(c.layer for c in per_block) == ["blocks.0", "blocks.1"], per_block
    # the forward gathers every block parameter (4 bytes each), in the block's one collective
    for block in ("blocks.0", "blocks.1"):
        (c,) = [c for c in planned["all_gather"] if c.phase == "forward" and c.layer == block]
        assert c.bytes == sum(p.numel * 4 for name, p in params.items() if name.startswith(block + "."))
    assert 1 < len(scatters) < len(params)
    pos = {n: i for i, n in enumerate(nodes)}
    for earlier, later in zip(scatters, scatters[1:]):
        (wait,) = [u for u in earlier.users if u.target is WAIT]
        assert pos[wait] < pos[later]


def test_all_gathers_go_into_buffers_of_their_own(fake_world):
    """passes.gather_buffers: the program that runs gathers into buffers it allocates
    (all_gather_into_tensor_out), never through the functional op whose gloo form
    (ALLGATHER_COALESCED) races in torch 2.13's ProcessGroupGloo::runLoop; the same
    collectives, shapes and order, and so in the forward and backward graphs."""
    import copy

    from autopar.passes.gather_buffers import gather_into_buffers
    from autopar.runtime.autograd import split_forward_backward

    _, local = _lowered("gpt", autopar.Config(dp=2, zero=3), **DP)
    before = [tuple(n.meta["val"].shape) for n in local.graph.nodes if n.target is GATHER]
    runs = gather_into_buffers(copy.deepcopy(local))
    assert not [n for n in runs.graph.nodes if n.target is GATHER]
    after = [n for n in runs.graph.nodes if n.target is GATHER_OUT]
    assert [tuple(n.kwargs["out"].meta["val"].shape) for n in after] == before and before
    order = [n.name for n in local.graph.nodes if n.op == "placeholder"]
    for graph in split_forward_backward(local, order):
        assert not [n for n in graph.graph.nodes if n.target is GATHER]
        assert [n for n in graph.graph.nodes if n.target is GATHER_OUT]
