"""Unit tests for autopar.cost_models: topology, alpha-beta collectives, roofline, FLOPs, memory."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autopar.cost_models import (
    COLLECTIVE_KINDS,
    PRESETS,
    AxisLink,
    Topology,
    adam_state_bytes_per_param,
    all_gather_time,
    all_reduce_time,
    all_to_all_time,
    axis_collective_time,
    bytes_of_node,
    collective_time,
    custom,
    flops_of_node,
    get_preset,
    op_time,
    optimizer_state_bytes_per_param,
    reduce_scatter_time,
    send_recv_time,
    training_state_breakdown,
    training_state_bytes_per_param,
    zero_sharded_bytes_per_param,
)

aten = torch.ops.aten

# bandwidth 1 GB/s, 1 us per ring step, 10 us launch: easy hand arithmetic.
LINK = AxisLink(bandwidth_Bps=1e9, latency_s=1e-6, launch_s=1e-5)


def _toy_topology(**overrides: object) -> Topology:
    fields: dict[str, object] = dict(
        name="toy",
        peak_flops={"fp32": 100.0, "bf16": 400.0},
        mem_bandwidth_Bps=10.0,
        memory_bytes=1e9,
        intra_node=AxisLink(100e9, 1e-6, 1e-5),
        inter_node=AxisLink(10e9, 5e-6, 1e-5),
        gpus_per_node=8,
        matmul_efficiency=0.5,
        pointwise_efficiency=0.5,
    )
    fields.update(overrides)
    return Topology(**fields)  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ comm


def test_all_reduce_hand_computed() -> None:
    # 10us + 2*3*1us + 2*3/4 * 1e9 B / 1e9 B/s = 1.5 s + 16 us
    assert all_reduce_time(1e9, 4, LINK) == pytest.approx(1.5 + 16e-6, rel=1e-12)


def test_all_gather_and_reduce_scatter_hand_computed() -> None:
    # 10us + 7*1us + 7/8 * 8e6 / 1e9 = 7 ms + 17 us
    expected = 7e-3 + 17e-6
    assert all_gather_time(8e6, 8, LINK) == pytest.approx(expected, rel=1e-12)
    assert reduce_scatter_time(8e6, 8, LINK) == pytest.approx(expected, rel=1e-12)


def test_all_to_all_and_send_recv_hand_computed() -> None:
    # 10us + 3*1us + 3/4 * 4e6 / 1e9 = 3 ms + 13 us
    assert all_to_all_time(4e6, 4, LINK) == pytest.approx(3e-3 + 13e-6, rel=1e-12)
    # 10us + 1us + 1e6 / 1e9 = 1 ms + 11 us
    assert send_recv_time(1e6, LINK) == pytest.approx(1e-3 + 11e-6, rel=1e-12)


def test_all_reduce_costs_reduce_scatter_plus_all_gather() -> None:
    link = AxisLink(50e9, 2e-6, 0.0)
    for n in (2, 4, 8, 64):
        assert all_reduce_time(3e8, n, link) == pytest.approx(
            reduce_scatter_time(3e8, n, link) + all_gather_time(3e8, n, link)
        )


def test_bus_bandwidth_matches_nccl_tests_definition() -> None:
    # With no latency, busbw = (S / t) * factor equals the link bandwidth (nccl-tests).
    link = AxisLink(370e9, 0.0, 0.0)
    size = 1 << 30
    for n in (2, 8, 16):
        t = all_reduce_time(size, n, link)
        assert size / t * 2 * (n - 1) / n == pytest.approx(370e9)
        t = all_gather_time(size, n, link)
        assert size / t * (n - 1) / n == pytest.approx(370e9)


@pytest.mark.parametrize("kind", COLLECTIVE_KINDS)
def test_single_rank_is_free(kind: str) -> None:
    assert collective_time(kind, 1e9, 1, LINK) == 0.0
    assert axis_collective_time(kind, 1e9, 1, 8, get_preset("h100-dgx")) == 0.0


def test_collective_time_dispatch() -> None:
    assert collective_time("all_reduce", 1e9, 4, LINK) == all_reduce_time(1e9, 4, LINK)
    assert collective_time("all_gather", 8e6, 8, LINK) == all_gather_time(8e6, 8, LINK)
    assert collective_time("reduce_scatter", 8e6, 8, LINK) == reduce_scatter_time(8e6, 8, LINK)
    assert collective_time("all_to_all", 4e6, 4, LINK) == all_to_all_time(4e6, 4, LINK)
    assert collective_time("send_recv", 1e6, 2, LINK) == send_recv_time(1e6, LINK)


def test_collective_time_rejects_unknown_kind_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="broadcast.*all_reduce"):
        collective_time("broadcast", 1e6, 4, LINK)
    with pytest.raises(ValueError):
        all_reduce_time(1e6, 0, LINK)
    with pytest.raises(ValueError):
        all_gather_time(-1.0, 4, LINK)


def test_zero_bytes_is_free() -> None:
    assert all_reduce_time(0, 8, LINK) == 0.0
    assert send_recv_time(0, LINK) == 0.0


# ------------------------------------------------------------------------------- topology


def test_link_choice_two_nodes_of_eight() -> None:
    # mesh (dp=2, tp=8) on 2 nodes x 8 GPUs: tp (stride 1) stays in a node, dp (stride 8) spans.
    topo = get_preset("a100-dgx")
    assert topo.gpus_per_node == 8
    assert topo.link_for_axis(8, 1) is topo.intra_node
    assert topo.link_for_axis(2, 8) is topo.inter_node
    assert topo.intra_node.bandwidth_Bps > topo.inter_node.bandwidth_Bps
    # (dp=4, tp=4): tp intra; dp spans 4 * 4 = 16 ranks -> inter. (dp=2, tp=4) fits one node.
    assert topo.link_for_axis(4, 1) is topo.intra_node
    assert topo.link_for_axis(4, 4) is topo.inter_node
    assert topo.link_for_axis(2, 4) is topo.intra_node
    assert topo.link_for_axis(16, 1) is topo.inter_node
    with pytest.raises(ValueError):
        topo.link_for_axis(0, 1)


def test_axis_collective_time_picks_levels() -> None:
    topo = get_preset("a100-dgx")
    size = 1 << 30
    # tp=8 inside a node: flat ring on NVSwitch.
    assert axis_collective_time("all_reduce", size, 8, 1, topo) == all_reduce_time(
        size, 8, topo.intra_node
    )
    # dp=2 with stride 8: one rank per node, flat ring over the NIC rail.
    assert axis_collective_time("all_reduce", size, 2, 8, topo) == all_reduce_time(
        size, 2, topo.inter_node
    )
    # a 16-wide axis over 2 nodes: intra RS + inter AR of S/8 + intra AG (hierarchical).
    hier = (
        reduce_scatter_time(size, 8, topo.intra_node)
        + all_reduce_time(size / 8, 2, topo.inter_node)
        + all_gather_time(size, 8, topo.intra_node)
    )
    assert axis_collective_time("all_reduce", size, 16, 1, topo) == pytest.approx(hier)
    assert hier < all_reduce_time(size, 16, topo.inter_node)
    ag = all_gather_time(size / 8, 2, topo.inter_node) + all_gather_time(size, 8, topo.intra_node)
    assert axis_collective_time("all_gather", size, 16, 1, topo) == pytest.approx(ag)
    rs = reduce_scatter_time(size, 8, topo.intra_node) + reduce_scatter_time(
        size / 8, 2, topo.inter_node
    )
    assert axis_collective_time("reduce_scatter", size, 16, 1, topo) == pytest.approx(rs)
    # (dp=4, tp=2) on 8-GPU nodes, dp stride 2: 4 ranks per node, one node -> intra.
    assert axis_collective_time("all_gather", size, 4, 2, topo) == all_gather_time(
        size, 4, topo.intra_node
    )
    # all-to-all over 16 ranks: 8/16 of S over the NIC, 7/16 over NVSwitch.
    inter, intra = topo.inter_node, topo.intra_node
    a2a = inter.launch_s + 15 * inter.latency_s + size / 2 / inter.bandwidth_Bps
    a2a += 7 / 16 * size / intra.bandwidth_Bps
    assert axis_collective_time("all_to_all", size, 16, 1, topo) == pytest.approx(a2a)


def test_preset_lookup_error_lists_names() -> None:
    with pytest.raises(ValueError) as info:
        get_preset("tpu-v9")
    message = str(info.value)
    assert "tpu-v9" in message
    for name in ("a100-dgx", "h100-dgx", "h200-dgx", "cpu-gloo"):
        assert name in message
    assert set(PRESETS) == {"a100-dgx", "h100-dgx", "h200-dgx", "cpu-gloo"}


def test_preset_hardware_facts() -> None:
    a100, h100, h200 = get_preset("a100-dgx"), get_preset("h100-dgx"), get_preset("h200-dgx")
    assert a100.peak_flops == {"fp32": 19.5e12, "bf16": 312e12, "bf16_unaligned": 39e12}
    # the non-tensor bf16 rate, twice fp32's on Hopper (NVIDIA Hopper in-depth, Table 3)
    assert h100.peak_flops_for("bf16_unaligned") == h200.peak_flops_for("bf16_unaligned") == 134e12
    assert h100.peak_flops["bf16"] == 989e12 and h200.peak_flops["bf16"] == 989e12
    assert (a100.mem_bandwidth_Bps, h100.mem_bandwidth_Bps, h200.mem_bandwidth_Bps) == (
        2.0e12,
        3.35e12,
        4.8e12,
    )
    assert a100.memory_bytes == h100.memory_bytes == 80 * 1024**3
    assert h200.memory_bytes > h100.memory_bytes
    # effective bandwidths never exceed line rate: 300 / 450 GB/s NVLink per direction,
    # 200 / 400 Gb/s per NIC rail.
    assert 0.6 * 300e9 < a100.intra_node.bandwidth_Bps <= 300e9
    assert 0.6 * 450e9 < h100.intra_node.bandwidth_Bps <= 450e9
    assert 0.8 * 25e9 < a100.inter_node.bandwidth_Bps <= 25e9
    assert 0.8 * 50e9 < h100.inter_node.bandwidth_Bps <= 50e9
    for topo in PRESETS.values():
        assert 0 < topo.matmul_efficiency <= 1 and 0 < topo.pointwise_efficiency <= 1
        assert topo.peak_flops_for("fp16") == topo.peak_flops["bf16"]
        assert topo.peak_flops_for("torch.float32") == topo.peak_flops["fp32"]


def test_topology_json_round_trip() -> None:
    for topo in PRESETS.values():
        text = json.dumps(topo.to_dict())
        back = Topology.from_dict(json.loads(text))
        assert back == topo
        assert hash(back) == hash(topo)
        assert back.to_dict() == topo.to_dict()
    mine = custom("mine", base="h100-dgx", gpus_per_node=4, memory_bytes=40e9)
    assert Topology.from_dict(json.loads(json.dumps(mine.to_dict()))) == mine


def test_topology_from_dict_rejects_bad_input() -> None:
    data = get_preset("a100-dgx").to_dict()
    del data["gpus_per_node"]
    with pytest.raises(ValueError, match="gpus_per_node"):
        Topology.from_dict(data)
    data = get_preset("a100-dgx").to_dict()
    data["intra_node"]["bandwith_Bps"] = 1.0
    with pytest.raises(ValueError, match="bandwith_Bps"):
        Topology.from_dict(data)


def test_topology_validation() -> None:
    with pytest.raises(ValueError, match="efficiency"):
        _toy_topology(matmul_efficiency=1.5)
    with pytest.raises(ValueError, match="bf16"):
        _toy_topology(peak_flops={"fp32": 1.0})
    with pytest.raises(ValueError, match="bandwidth_Bps"):
        AxisLink(0.0, 1e-6, 1e-5)
    with pytest.raises(ValueError, match="gpus_per_node"):
        _toy_topology(gpus_per_node=0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        get_preset("h100-dgx").gpus_per_node = 4  # type: ignore[misc]


def test_custom_topology() -> None:
    mine = custom("a100-4gpu", base="a100-dgx", gpus_per_node=4)
    assert mine.name == "a100-4gpu" and mine.gpus_per_node == 4
    assert mine.peak_flops == get_preset("a100-dgx").peak_flops
    assert mine.link_for_axis(8, 1) is mine.inter_node
    full = custom(
        "lab",
        peak_flops={"fp32": 1e12, "bf16": 4e12},
        mem_bandwidth_Bps=1e12,
        memory_bytes=16e9,
        intra_node={"bandwidth_Bps": 50e9, "latency_s": 1e-6, "launch_s": 1e-5},
        inter_node=AxisLink(5e9, 5e-6, 1e-5),
        gpus_per_node=4,
        matmul_efficiency=0.7,
        pointwise_efficiency=0.8,
    )
    assert isinstance(full.intra_node, AxisLink) and full.intra_node.bandwidth_Bps == 50e9
    with pytest.raises(ValueError, match="missing fields"):
        custom("partial", gpus_per_node=4)
    with pytest.raises(ValueError, match="unknown fields"):
        custom("typo", base="a100-dgx", gpu_per_node=4)


# -------------------------------------------------------------------------------- compute


def test_op_time_roofline() -> None:
    topo = _toy_topology()
    # compute bound: 1000 FLOP / (100 * 0.5) = 20 s; memory: 10 B / (10 * 0.5) = 2 s
    assert op_time(1000, 10, topo) == pytest.approx(20.0)
    # bf16 peak 400 * 0.5 = 200 FLOP/s -> 5 s
    assert op_time(1000, 10, topo, dtype="bf16") == pytest.approx(5.0)
    # memory bound: 500 B / 5 B/s = 100 s
    assert op_time(1000, 500, topo, dtype="bf16") == pytest.approx(100.0)
    # non-matmul FLOPs run at the fp32 vector peak without efficiency: 1000 / 100 = 10 s
    assert op_time(1000, 10, topo, dtype="bf16", is_matmul=False) == pytest.approx(10.0)
    assert op_time(0, 0, topo) == 0.0
    with pytest.raises(ValueError):
        op_time(1.0, 1.0, topo, dtype="int4")


def test_flops_mm_addmm_bmm() -> None:
    m, k, n, b = 3, 5, 7, 4
    a, w = torch.randn(m, k), torch.randn(k, n)
    assert flops_of_node(aten.mm.default, (a, w), {}, a @ w) == 2 * m * k * n
    assert flops_of_node(aten.mm, (a, w), {}, a @ w) == 2 * m * k * n  # packet works too
    bias = torch.randn(n)
    out = torch.addmm(bias, a, w)
    assert flops_of_node(aten.addmm.default, (bias, a, w), {}, out) == 2 * m * k * n
    x, y = torch.randn(b, m, k), torch.randn(b, k, n)
    assert flops_of_node(aten.bmm.default, (x, y), {}, torch.bmm(x, y)) == 2 * b * m * k * n


def test_flops_with_fake_tensors_and_extras() -> None:
    bsz, heads, seq, dim = 2, 4, 128, 64
    with FakeTensorMode():
        a, w = torch.randn(1024, 2048), torch.randn(2048, 512)
        assert flops_of_node(aten.mm.default, (a, w), {}, a @ w) == 2 * 1024 * 2048 * 512
        q = torch.randn(bsz, heads, seq, dim)
        op = aten._scaled_dot_product_flash_attention_for_cpu.default
        out = op(q, q, q)
        # two batched matmuls QK^T and PV: 2 * (2 * b*h*s*s*d)
        expected = 4 * bsz * heads * seq * seq * dim
        assert flops_of_node(op, (q, q, q), {"scale": 0.125}, out) == expected
        assert flops_of_node(aten.scaled_dot_product_attention.default, (q, q, q), {}, None) == (
            expected
        )
        bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        grads = (out[0], q, q, q, out[0], out[1], 0.0, True)
        # recomputed scores + 4 gradient matmuls = 5 bmms of 2*b*h*s*s*d
        assert flops_of_node(bwd, grads, {}, None) == 10 * bsz * heads * seq * seq * dim
        x, lin_w = torch.randn(8, 16, 32), torch.randn(64, 32)
        assert flops_of_node(aten.linear.default, (x, lin_w), {}, None) == 2 * 8 * 16 * 32 * 64
        mm_a, mm_b = torch.randn(3, 1, 10, 20), torch.randn(5, 20, 6)
        assert flops_of_node(aten.matmul.default, (mm_a, mm_b), {}, None) == 2 * 15 * 10 * 20 * 6
        assert flops_of_node(aten.relu.default, (x,), {}, x) == 0.0
    assert flops_of_node(aten.add.Tensor, (torch.ones(2), torch.ones(2)), {}, None) == 0.0


def test_flops_agree_with_flop_counter_mode_on_a_traced_graph() -> None:
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.utils.flop_counter import FlopCounterMode

    def step(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
        loss = torch.nn.functional.linear(torch.relu(x @ w1.t()), w2).sum()
        return torch.autograd.grad(loss, (w1, w2))

    x = torch.randn(4, 16)
    w1 = torch.randn(32, 16, requires_grad=True)
    w2 = torch.randn(8, 32, requires_grad=True)
    graph = make_fx(step, tracing_mode="fake")(x, w1, w2)

    def to_val(a: object) -> object:
        return a.meta.get("val") if isinstance(a, torch.fx.Node) else a

    total = 0.0
    for node in graph.graph.nodes:
        if node.op == "call_function":
            args = torch.fx.node.map_aggregate(node.args, to_val)
            kwargs = torch.fx.node.map_aggregate(node.kwargs, to_val)
            total += flops_of_node(node.target, args, kwargs, node.meta.get("val"))
    counter = FlopCounterMode(display=False)
    with counter:
        step(x, w1, w2)
    forward = 2 * 4 * (16 * 32 + 32 * 8)
    # backward: dW2 (2*4*8*32), dH (2*4*8*32), dW1 (2*4*32*16)
    assert total == counter.get_total_flops() == forward + 2 * 4 * (8 * 32 * 2 + 32 * 16)


def test_bytes_of_node() -> None:
    a, b = torch.randn(4, 8), torch.randn(8, 2, dtype=torch.bfloat16)
    out = (torch.empty(4, 2), None)
    assert bytes_of_node((a, [b, 3]), {"alpha": 1.0}, out) == 4 * 8 * 4 + 8 * 2 * 2 + 4 * 2 * 4


# --------------------------------------------------------------------------------- memory


def test_training_state_bytes() -> None:
    assert training_state_bytes_per_param("fp32") == 16
    assert training_state_bytes_per_param("bf16") == 18
    assert training_state_bytes_per_param("torch.bfloat16") == 18
    assert training_state_bytes_per_param("bf16", fp32_grads=False) == 16  # ZeRO paper's 2+2+12
    assert adam_state_bytes_per_param("fp32") == 16 and adam_state_bytes_per_param("bf16") == 18
    assert optimizer_state_bytes_per_param("fp32") == 8
    assert optimizer_state_bytes_per_param("bf16") == 12
    parts = training_state_breakdown("bf16")
    assert (parts.param, parts.grad, parts.optimizer, parts.total) == (2, 4, 12, 18)
    with pytest.raises(ValueError, match="fp8"):
        training_state_bytes_per_param("fp8")


def test_zero_sharding() -> None:
    assert zero_sharded_bytes_per_param("bf16", 0, 8) == 18
    # Megatron distributed optimizer: 6 + 12/d
    assert zero_sharded_bytes_per_param("bf16", 1, 8) == pytest.approx(6 + 12 / 8)
    assert zero_sharded_bytes_per_param("bf16", 2, 8) == pytest.approx(2 + 16 / 8)
    assert zero_sharded_bytes_per_param("fp32", 3, 4) == pytest.approx(16 / 4)
    assert math.isclose(zero_sharded_bytes_per_param("fp32", 3, 1), 16)
    with pytest.raises(ValueError):
        zero_sharded_bytes_per_param("fp32", 4, 2)
    with pytest.raises(ValueError):
        zero_sharded_bytes_per_param("fp32", 1, 0)


def test_overlapped_step_time_hand_computed() -> None:
    from autopar.cost_models.overlap import Comm, overlapped_step_time

    order, compute = ["a", "b", "c"], {"a": 1.0, "b": 1.0, "c": 1.0}
    # issued after a, needed by c: hidden behind b
    assert overlapped_step_time(order, compute, [Comm("a", "c", 0.5)]) == 3.0
    # needed right away by b: c waits 0.5
    assert overlapped_step_time(order, compute, [Comm("a", "b", 0.5)]) == 3.5
    # issued at the end, needed by the end: all exposed
    assert overlapped_step_time(order, compute, [Comm("c", None, 2.0)]) == 5.0
    # one channel: two collectives issued together run one after the other (1 + 1.5 + 1.5)
    assert overlapped_step_time(order, compute, [Comm("a", None, 1.5), Comm("a", None, 1.5)]) == 4.0
    # a later collective never starts before an earlier one (issue order): the second, ready
    # after a, waits for the first (issued after b, 2 -> 3), so c starts at 3.1
    assert overlapped_step_time(order, compute, [Comm("b", None, 1.0), Comm("a", "c", 0.1)]) == 4.1
    # bounds: between max(compute, comm) and compute + comm
    comms = [Comm(None, None, 4.0)]
    assert overlapped_step_time(order, compute, comms) == 4.0
    assert overlapped_step_time(order, compute, [Comm(None, "a", 4.0)]) == 7.0
