"""Extension points: cost passes (per call and registered) and user sharding rules for custom ops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.capture import capture
from autopar.cost_models.passes import clear_cost_passes, registered_cost_passes
from models import slow_compute
from autopar.mesh import planning_device_mesh
from autopar.strategies.rules import registered_rules
from autopar.strategies.space import build_space

# ---- cost passes -------------------------------------------------------------------------------

# Far above any step time of these small models (they predict well under a millisecond).
PENALTY_S = 1e3


def _forbid_sharded_params(costs, space, topology):
    """A cost pass: make every parameter strategy that is not fully replicated prohibitive."""
    for name, ns in space.nodes.items():
        if ns.source == "param":
            penalty = np.array([0.0 if all(isinstance(p, Replicate) for p in s.outputs[0])
                                else PENALTY_S for s in ns.strategies])
            costs.compute[name] = costs.compute[name] + penalty
    return costs


def test_cost_pass_per_call_changes_the_plan(megatron):
    model, inputs, mesh, plan = megatron
    assert any(p != ("R",) for p in plan.params.values())  # Megatron shards weights
    forced = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2),
                          cost_passes=[_forbid_sharded_params])
    assert all(p == ("R",) for p in forced.params.values())
    assert forced.predicted["step_time_s"] < PENALTY_S  # no penalised strategy was chosen
    assert forced.digest() != plan.digest()


def test_a_cost_pass_changing_an_array_in_place_is_refused(megatron):
    # identical layers (and the spaces the search prices one after another) share their priced
    # arrays: an in-place change would reach other nodes, so the arrays are read-only
    model, inputs, mesh, _ = megatron

    def in_place(costs, space, topology):
        for name, ns in space.nodes.items():
            if ns.source == "param":
                costs.compute[name] += PENALTY_S
        return costs

    with pytest.raises(ValueError, match="read-only"):
        autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2), cost_passes=[in_place])


def test_cost_pass_sees_costs_space_and_topology(megatron):
    model, inputs, mesh, plan = megatron
    seen = {}

    def spy(costs, space, topology):
        seen["topology"] = topology.name
        seen["mesh"] = space.mesh_shape
        seen["aligned"] = all(len(costs.compute[n]) == len(ns.strategies)
                              for n, ns in space.nodes.items())
        # every op node says which aten op it calls: a pass can match ops, not node names
        ops = {ns.op.overloadpacket for ns in space.nodes.values() if ns.op is not None}
        seen["ops"] = {torch.ops.aten.addmm, torch.ops.aten.native_layer_norm} <= ops
        seen["placeholders"] = all(ns.op is None for ns in space.nodes.values()
                                   if ns.source in ("param", "input", "tangent"))
        return costs

    again = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2), cost_passes=[spy])
    assert seen == {"topology": "a100-dgx", "mesh": (2,), "aligned": True, "ops": True,
                    "placeholders": True}
    assert again.digest() == plan.digest()  # a pass that changes nothing changes nothing


def test_registered_cost_pass_runs_on_every_plan(megatron):
    model, inputs, mesh, plan = megatron
    assert registered_cost_passes() == ()
    try:
        assert autopar.cost_pass(_forbid_sharded_params) is _forbid_sharded_params
        assert registered_cost_passes() == (_forbid_sharded_params,)
        registered = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2))
        assert all(p == ("R",) for p in registered.params.values())
    finally:
        clear_cost_passes()
    assert registered_cost_passes() == ()
    assert autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2)).digest() == plan.digest()


def test_cost_pass_returning_none_is_a_type_error(megatron):
    model, inputs, mesh, _ = megatron

    def forgetful(costs, space, topology):
        costs.compute  # modifies nothing and forgets to return
    with pytest.raises(TypeError, match="forgetful.*returned None"):
        autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2), cost_passes=[forgetful])


# ---- a user rule for a custom op ---------------------------------------------------------------

@torch.library.custom_op("autopar_test::scale2", mutates_args=())
def scale2(x: torch.Tensor) -> torch.Tensor:
    """x * 2, opaque to DTensor (no sharding rule until the test registers one)."""
    return x * 2


@scale2.register_fake
def _scale2_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def _scale2_backward(ctx, grad: torch.Tensor) -> torch.Tensor:
    return scale2(grad)


scale2.register_autograd(_scale2_backward)


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(scale2(self.fc1(x))).sum()


def _scale2_nodes(traced):
    op = torch.ops.autopar_test.scale2.default
    return [n.name for n in traced.gm.graph.nodes if n.op == "call_function" and n.target is op]


def test_custom_op_rule_is_used_by_the_planner():
    op = torch.ops.autopar_test.scale2.default
    assert op not in registered_rules(), "this test registers the rule itself"
    model, x = _Scaled(), torch.randn(8, 16)
    traced = capture(model, (x,))
    nodes = _scale2_nodes(traced)
    assert len(nodes) == 2  # forward and backward (the backward calls scale2 again)
    mesh = autopar.Mesh.virtual(slow_compute(), nodes=1, gpus_per_node=2)
    config = autopar.Config(tp=2)

    # without a rule: replicated, with a warning per node
    before = autopar.plan(model, mesh, (x,), config=config)
    for n in nodes:
        assert any(w.startswith(f"{n} ") and "no sharding rule" in w for w in before.warnings)
        assert before.nodes[n].outputs == (("R",),)
    with pytest.raises(autopar.UnsupportedOpError, match="autopar_test.scale2"):
        autopar.plan(model, mesh, (x,), config=autopar.Config(tp=2, unknown_op="error"))

    @autopar.register_op_rule(op)
    def scale2_rule(args_meta, kwargs_meta):
        ndim = len(args_meta[0].shape)
        return [[Shard(d), Shard(d)] for d in range(ndim)] + [[Replicate(), Replicate()]]

    assert registered_rules()[op].fn is scale2_rule
    with planning_device_mesh((2,), ("tp",)) as dm:
        space = build_space(traced, dm, ("tp",))
    for n in nodes:
        ns = space.nodes[n]
        assert ns.source != "fallback-replicate"
        # exactly the rule's strategies: output and input placed alike, every dim or replicated
        assert {(s.outputs, s.inputs) for s in ns.strategies} == {
            (((p,),), ((p,),)) for p in (Shard(0), Shard(1), Replicate())}
    after = autopar.plan(model, mesh, (x,), config=config)
    assert not any("scale2" in w for w in after.warnings)
    # with compute this slow the solver shards the hidden activations (fc1 column-parallel,
    # fc2 row-parallel), through scale2 without gathering
    for n in nodes:
        assert after.nodes[n].outputs != (("R",),), after.nodes[n]
    assert after.predicted["step_time_s"] < before.predicted["step_time_s"]


@pytest.mark.parametrize("before", [True, False])
def test_planning_pauses_the_garbage_collector_and_restores_it(megatron, before):
    """The planner turns Python's cyclic collector off while it plans (its structures are
    many and live until it ends) and leaves it as it found it, on or off, also when planning
    fails."""
    import gc

    model, inputs, mesh, _ = megatron
    seen = []

    def spy(costs, space, topology):
        seen.append(gc.isenabled())
        return costs

    def fail(costs, space, topology):
        raise RuntimeError("a failing pass")

    (gc.enable if before else gc.disable)()
    try:
        autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2), cost_passes=[spy])
        assert seen and not any(seen)
        assert gc.isenabled() is before
        with pytest.raises(RuntimeError, match="a failing pass"):
            autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2), cost_passes=[fail])
        assert gc.isenabled() is before
    finally:
        gc.enable()
