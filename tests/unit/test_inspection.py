"""Inspecting a plan: per-operator costs, the operator table, the step breakdown, and
``plan.explain`` (why a strategy won, checked against the ILP's optimality)."""

from __future__ import annotations

import json
import math

import pytest

import autopar
from autopar.cost_models.training_step import optimizer_step_time
from autopar.plan_context import context_of
from autopar.report.explain import explain_node
from autopar.placements import from_str
from autopar._torch_private import _StridedShard
from torch.distributed.tensor import Shard

# sums of a few hundred float64 terms: only rounding separates them
SUMS = 1e-9


def _ops(plan):
    return {name: n for name, n in plan.nodes.items() if n.op not in ("placeholder", "getitem")}


def test_node_costs_add_up_to_the_plan_prediction(megatron):
    *_, plan = megatron
    ops = _ops(plan)
    compute = sum(n.compute_s for n in plan.nodes.values())
    comm = sum(n.comm_s for n in plan.nodes.values())
    assert compute == pytest.approx(plan.predicted["compute_s"], rel=SUMS)
    assert comm == pytest.approx(plan.predicted["comm_s"], rel=SUMS)
    assert all(n.phase in ("forward", "backward") and n.op for n in ops.values())
    qkv = [n for n in ops.values() if n.module == "blocks.0.qkv" and n.op == "aten.addmm"]
    assert len(qkv) == 1 and qkv[0].layer == "blocks.0" and qkv[0].phase == "forward"
    # the nodes that need a collective carry its time: each forward all-reduce's consumer
    for c in plan.collectives:
        if c.node != "output":
            assert plan.nodes[c.node].comm_s > 0, c


def test_operator_table_collapses_layers_and_expands_on_request(megatron):
    *_, plan = megatron
    ops = _ops(plan)
    collapsed = plan.operator_table()
    assert "blocks.0 .. blocks.1" in collapsed  # identical layers share a line
    assert not any(f"\n{name} " in collapsed for name in ops)
    full = plan.operator_table(expand=True)
    assert all(f"\n{name} " in full for name in ops)
    one = plan.operator_table(expand=["blocks.1"])
    inside = [name for name, n in ops.items() if n.layer == "blocks.1"]
    outside = [name for name, n in ops.items() if n.layer == "blocks.0"]
    assert all(f"\n{name} " in one for name in inside)
    assert not any(f"\n{name} " in one for name in outside)
    assert "operators" in str(plan) and "training step" in str(plan)


def test_step_breakdown_of_a_flat_plan(megatron):
    *_, plan = megatron
    parts = plan.step_breakdown()
    assert parts["bubble_s"] == 0.0
    assert parts["compute_s"] == plan.predicted["compute_s"]
    # the collectives compute does not hide: the step beyond the compute, at most all of them
    assert parts["exposed_comm_s"] == pytest.approx(
        plan.predicted["step_time_s"] - plan.predicted["compute_s"], rel=SUMS)
    assert 0 < parts["exposed_comm_s"] <= plan.predicted["comm_s"] * (1 + SUMS)
    assert parts["total_s"] == pytest.approx(
        plan.predicted["step_time_s"] + parts["optimizer_s"], rel=SUMS)
    # the optimizer updates this device's shard of every parameter (the tied one once)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)
    model = megatron[0]
    local = 0
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        split = [pl for pl in map(from_str, plan.params[name])
                 if isinstance(pl, (Shard, _StridedShard))]
        local += p.numel() // (2 ** len(split))
    assert parts["optimizer_s"] == pytest.approx(
        optimizer_step_time(local, "adam", mesh.topology), rel=SUMS)


def test_explain_finds_no_cheaper_alternative_that_fits(megatron):
    """At the ILP's optimum no single group can change strategy (the rest held) to a cheaper
    one that fits memory; a wrong price or index in explain would show one."""
    *_, plan = megatron
    assert plan.solver["status"] == "optimal" and plan.solver["gap"] == 0
    ctx = context_of(plan)
    seen = set()
    for node in ctx.choice:
        if ctx.group_of[node] in seen:
            continue
        seen.add(ctx.group_of[node])
        ex = explain_node(ctx, node, 10**6, plan.nodes[node])
        best = ex.chosen.total_s
        scale = max(best, 1e-6)
        for alt in ex.alternatives:
            if alt.fits:
                assert alt.total_s >= best - 1e-9 * scale, (node, alt, ex.chosen)
        assert len(ex.alternatives) == ex.num_strategies


def test_explain_a_module_shows_its_costliest_node_and_its_alternatives(megatron):
    *_, plan = megatron
    ex = plan.explain("blocks.0.fc1")
    first = ex.nodes[0]
    assert first.op == "aten.addmm" and first.module == "blocks.0.fc1"
    assert first.chosen.outputs == (("S(1)",),)  # column-parallel: output columns split
    assert first.group_size == 2  # linked with blocks.1.fc1
    assert first.alternatives[0].total_s <= first.chosen.total_s + 1e-12
    text = str(ex)
    assert "chosen" in text and "vs chosen" in text and "blocks.0.fc1" in text
    # a parameter name explains its placeholder
    assert plan.explain("blocks.0.fc1.weight").nodes[0].chosen.outputs[0] == ("S(0)",)
    assert "setups compared" in plan.explain()


def test_explain_errors_say_what_to_do(megatron, tmp_path):
    *_, plan = megatron
    with pytest.raises(autopar.PlanError, match="no node, parameter, module or layer"):
        plan.explain("blocks.7.nothing")
    plan.save(tmp_path / "p.json")
    with pytest.raises(autopar.PlanError, match="loaded from JSON"):
        autopar.Plan.load(tmp_path / "p.json").explain("blocks.0.fc1")


def test_plans_saved_without_node_costs_still_load(megatron):
    *_, plan = megatron
    d = json.loads(plan.to_json())
    for n in d["nodes"].values():
        for k in ("op", "module", "layer", "phase", "compute_s", "comm_s"):
            del n[k]
    old = autopar.Plan.from_dict(d)
    assert old.digest() == plan.digest()  # costs are not part of what the ranks execute
    assert all(n.compute_s == 0.0 for n in old.nodes.values())
    assert "saved without per-operator costs" in old.operator_table()
    assert math.isfinite(old.step_breakdown()["total_s"])


def test_techniques_record_sequence_parallelism(megatron):
    model, inputs, mesh, plan = megatron
    assert plan.techniques["sequence_parallel"] is False  # layer norms replicated on tp
    sp = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2, sequence_parallel=True))
    assert sp.techniques["sequence_parallel"] is True
    assert "sequence_parallel=True" in str(sp)

