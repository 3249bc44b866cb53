"""Planning without devices: the Megatron plan's records, JSON round trip, errors, free search.

The Megatron plan (GPT dim=512, batch=2, seq=64, heads=8, 2 layers, tp=2 on 2 virtual A100s) is
the session fixture ``megatron`` of ``conftest.py``.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

import autopar
from autopar.plan import Plan
from models import build

TWO_A100 = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)
FOUR_A100 = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=4)


@pytest.fixture(scope="module")
def free_search(megatron_kw):
    """Free search (``Config()``) of the Megatron GPT on 4 devices; batch 4 so dp=4 is placeable."""
    model, inputs = build("gpt", **dict(megatron_kw, batch=4))
    return autopar.plan(model, FOUR_A100, inputs)


@pytest.fixture(scope="module")
def small():
    """``(model, inputs, plan)``: the default small GPT (2 layers) planned with tp=2 on 2 devices."""
    model, inputs = build("gpt")
    return model, inputs, autopar.plan(model, TWO_A100, inputs, config=autopar.Config(tp=2))


# ---- the Megatron plan's records ---------------------------------------------------------------

def test_megatron_layout(megatron):
    *_, plan = megatron
    assert plan.degrees == {"dp": 1, "tp": 2, "pp": 1, "cp": 1, "ep": 1}
    assert plan.mesh_shape == (2,) and plan.axis_names == ("tp",)
    for i in range(2):
        # column-parallel fused qkv (head-aligned) and fc1, row-parallel proj and fc2
        assert plan.params[f"blocks.{i}.qkv.weight"] == ("SS(0,3)",)
        assert plan.params[f"blocks.{i}.fc1.weight"] == ("S(0)",)
        assert plan.params[f"blocks.{i}.proj.weight"] == ("S(1)",)
        assert plan.params[f"blocks.{i}.fc2.weight"] == ("S(1)",)
    assert plan.params["head.weight"] == plan.params["wte.weight"]  # tied: one placement


def test_collective_records(megatron):
    *_, plan = megatron
    assert plan.collectives
    kinds = {"all_reduce", "all_gather", "reduce_scatter"}
    for c in plan.collectives:
        assert c.kind in kinds and c.axis in plan.axis_names
        assert isinstance(c.bytes, int) and c.bytes > 0
        assert c.phase in ("forward", "backward")
        assert c.layer in ("blocks.0", "blocks.1"), c  # Megatron communicates inside blocks only
        assert c.node in plan.nodes or c.node == "output"


def test_forward_all_reduces(megatron, megatron_kw):
    *_, plan = megatron
    # Megatron: one all-reduce after attention and one after the MLP, per layer
    assert plan.collective_counts(phase="forward") == Counter({"all_reduce": 4})
    assert plan.collective_counts(phase="forward", axis="tp") == Counter({"all_reduce": 4})
    per_layer = Counter(c.layer for c in plan.collectives if c.phase == "forward")
    assert per_layer == {"blocks.0": 2, "blocks.1": 2}
    # each all-reduces the residual stream: batch x seq x dim fp32 (4 bytes) elements
    act = megatron_kw["batch"] * megatron_kw["seq"] * megatron_kw["dim"] * 4
    assert [c.bytes for c in plan.collectives if c.phase == "forward"] == [act] * 4
    assert sum(plan.collective_counts().values()) == len(plan.collectives)


def test_predictions_and_solver_records(megatron):
    *_, plan = megatron
    pred = plan.predicted
    assert pred["step_time_s"] > 0 and pred["peak_memory_bytes"] > 0
    # step time is compute plus the communication that compute does not hide: between the
    # two sums' maximum and their total (relative tolerance for float summation order)
    total = pred["compute_s"] + pred["comm_s"]
    assert max(pred["compute_s"], pred["comm_s"]) <= pred["step_time_s"] <= total * (1 + 1e-9)
    assert pred["comm_s"] > 0  # the plan has collectives, so communication costs something
    # Megatron's layout hides the backward's input-gradient all-reduces behind the weight
    # gradients' GEMMs, not the forward's (the next layer needs them at once)
    assert pred["step_time_s"] < total * (1 - 1e-6)
    forward_comm = pred["forward_s"] - sum(n.compute_s for n in plan.nodes.values()
                                           if n.phase == "forward")
    assert pred["step_time_s"] >= pred["compute_s"] + forward_comm * (1 - 1e-9)
    # memory: at least the sharded weights with Adam state (16 bytes per fp32 element); the
    # replicated part (embeddings, norms) is held whole. Lower bound: all weights / tp.
    model, *_ = megatron
    n = sum(p.numel() for p in model.parameters())
    assert pred["peak_memory_bytes"] >= 16 * n / 2
    s = plan.solver
    assert s["status"] in ("optimal", "feasible")
    assert isinstance(s["gap"], float) and s["gap"] >= 0
    assert s["ilp_variables"] > 0
    assert s["ilp_variables_unlinked"] > s["ilp_variables"]  # linking identical layers shrinks it


def test_linked_ilp_does_not_grow_with_depth(small):
    *_, two = small
    model, inputs = build("gpt", layers=4)
    four = autopar.plan(model, TWO_A100, inputs, config=autopar.Config(tp=2))
    # identical layers share one set of variables, while the unlinked problem grows
    assert four.solver["ilp_variables"] == two.solver["ilp_variables"]
    assert four.solver["ilp_variables_unlinked"] > two.solver["ilp_variables_unlinked"]


def test_plan_text(megatron, megatron_kw):
    *_, plan = megatron
    text = str(plan)
    assert "dp=1, tp=2, pp=1" in text
    for name in plan.params:
        assert name in text
    assert "collectives per step" in text
    table = text.split("collectives per step", 1)[1]
    for col in ("layer", "phase", "kind", "axis", "count", "bytes"):
        assert col in table
    act = megatron_kw["batch"] * megatron_kw["seq"] * megatron_kw["dim"] * 4
    # one row per (layer, phase): 2 all-reduces of act bytes each
    assert table.count("all_reduce") == 4 and str(2 * act) in table


# ---- persistence -------------------------------------------------------------------------------

def test_save_load_round_trip(megatron, tmp_path):
    *_, plan = megatron
    path = tmp_path / "plan.json"
    plan.save(path)
    again = Plan.load(path)
    assert again.to_dict() == plan.to_dict()
    assert again.digest() == plan.digest()
    assert again.collectives == plan.collectives
    # saving the loaded plan writes the same file
    path2 = tmp_path / "again.json"
    again.save(path2)
    assert path2.read_text() == path.read_text()


def test_digest_covers_what_ranks_execute(megatron):
    *_, plan = megatron
    d = plan.to_dict()
    d["params"]["blocks.0.fc1.weight"] = ["R"]
    assert Plan.from_dict(d).digest() != plan.digest()
    d = plan.to_dict()
    d["predicted"]["step_time_s"] *= 2  # timings are not part of the digest
    assert Plan.from_dict(d).digest() == plan.digest()


def test_save_load_round_trip_with_alternatives(free_search, tmp_path):
    # alternatives hold tuples (mesh_shape, axis_names) that JSON turns into lists
    assert free_search.alternatives
    path = tmp_path / "plan.json"
    free_search.save(path)
    assert Plan.load(path).to_dict() == free_search.to_dict()


def test_corrupt_plans_raise_plan_error(megatron, tmp_path):
    *_, plan = megatron
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(autopar.PlanError, match="cannot read plan file"):
        Plan.load(bad)
    with pytest.raises(autopar.PlanError, match="cannot read plan file"):
        Plan.load(tmp_path / "missing.json")
    for key in ("nodes", "params", "collectives", "model_fingerprint"):
        d = plan.to_dict()
        del d[key]
        bad.write_text(json.dumps(d))
        with pytest.raises(autopar.PlanError, match="malformed"):
            Plan.load(bad)
    bad.write_text(json.dumps([1, 2]))
    with pytest.raises(autopar.PlanError):
        Plan.load(bad)


@pytest.mark.parametrize("fmt", [999, None, "1"])
def test_wrong_format_raises_plan_error(megatron, tmp_path, fmt):
    *_, plan = megatron
    d = plan.to_dict()
    d["format"] = fmt
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(d))
    with pytest.raises(autopar.PlanError, match="format"):
        Plan.load(bad)


# ---- configuration and errors ------------------------------------------------------------------

@pytest.mark.parametrize("bad", [dict(tp=0), dict(dp=-1), dict(tp=1.5), dict(unknown_op="x"),
                                 dict(memory_bytes=-1), dict(memory_bytes=0),
                                 dict(solver_time_limit_s=0), dict(optimizer="lamb"),
                                 dict(bucket_bytes=-1), dict(bucket_bytes=2.5),
                                 dict(bucket_bytes=True), dict(zero=4), dict(zero=True)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        autopar.Config(**bad)


@pytest.mark.parametrize("bad", [dict(memory_bytes=float("nan")),
                                 dict(solver_time_limit_s=float("nan"))])
def test_config_rejects_nan(bad):
    # `nan <= 0` is False: a check written as `x <= 0` lets NaN through to the ILP
    with pytest.raises(ValueError, match=next(iter(bad))):
        autopar.Config(**bad)


def test_infinite_memory_budget_is_refused_or_unlimited(small):
    try:
        config = autopar.Config(memory_bytes=float("inf"))
    except ValueError as e:  # refusing it up front is fine, if the message names the field
        assert "memory_bytes" in str(e)
        return
    model, inputs, _ = small
    plan = autopar.plan(model, TWO_A100, inputs, config=config)  # or it means "no limit"
    assert plan.predicted["peak_memory_bytes"] > 0


def test_config_round_trip():
    c = autopar.Config(dp=2, tp=4, memory_bytes=8e9, unknown_op="error", optimizer="sgd")
    assert autopar.Config.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="unknown Config fields"):
        autopar.Config.from_dict(dict(c.to_dict(), tpp=2))


def test_a_budget_error_stays_one_when_the_least_memory_solve_runs_out_of_time():
    """Over budget, the planner solves again for the least-memory plan to report its peak; when
    that solve runs out of time the error is still the budget's (with its bound and why there is
    no more), not the solver's timeout (found planning a 32-layer Llama at 131K tokens)."""
    from autopar.planning.solve import _within_budget
    from autopar.solver.ilp import InfeasibleMemoryError
    from autopar.solver.mip import SolverTimeoutError

    def solve(budget):
        if budget == 100.0:
            raise InfeasibleMemoryError("no sharding plan fits", required_bytes=500.0,
                                        budget_bytes=budget)
        raise SolverTimeoutError("HiGHS found no feasible sharding within the time limit")

    with pytest.raises(autopar.InfeasibleMemoryError) as err:
        _within_budget(solve, 100.0)
    assert err.value.required_bytes == 500.0 and err.value.budget_bytes == 100.0
    assert "no sharding plan fits" in str(err.value) and "time limit" in str(err.value)
    assert isinstance(err.value.__cause__, SolverTimeoutError)


def test_impossible_memory_budget(small):
    model, inputs, _ = small
    with pytest.raises(autopar.InfeasibleMemoryError) as err:
        autopar.plan(model, TWO_A100, inputs, config=autopar.Config(memory_bytes=1000))
    assert err.value.required_bytes > 1000
    assert err.value.budget_bytes == 1000
    assert isinstance(err.value, autopar.PlanError)
    msg = str(err.value)
    assert "Config.memory_bytes" in msg and "more devices" in msg  # says how to fix it
    # the reported requirement is enough: a budget of required_bytes plans
    ok = autopar.plan(model, TWO_A100, inputs,
                      config=autopar.Config(memory_bytes=err.value.required_bytes * 1.01))
    # 1% headroom for the solver's float tolerance on the memory constraint
    assert ok.predicted["peak_memory_bytes"] <= err.value.required_bytes * 1.01


def test_degrees_that_do_not_fit_the_mesh():
    model, inputs = build("mlp")
    with pytest.raises(autopar.PlanError, match="dp \\* tp"):
        autopar.plan(model, TWO_A100, inputs, config=autopar.Config(tp=3))
    with pytest.raises(autopar.PlanError, match="dp \\* tp"):
        autopar.plan(model, TWO_A100, inputs, config=autopar.Config(dp=2, tp=2))
    with pytest.raises(autopar.PlanError, match="repeated blocks"):  # an MLP has no layers to cut
        autopar.plan(model, TWO_A100, inputs, config=autopar.Config(pp=2))


def test_unknown_op_warns_or_errors():
    model, inputs = build("mlp")  # F.mse_loss has no DTensor rule
    plan = autopar.plan(model, TWO_A100, inputs, config=autopar.Config(tp=2))
    assert any("mse_loss" in w and "replicated" in w for w in plan.warnings)
    with pytest.raises(autopar.UnsupportedOpError) as err:
        autopar.plan(model, TWO_A100, inputs, config=autopar.Config(tp=2, unknown_op="error"))
    msg = str(err.value)
    assert "aten.mse_loss" in msg  # names the op
    assert "register_op_rule" in msg and "unknown_op='replicate'" in msg  # and the fixes


# ---- search ------------------------------------------------------------------------------------

def test_free_search_reports_alternatives(free_search):
    plan = free_search
    # the next setups of the search, best first, none predicted faster than the chosen one
    assert 1 <= len(plan.alternatives) <= 5
    times = [a["step_time_s"] for a in plan.alternatives]
    assert times == sorted(times)
    assert plan.predicted["search_step_time_s"] <= times[0]
    assert plan.solver["setup"] not in {a["setup"] for a in plan.alternatives}
    # the three (dp, tp) factorisations of 4 devices are each ranked: chosen or an alternative
    seen = {(plan.solver["setup"].split()[0], plan.solver["setup"].split()[1])}
    seen |= {tuple(a["setup"].split()[:2]) for a in plan.alternatives
             if a["degrees"]["pp"] == 1}
    assert seen >= {("dp=4", "tp=1"), ("dp=2", "tp=2"), ("dp=1", "tp=4")}


def test_fake_model_plans_like_the_real_one(small):
    """A model built under FakeTensorMode (no weights allocated) gets the same plan."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    from models import GPT

    _, inputs, real = small
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_model = GPT(seq=16)  # the same architecture as build("gpt")
    assert all(isinstance(p, FakeTensor) for p in fake_model.parameters())
    fake = autopar.plan(fake_model, TWO_A100, inputs, config=autopar.Config(tp=2))
    assert fake.model_fingerprint == real.model_fingerprint
    assert fake.digest() == real.digest()


def test_planning_is_deterministic(megatron):
    model, inputs, mesh, plan = megatron
    again = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2))
    assert again.digest() == plan.digest()
    assert again.params == plan.params and again.collectives == plan.collectives


def test_alternatives_name_their_logical_mesh(free_search):
    # a setup's logical mesh is what its plan runs on: pp outermost, then dp and tp where > 1;
    # setups with the same (dp, tp, pp) share a mesh, different ones never do
    plan = free_search
    meshes = {tuple(a["setup"].split()[:3]): (tuple(a["mesh_shape"]), tuple(a["axis_names"]))
              for a in plan.alternatives}
    meshes[tuple(plan.solver["setup"].split()[:3])] = (tuple(plan.mesh_shape), tuple(plan.axis_names))
    assert len(set(meshes.values())) == len(meshes)
    for shape, names in meshes.values():
        assert len(shape) == len(names) and int(torch.tensor(shape).prod()) == 4


def test_prediction_is_a_typed_record_read_and_saved_as_the_dict_it_replaces(megatron, tmp_path):
    import dataclasses

    from autopar.plan import Prediction

    *_, plan = megatron
    p = plan.predicted
    assert isinstance(p, Prediction)
    # typed fields, and the mapping of the set ones (what plans saved before hold)
    assert p.step_time_s == p["step_time_s"] > 0 and p.get("bubble_fraction") is None
    assert "step_time_s" in p and "bubble_fraction" not in p
    saved = json.loads(plan.to_json())["predicted"]
    assert set(saved) == set(p) and None not in saved.values()
    assert {"step_time_s", "compute_s", "comm_s", "peak_memory_bytes", "optimizer_s"} <= set(saved)
    # a key no field holds is an error where code makes a prediction...
    with pytest.raises(autopar.PlanError, match="no field"):
        dataclasses.replace(plan, predicted={**p, "step_tiem_s": 1.0})
    # ...and kept, shown and saved again, where a file from an older autopar has it
    d = plan.to_dict()
    d["predicted"]["tp_comm_s"] = 0.25
    old = Plan.from_dict(d)
    assert old.predicted["tp_comm_s"] == 0.25 and old.predicted.step_time_s == p.step_time_s
    old.save(tmp_path / "old.json")
    assert Plan.load(tmp_path / "old.json") == old
