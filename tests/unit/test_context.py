"""Context parallelism in the plan: the cp axis, attention's queries sharded on the sequence
over it, and the rank's place in the sequence (the equivalence checks with processes are in
tests/distributed/test_equivalence.py)."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.errors import PlanError
from autopar.passes.seq_attention import query_offset
from models import build


def _plan(cp: int, devices: int, **config) -> autopar.Plan:
    model, inputs = build("gpt", dim=64, heads=4, layers=2, batch=4, seq=64)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=devices)
    return autopar.plan(model, mesh, inputs, config=autopar.Config(cp=cp, **config))


def test_cp_axis_shards_attention_queries_and_gathers_keys_and_values():
    plan = _plan(2, 4, tp=2)
    assert plan.degrees == {"dp": 1, "tp": 2, "pp": 1, "cp": 2, "ep": 1}
    assert plan.axis_names == ("cp", "tp")
    forward = [n for n in plan.nodes if n.startswith("_scaled_dot_product_flash_attention_for_cpu")
               and "backward" not in n]
    backward = [n for n in plan.nodes if n.startswith("_scaled_dot_product_flash_attention_for_cpu_backward")]
    assert len(forward) == len(backward) == 2
    for n in forward:  # q, k, v on the cp axis (axis 0): queries split, keys and values whole
        assert [p[0] for p in plan.nodes[n].inputs[:3]] == ["S(2)", "R", "R"], plan.nodes[n]
    for n in backward:  # each rank's share of the keys' and values' gradients, summed after
        assert [p[0] for p in plan.nodes[n].outputs] == ["S(2)", "P(sum)", "P(sum)"], plan.nodes[n]
    # the inputs' sequence is split over cp, the parameters are whole on it
    assert all(p[0] == "S(1)" for p in plan.inputs)
    assert all(p[0] == "R" for p in plan.params.values())


def test_a_plan_without_cp_says_cp_1_and_older_plans_load(tmp_path):
    plan = _plan(1, 2)
    assert plan.degrees["cp"] == 1 and "cp" not in plan.axis_names
    data = plan.to_dict()
    del data["degrees"]["cp"]  # as saved before context parallelism
    assert autopar.Plan.from_dict(data).degrees["cp"] == 1


def test_cp_must_divide_the_devices_and_be_positive():
    with pytest.raises(PlanError, match="cp=3"):
        _plan(3, 4)
    with pytest.raises(ValueError, match="Config.cp=0"):
        autopar.Config(cp=0)


class _Mesh:
    """The two calls ``query_offset`` makes of a DeviceMesh."""

    def __init__(self, shape, coords):
        self.shape, self.coords = shape, coords

    def size(self, axis):
        return self.shape[axis]

    def get_local_rank(self, axis):
        return self.coords[axis]


@pytest.mark.parametrize("placements, shape, coords, expected", [
    ((Shard(2),), (4,), (3,), (48, 16)),                              # cp=4, the last rank
    ((Shard(2), Replicate()), (2, 2), (1, 1), (32, 32)),              # cp=2 x tp=2
    ((Shard(2), Shard(2)), (2, 2), (1, 0), (32, 16)),                 # split twice: outer first
    ((Shard(2), Shard(2)), (2, 2), (0, 1), (16, 16)),
    ((Shard(0), Shard(2)), (2, 2), (1, 1), (32, 32)),                 # batch on the other axis
])
def test_query_offset_follows_dtensor_order(placements, shape, coords, expected):
    assert query_offset(64, placements, _Mesh(shape, coords)) == expected


def test_the_search_tries_cp_only_for_long_sequences_or_when_asked():
    from autopar.planning.search import CP_MIN_SEQUENCE, candidate_setups, cp_degrees

    short = list(candidate_setups(64, 8, 256, 16, autopar.Config(), seq=CP_MIN_SEQUENCE // 2))
    assert {s.cp for s in short} == {1}
    long = list(candidate_setups(64, 8, 256, 16, autopar.Config(), seq=CP_MIN_SEQUENCE * 2))
    assert {s.cp for s in long} == {1, 2, 4, 8, 16, 32}
    assert all(s.dp * s.cp * s.tp * s.pp == 64 for s in long)
    asked = list(candidate_setups(64, 8, 256, 16, autopar.Config(cp=4), seq=2048))
    assert asked and {s.cp for s in asked} == {4}
    assert cp_degrees(autopar.Config(cp=3), 4096, 8) == []  # 3 does not divide 8 devices


def test_cp_gradients_are_reduced_in_the_layer_costs_not_again_at_the_step_end():
    """Over dp (stride cp * tp) the closed form reduces the gradients once a step; over cp the
    layer ILP already does (on the (cp, tp) submesh, in each microbatch's backward: measured
    below as the block's backward communication), so the closed form adds nothing there (it
    used to add a second all-reduce over cp)."""
    from autopar.cost_models.topology import get_preset
    from autopar.cost_models.training_step import LayerCosts, Setup, UnitCosts, price_setup

    unit = UnitCosts(1e-3, 2e-3, 0.0, 0.0, 1e9, 1e9, 2.5e8)
    lc = LayerCosts(unit, unit, unit, 4, 0.0, 0.0, 1e6, 1e6, 2, "adam")
    topo = get_preset("h100-dgx")
    plain = price_setup(lc, Setup(8, 1, 1, 1, 1, "none", 1, "none", 0, False), topo, 1e15)
    ctx = price_setup(lc, Setup(4, 1, 1, 1, 1, "none", 1, "none", 0, False, cp=2), topo, 1e15)
    assert ctx.parts["dp_comm_s"] > 0 and plain.parts["dp_comm_s"] > 0
    assert ctx.parts["dp_comm_s"] != plain.parts["dp_comm_s"]  # other groups (stride cp)
    one = price_setup(lc, Setup(1, 1, 1, 1, 1, "none", 1, "none", 0, False, cp=8), topo, 1e15)
    assert one.parts["dp_comm_s"] == 0  # no dp: nothing at the step end


def test_cp_block_backward_carries_the_gradient_reduction_over_cp():
    """The block's backward communication at cp=2 holds the all-reduce of its weights'
    gradients over cp (the ILP's delivery of the gradients whole), the same as pricing that
    all-reduce of the block's parameter bytes directly."""
    from autopar.cost_models.comm import axis_collective_time
    from autopar.model_presets import megatron_gpt
    from autopar.planning.search import LayerSolver

    model, inputs = megatron_gpt(dict(hidden=512, layers=2, heads=8), batch=1, seq=2048,
                                 vocab=1024, flash=True)
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=1, gpus_per_node=2)
    layers = LayerSolver(model, inputs, mesh, autopar.Config(), ())
    block = layers.costs(1, 1, False, cp=2).block
    grads = axis_collective_time("all_reduce", block.param_elements * 2, 2, 1, mesh.topology)
    assert block.backward_comm_s >= grads
    assert layers.costs(1, 1, False, cp=1).block.backward_comm_s == 0
