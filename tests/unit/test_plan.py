"""Planning without devices: the Megatron plan's records, JSON round trip, errors, cost passes."""

from __future__ import annotations

import json

import pytest
import torch

import autopar
from autopar.cost_models.passes import clear_cost_passes
from autopar.plan import Plan
from models import build

MEGATRON_KW = dict(dim=512, batch=2, seq=64, heads=8)


@pytest.fixture(scope="module")
def megatron():
    model, inputs = build("gpt", **MEGATRON_KW)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)
    return model, inputs, mesh, autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2))


def test_megatron_plan_records(megatron):
    *_, plan = megatron
    assert plan.degrees == {"dp": 1, "tp": 2, "pp": 1}
    assert plan.params["blocks.0.qkv.weight"] == ("SS(0,3)",)
    assert plan.params["blocks.1.fc2.weight"] == ("S(1)",)
    assert plan.collective_counts(phase="forward") == {"all_reduce": 4}
    assert plan.collective_counts(phase="backward") == {"all_reduce": 4}
    act = MEGATRON_KW["batch"] * MEGATRON_KW["seq"] * MEGATRON_KW["dim"] * 4  # fp32 activations
    for c in plan.collectives:
        assert (c.kind, c.axis, c.bytes) == ("all_reduce", "tp", act)
        assert c.layer in ("blocks.0", "blocks.1") and c.phase in ("forward", "backward")
    assert plan.predicted["step_time_s"] > 0 and plan.predicted["peak_memory_bytes"] > 0
    assert plan.solver["status"] == "optimal"
    assert plan.solver["ilp_variables"] < plan.solver["ilp_variables_unlinked"]


def test_plan_text_and_json_round_trip(megatron, tmp_path):
    *_, plan = megatron
    text = str(plan)
    assert "tp=2" in text and "blocks.0.qkv.weight" in text and "all_reduce" in text
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again.to_dict() == plan.to_dict()
    assert again.digest() == plan.digest()


def test_corrupt_plans_raise_plan_error(megatron, tmp_path):
    *_, plan = megatron
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(autopar.PlanError, match="cannot read plan file"):
        Plan.load(bad)
    d = plan.to_dict()
    del d["nodes"]
    bad.write_text(json.dumps(d))
    with pytest.raises(autopar.PlanError, match="malformed"):
        Plan.load(bad)
    d = plan.to_dict()
    d["format"] = 999
    bad.write_text(json.dumps(d))
    with pytest.raises(autopar.PlanError, match="format"):
        Plan.load(bad)


def test_planning_is_deterministic(megatron):
    model, inputs, mesh, plan = megatron
    again = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2))
    assert again.digest() == plan.digest()


def test_impossible_memory_budget():
    model, inputs = build("gpt")
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)
    with pytest.raises(autopar.InfeasibleMemoryError) as err:
        autopar.plan(model, mesh, inputs, config=autopar.Config(memory_bytes=1000))
    assert err.value.required_bytes > 1000
    assert "memory_bytes" in str(err.value)


def test_degrees_that_do_not_fit_the_mesh():
    model, inputs = build("mlp")
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)
    with pytest.raises(autopar.PlanError, match="dp \\* tp"):
        autopar.plan(model, mesh, inputs, config=autopar.Config(tp=3))
    with pytest.raises(autopar.PlanError, match="pipeline"):
        autopar.plan(model, mesh, inputs, config=autopar.Config(pp=2))


@pytest.mark.parametrize("bad", [dict(tp=0), dict(unknown_op="x"), dict(memory_bytes=-1),
                                 dict(solver_time_limit_s=0)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        autopar.Config(**bad)


def test_unknown_op_warns_or_errors():
    model, inputs = build("mlp")  # F.mse_loss has no DTensor rule
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2))
    assert any("mse_loss" in w and "replicated" in w for w in plan.warnings)
    with pytest.raises(autopar.UnsupportedOpError, match="register_op_rule"):
        autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2, unknown_op="error"))


def test_free_search_reports_alternatives():
    model, inputs = build("gpt", **dict(MEGATRON_KW, batch=4))  # batch divisible by dp=4
    plan = autopar.plan(model, autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=4), inputs)
    assert len(plan.alternatives) == 2  # three (dp, tp) factorisations of 4 devices
    for alt in plan.alternatives:
        assert alt["step_time_s"] >= plan.predicted["step_time_s"]


def _forbid_sharded_params(costs, space, topology):
    """A cost pass: make every parameter strategy that is not replicated prohibitively slow."""
    import numpy as np
    from torch.distributed.tensor import Replicate

    for name, ns in space.nodes.items():
        if ns.source == "param":
            penalty = np.array([0.0 if all(isinstance(p, Replicate) for p in s.outputs[0]) else 1e3
                                for s in ns.strategies])
            costs.compute[name] = costs.compute[name] + penalty
    return costs


def test_cost_pass_changes_the_plan(megatron):
    model, inputs, mesh, plan = megatron
    assert any(p != ("R",) for p in plan.params.values())
    forced = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2),
                          cost_passes=[_forbid_sharded_params])
    assert all(p == ("R",) for p in forced.params.values())
    try:
        autopar.cost_pass(_forbid_sharded_params)
        registered = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2))
        assert registered.digest() == forced.digest()
    finally:
        clear_cost_passes()
    with pytest.raises(TypeError, match="returned None"):
        autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2),
                     cost_passes=[lambda costs, space, topo: None])
