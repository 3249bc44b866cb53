"""Expert parallelism over the context-parallel ranks (``Config.ep_in_cp``): the ep ranks taken
from cp instead of cut from dp (Megatron-LM's MoE parallel folding), as candidates, as setups of
the search, priced in closed form, and planned. The multi-process runs (equal to one process,
the all-to-alls counted): tests/distributed/test_equivalence.py and test_slow.py."""

from __future__ import annotations

import dataclasses

import pytest

import autopar
from autopar import Config
from autopar.cost_models.comm import axis_collective_time
from autopar.cost_models.experts import ExpertsWork
from autopar.cost_models.step_price import price_setup
from autopar.cost_models.topology import get_preset
from autopar.cost_models.training_step import LayerCosts, Setup, UnitCosts
from autopar.planning.candidates import mesh_candidates
from autopar.planning.setups import candidate_setups
from models import build


def _names(cands):
    return [(c.names, c.shape, c.cp_axes, c.ep_axes) for c in cands]


def test_candidates_take_the_ep_ranks_from_cp_or_dp():
    # dp=2 x cp=2: ep=2 cut from dp (its own axis), or the cp axis itself
    free = _names(mesh_candidates(4, Config(tp=1, cp=2), experts=4))
    assert free == [(("dp", "cp"), (2, 2), (1,), ()), (("ep", "cp"), (2, 2), (1,), (0,)),
                    (("dp", "cp"), (2, 2), (1,), (1,))]
    assert _names(mesh_candidates(4, Config(tp=1, cp=2, ep=2, ep_in_cp=True), experts=4)) == [
        (("dp", "cp"), (2, 2), (1,), (1,))]
    assert _names(mesh_candidates(4, Config(tp=1, cp=2, ep=2, ep_in_cp=False), experts=4)) == [
        (("ep", "cp"), (2, 2), (1,), (0,))]
    # cp of 2 ranks, no dp: only from cp; with 6 experts over cp=4: not at all
    assert _names(mesh_candidates(2, Config(cp=2, ep=2), experts=4)) == [
        (("cp",), (2,), (0,), (0,))]
    assert all(not c.ep_axes for c in mesh_candidates(4, Config(cp=4), experts=6))
    assert all(not c.ep_axes for c in mesh_candidates(4, Config(cp=2)))  # (no experts)


def test_config_ep_in_cp_checks():
    with pytest.raises(ValueError, match="ep = cp > 1"):
        Config(cp=2, ep=4, ep_in_cp=True)
    with pytest.raises(ValueError, match="ep = cp > 1"):
        Config(cp=1, ep_in_cp=True)
    with pytest.raises(ValueError, match="use True"):
        Config(ep_in_cp=1)
    Config(dp=1, cp=2, ep=2)  # (ep need not divide dp where it can come from cp)
    with pytest.raises(ValueError, match="ep must divide dp"):
        Config(dp=1, cp=2, ep=2, ep_in_cp=False)


def test_the_search_enumerates_both_folds():
    setups = list(candidate_setups(4, 4, 8, 2, Config(tp=1, pp=1, cp=2), seq=64, experts=4))
    assert {(s.ep, s.ep_in_cp) for s in setups} == {(1, False), (2, False), (2, True)}
    only = list(candidate_setups(4, 4, 8, 2, Config(tp=1, pp=1, cp=2, ep_in_cp=True), seq=64,
                                 experts=4))
    assert {(s.ep, s.ep_in_cp) for s in only} == {(1, False), (2, True)}
    assert "ep=2 (cp)" in next(s for s in only if s.ep_in_cp).describe()


def _layer_costs() -> tuple[LayerCosts, tuple, tuple]:
    """4 blocks of 1e8 parameter elements a rank, 8e7 of them experts (16 B of state each),
    with 3 all-to-alls forward and 3 backward per block and microbatch."""
    fwd, bwd = (8.0, 4e6, 4e6), (8.0, 8e6, 4e6)
    block = UnitCosts(1e-3, 2e-3, 0, 0, 1.6e9, 1e8, 1e8, expert_elements=8e7,
                      expert_state_bytes=1.28e9, expert_forward_bytes=fwd,
                      expert_backward_bytes=bwd, expert_forward_work=ExpertsWork(1e9, 8e6, 3.2e8))
    zero = UnitCosts(0, 0, 0, 0, 0, 0, 0)
    return LayerCosts(zero, block, zero, 4, 0, 0, 0, 1e7, 4, "adam"), fwd, bwd


def test_ep_over_cp_is_priced_on_cp_links_and_reduces_the_experts_over_dp_only():
    """dp=2 x cp=2 x tp=4 on 2 nodes of 8 H100s (tp inside cp: rank = 8 dp + 4 cp + tp). ep=2
    from cp exchanges its tokens at stride 4 (inside a node); cut from dp, at stride 8 (across
    the nodes), so the first's pipeline is shorter by exactly the all-to-alls' difference. At
    the step's end, the experts' gradients (4 x 8e7 / 2 elements, 4 B each) are all-reduced
    over the 2 dp ranks (stride 8) and not over cp, where they are split; the dense ones
    (4 x 2e7) over dp and over cp (stride 4)."""
    topo = get_preset("h100-dgx")
    lc, fwd, bwd = _layer_costs()
    base = Setup(2, 4, 1, 1, 1, "none", 1, "none", 0, False, cp=2)
    in_cp = price_setup(lc, dataclasses.replace(base, ep=2, ep_in_cp=True), topo, 80e9)
    in_dp = price_setup(lc, dataclasses.replace(base, ep=2), topo, 80e9)
    a2a = lambda stride: sum(axis_collective_time("all_to_all", x, 2, stride, topo)  # noqa: E731
                             for x in fwd + bwd)
    assert a2a(8) > a2a(4)  # (across the nodes)
    assert in_dp.parts["pipeline_s"] - in_cp.parts["pipeline_s"] == pytest.approx(
        4 * (a2a(8) - a2a(4)))
    ar = lambda elements, n, stride: axis_collective_time(  # noqa: E731
        "all_reduce", elements * 4, n, stride, topo)
    dense, experts = 4 * 2e7, 4 * 8e7 / 2
    assert in_cp.parts["dp_comm_s"] == pytest.approx(
        ar(dense, 2, 8) + ar(dense, 2, 4) + ar(experts, 2, 8))
    # cut from dp, the experts' replicas are the cp ranks only (dp / ep = 1)
    assert in_dp.parts["dp_comm_s"] == pytest.approx(
        ar(dense, 2, 8) + ar(dense, 2, 4) + ar(experts, 2, 4))
    # both hold half of the experts' state
    assert in_cp.rank_memory_bytes == pytest.approx(in_dp.rank_memory_bytes)


def test_a_plan_splits_the_experts_over_the_cp_axis():
    """Mixtral on 2 virtual devices, cp=2, ep=2: the experts' weights are stored split over
    the cp axis (no ep axis of their own), the other weights whole, the tokens of each rank's
    sequence chunk dispatched over cp; the plan lists the all-to-alls and says ep=2."""
    model, inputs = build("mixtral")
    plan = autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", 1, 2), inputs,
                        config=Config(cp=2, ep=2, zero=0))
    assert plan.axis_names == ("cp",) and plan.degrees["ep"] == 2 and plan.degrees["cp"] == 2
    experts = {k: v for k, v in plan.params.items() if ".experts." in k}
    assert len(experts) == 4 and set(experts.values()) == {("S(0)",)}
    assert all(v == ("R",) for k, v in plan.params.items() if k not in experts)
    assert sum(c.kind == "all_to_all" for c in plan.collectives) == 12  # 2 layers x 6
    with pytest.raises(autopar.PlanError, match="ep=2"):
        autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", 1, 2), inputs,
                     config=Config(cp=2, ep=2, ep_in_cp=False))


def test_ep_in_cp_is_moot_where_the_search_finds_no_cp():
    """``Config(ep_in_cp=True)`` with cp left to the planner, on a sequence too short for cp:
    the plan has no cp (so ep from cp cannot hold, and ep stays 1) and says so in a note,
    rather than failing on the realized setup's Config (cp=1 with ep_in_cp, refused alone)."""
    model, inputs = build("mixtral")
    plan = autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", 1, 2), inputs,
                        config=Config(ep_in_cp=True))
    assert plan.degrees["cp"] == 1 and plan.degrees["ep"] == 1
    assert any("ep_in_cp=True changes nothing" in w for w in plan.warnings), plan.warnings


def test_ep_options_is_the_one_list_of_folds():
    from autopar.planning.candidates import ep_options

    assert ep_options(Config(), 4, 2, 4) == [(1, False), (2, False), (4, False), (2, True)]
    assert ep_options(Config(ep=2), 4, 2, 4) == [(2, False), (2, True)]
    assert ep_options(Config(ep=2, ep_in_cp=False), 4, 2, 4) == [(2, False)]
    assert ep_options(Config(ep_in_cp=True), 4, 2, 4) == [(1, False), (2, True)]
    assert ep_options(Config(), 4, 2, 4, hybrid=True) == [(1, False)]
    # dp_shard set (even to all of dp): no ep, as Config(ep > 1, dp_shard=...) is refused; the
    # search chose ep > 1 beside it, and the plan could not hold the Config's dp_shard
    assert ep_options(Config(zero=1, dp_shard=4), 4, 1, 4) == [(1, False)]
    assert ep_options(Config(), 4, 1, 0) == [(1, False)]  # (no experts, no cp)
