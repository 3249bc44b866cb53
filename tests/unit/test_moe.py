"""The experts of transformers' MoE families as one op (autopar.capture.moe), the expert-parallel
pieces that need no processes: which rank holds which expert, what the op's all-to-alls move and
cost, the ep candidates of the planner, the config's checks. The multi-process runs (ep=2, 4,
ep x tp, pp x ep): tests/distributed/test_equivalence.py and test_slow.py."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from autopar import Config, Mesh
from autopar._torch_private import older_than
from autopar.capture import capture
from autopar.capture.moe import ACTIVATIONS, experts, experts_block_form, experts_forward
from autopar.cost_models.experts import experts_exchanges, experts_flops
from autopar.planning.candidates import mesh_candidates
from autopar.strategies.rules import expert_owners
from models import build, hf_moe

FAMILIES = ["mixtral", "qwen2moe", "qwen3moe", "granitemoe", "olmoe", "phimoe", "deepseekv3"]
FORWARD = torch.ops.autopar.experts.default
BACKWARD = torch.ops.autopar.experts_backward.default


def _block(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    model = hf_moe(kind)
    return next(m for m in model.modules() if experts_block_form(m) is not None)


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_op_computes_what_the_experts_module_does(kind):
    """Output and every gradient (tokens, routing weights, both expert weights) against the
    module's own grouped forward, on a routing where some experts get no token. Tolerance: fp32
    sums in another order (per expert, then per token), 1e-6 relative."""
    m = _block(kind)
    g = torch.Generator().manual_seed(1)
    d = m.down_proj.shape[2] if m.is_transposed else m.down_proj.shape[1]
    tokens, k = 9, 2
    hidden = torch.randn(tokens, d, generator=g, requires_grad=True)
    index = torch.randint(0, m.num_experts - 1, (tokens, k), generator=g)  # last expert unused
    weights = torch.rand(tokens, k, generator=g, requires_grad=True)
    own = m(hidden, index, weights)
    grad = torch.randn(own.shape, generator=g)
    want = torch.autograd.grad(own, [hidden, weights, *m.parameters()], grad)
    out = experts_forward(m, hidden, index, weights)
    got = torch.autograd.grad(out, [hidden, weights, *m.parameters()], grad)
    torch.testing.assert_close(out, own, rtol=1e-6, atol=1e-7)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_rank_holding_some_experts_adds_only_theirs():
    """``owner`` with -1 (experts another rank holds): the output is the share of the rank's
    experts, and the shares of two ranks add up to the whole."""
    m = _block("mixtral")
    g = torch.Generator().manual_seed(2)
    hidden, index = torch.randn(6, 64, generator=g), torch.randint(0, 4, (6, 2), generator=g)
    weights = torch.rand(6, 2, generator=g)
    form = experts_block_form(m)
    whole = experts(hidden, index, weights, m.gate_up_proj, m.down_proj, form, [0] * 4, "")
    first = experts(hidden, index, weights, m.gate_up_proj[:2], m.down_proj[:2], form,
                    [0, 0, -1, -1], "")
    second = experts(hidden, index, weights, m.gate_up_proj[2:], m.down_proj[2:], form,
                     [-1, -1, 0, 0], "")
    torch.testing.assert_close(first + second, whole, rtol=1e-6, atol=1e-7)
    assert not torch.equal(first, whole)


def test_expert_owners_follow_dtensor_order():
    """8 experts split over a (2, 2) mesh on both axes: rank (i, j) holds experts 4i+2j, +1
    (the first axis splits first). Dispatching over axis 0 from rank (1, 0): ranks 0 and 1 of
    that axis hold experts 0-1 and 4-5; the rest belong to other ranks of axis 1."""
    s = (Shard(0), Shard(0))
    assert expert_owners(8, s, (2, 2), (1, 0), 0) == [0, 0, -1, -1, 1, 1, -1, -1]
    assert expert_owners(8, s, (2, 2), (1, 1), None) == [-1] * 6 + [0, 0]
    assert expert_owners(8, (Shard(0), Replicate()), (2, 2), (0, 1), 0) == [0] * 4 + [1] * 4
    with pytest.raises(ValueError, match="evenly"):
        expert_owners(6, (Shard(0), Shard(0)), (2, 2), (0, 0), 0)


def test_the_all_to_alls_and_flops_of_each_split():
    """Forward on 16 tokens x 2 choices, hidden 64, 4 experts [4, 256, 64] and [4, 64, 128],
    mesh of 2: dispatching sends every pair (32 rows of 64 fp32) out and, uniform routing, as
    many back, after the 2 x 2 int64 counts; the backward sends 2d+1 wide and d+1 back. Each
    rank's experts then compute as many rows as data parallelism would (32); the split with
    the tokens whole computes half of the 64 rows."""
    shapes = [(16, 64), (16, 2), (16, 2), (4, 256, 64), (4, 64, 128)]
    S, R = (Shard(0),), (Replicate(),)
    dispatch = [S, S, S, S, S]
    assert experts_exchanges(FORWARD, dispatch, shapes, 4, (2,)) == [
        ("all_to_all", 0, 2 * 2 * 8), ("all_to_all", 0, 8 * 2 * 64 * 4),
        ("all_to_all", 0, 8 * 2 * 64 * 4)]
    back = experts_exchanges(BACKWARD, [S] + dispatch, [(16, 64)] + shapes, 4, (2,))
    assert [b for _, _, b in back] == [32, 8 * 2 * 129 * 4, 8 * 2 * 65 * 4]
    assert experts_exchanges(FORWARD, [S, S, S, R, R], shapes, 4, (2,)) == []
    per_row = 2 * 256 * 64 + 2 * 64 * 128
    local = lambda *s: [torch.empty(x, device="meta") for x in s]  # noqa: E731
    data = experts_flops(*local((8, 64), (8, 2), (8, 2), (4, 256, 64), (4, 64, 128)), "", [0] * 4)
    ep = experts_flops(*local((8, 64), (8, 2), (8, 2), (2, 256, 64), (2, 64, 128)), "",
                       [0, 0, 1, 1])
    sliced = experts_flops(*local((16, 64), (16, 2), (16, 2), (2, 256, 64), (2, 64, 128)), "",
                           [0, 0, -1, -1])
    assert data == ep == 16 * per_row and sliced == 16 * per_row
    assert experts_flops(*local((8, 64), (8, 2), (8, 2), (2, 256, 64), (2, 64, 128)), "",
                         [0, 0, 1, 1], grad=True) == 3 * ep


def test_moe_models_capture_their_experts_as_one_op_each():
    model, inputs = build("mixtral")
    traced = capture(model, inputs)
    targets = [n.target for n in traced.gm.graph.nodes]
    assert targets.count(FORWARD) == targets.count(BACKWARD) == 2  # two MoE layers


def test_ep_candidates_cut_the_data_axis():
    names = lambda cands: [(c.names, c.shape, c.ep_axes) for c in cands]  # noqa: E731
    assert names(mesh_candidates(4, Config(tp=1, ep=2), 4)) == [(("dp", "ep"), (2, 2), (1,))]
    assert names(mesh_candidates(2, Config(tp=1, ep=2), 4)) == [(("ep",), (2,), (0,))]
    assert names(mesh_candidates(4, Config(tp=1), experts=6)) == [  # (6 experts: ep=2 only)
        (("dp",), (4,), ()), (("dp", "ep"), (2, 2), (1,))]
    free = names(mesh_candidates(4, Config(tp=1), experts=4))
    assert free == [(("dp",), (4,), ()), (("dp", "ep"), (2, 2), (1,)), (("ep",), (4,), (0,))]
    assert names(mesh_candidates(4, Config(tp=1))) == [(("dp",), (4,), ())]


def test_config_ep_must_fit_dp():
    with pytest.raises(ValueError, match="ep must divide dp"):
        Config(dp=4, ep=3)
    with pytest.raises(ValueError, match="hybrid sharding"):
        Config(ep=2, dp_shard=2, zero=3)
    with pytest.raises(ValueError, match="positive int"):
        Config(ep=0)


def test_the_setup_search_prices_ep_in_closed_form():
    """A block of 1e8 parameter elements, 8e7 of them experts (16 B of state each, fp32 Adam),
    on 8 H100s of one node, dp=8: ep=4 holds a quarter of the experts' state (6e7 elements x
    16 B less), reads a quarter of their weights, and adds its all-to-alls (NVLink, 3 forward
    and 3 backward per block and microbatch) to the step; the experts' gradients are reduced
    over dp / ep = 2 ranks."""
    import dataclasses

    from autopar.cost_models.comm import axis_collective_time
    from autopar.cost_models.topology import get_preset
    from autopar.cost_models.step_price import price_setup
    from autopar.cost_models.training_step import LayerCosts, Setup, UnitCosts

    from autopar.cost_models.experts import ExpertsWork

    topo = get_preset("h100-dgx")
    fwd, bwd = (8.0, 4e6, 4e6), (8.0, 8e6, 4e6)
    # the experts' forward: 1 GFLOP, 8 MB of tokens, 320 MB of weights (memory-bound at ep=1)
    work = ExpertsWork(1e9, 8e6, 3.2e8)
    block = UnitCosts(1e-3, 2e-3, 0, 0, 1.6e9, 1e8, 1e8, expert_elements=8e7,
                      expert_state_bytes=1.28e9, expert_forward_bytes=fwd,
                      expert_backward_bytes=bwd, expert_forward_work=work)
    zero = UnitCosts(0, 0, 0, 0, 0, 0, 0)
    lc = LayerCosts(zero, block, zero, 4, 0, 0, 0, 1e7, 4, "adam")
    plain = Setup(8, 1, 1, 1, 1, "none", 1, "none", 0, False)
    a = price_setup(lc, plain, topo, 80e9)
    b = price_setup(lc, dataclasses.replace(plain, ep=4), topo, 80e9)
    # a quarter of the experts' state, and of their gradients, which the backward has made at
    # its end (4 bytes each, more then than the saved values it has freed: 4e8 bytes)
    assert a.rank_memory_bytes[0] - b.rank_memory_bytes[0] == pytest.approx(
        4 * 1.28e9 * 3 / 4 + 4 * 8e7 * 3 / 4 * 4)
    a2a = sum(axis_collective_time("all_to_all", x, 4, 1, topo) for x in fwd + bwd)
    weights = work.seconds(topo, 1 / 4) - work.seconds(topo)  # (a quarter of them read)
    assert weights < 0
    assert b.parts["pipeline_s"] - a.parts["pipeline_s"] == pytest.approx(4 * (a2a + weights))
    assert b.parts["dp_comm_s"] < a.parts["dp_comm_s"]  # (the experts' a quarter, over 2)
    assert "ep=4" in b.setup.describe()


def test_ep_degrees_searched():
    from autopar.planning.candidates import ep_degrees

    assert ep_degrees(Config(), 8, 8) == [1, 2, 4, 8]
    assert ep_degrees(Config(), 8, 6) == [1, 2]  # (6 experts split evenly by 2 only)
    assert ep_degrees(Config(), 8, 0) == [1]  # (no MoE layers)
    assert ep_degrees(Config(ep=4), 8, 8) == [4] and ep_degrees(Config(ep=4), 2, 8) == []


def test_ep_on_a_model_without_experts_is_refused():
    import autopar
    from autopar.errors import PlanError

    model, inputs = build("llama")
    with pytest.raises(PlanError, match="splits the experts"):
        autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", 1, 2), inputs,
                     config=Config(ep=2))


def test_a_forced_ep_is_searched_without_hybrid_sharding():
    """Hybrid sharding and ep both cut dp: with ep forced, the search offers no hybrid setup
    (one would reach the realization with ep=1 against the config)."""
    from autopar.planning.setups import candidate_setups

    setups = list(candidate_setups(4, 4, 8, 2, Config(tp=1, pp=1, ep=4), experts=4))
    assert setups and all(s.ep == 4 and s.dp_shard == 0 for s in setups)
    free = list(candidate_setups(4, 4, 8, 2, Config(tp=1, pp=1), experts=4))
    assert {s.ep for s in free} == {1, 2, 4} and all(s.ep == 1 for s in free if s.dp_shard)


def test_an_ep_plan_stores_each_rank_its_own_experts():
    """Mixtral on 2 virtual devices, ep=2: the experts' weights are stored split on their
    experts dim over the ep axis (each rank updates its own), the other weights replicated;
    the experts dispatch over it, and the plan lists their all-to-alls."""
    import autopar

    model, inputs = build("mixtral")
    plan = autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", 1, 2), inputs,
                        config=Config(ep=2, zero=0))
    assert plan.degrees["ep"] == 2 and plan.axis_names == ("ep",)
    experts = {k: v for k, v in plan.params.items() if ".experts." in k}
    assert len(experts) == 4 and set(experts.values()) == {("S(0)",)}
    assert all(v == ("R",) for k, v in plan.params.items() if k not in experts)
    assert sum(c.kind == "all_to_all" for c in plan.collectives) == 12  # 2 layers x 6


def test_leading_dense_blocks_are_searched_with_pre():
    """DeepSeek-V3 with its first layer dense and three MoE layers: one leading block, the
    two-block copy the search traces keeps it and two MoE blocks (3 repeated counted)."""
    from autopar.capture.layers import leading_blocks
    from autopar.planning.search import two_block_copy

    model, _ = build("deepseekv3", layers=4)
    assert leading_blocks(model) == 1
    copy, prefix, repeated, runs = two_block_copy(model)
    assert (repeated, runs) == (3, (1,)) and len(copy.get_submodule(prefix)) == 3
    assert leading_blocks(build("mixtral")[0]) == 0
    assert leading_blocks(build("deepseekv3", layers=2)[0]) == -1  # (one MoE block: no pair)


def test_a_run_of_identical_leading_blocks_is_traced_once():
    """DeepSeek-V3 with three dense first layers: the search's copy holds one of them (and two
    MoE blocks) and counts it three times; its per-unit costs and FLOPs equal those of the
    model traced with all three (5 layers: the whole model). Within 1% for the costs, not
    exactly: the blocks after the first read their input from a block, not from the embedding,
    which the ILP may place differently; FLOPs do not depend on placements. (Before, the
    backward of the keys' preallocated writes had no module and was counted in ``pre`` once,
    not in each block: capture.layers.layer_units.)"""
    from autopar.capture.stages import capture_with_forward
    from autopar.cost_models.compute import graph_flops
    from autopar.planning.candidates import Candidate
    from autopar.planning.search import LayerSolver, model_flops
    from autopar.planning.solve import solve_space
    from autopar.planning.unit_costs import layer_costs

    model, inputs = build("deepseekv3", layers=5, dense=3)
    mesh = Mesh.virtual("h100-dgx", gpus_per_node=2)
    layers = LayerSolver(model, inputs, mesh, Config(), ())
    assert (layers.lead_runs, layers.lead, layers.num_blocks) == ((3,), 3, 2)
    assert len(layers.model.get_submodule(layers.prefix)) == 3
    got = layers.costs(2, 4, False)
    traced, fwd = capture_with_forward(model, inputs)  # (all 5 blocks: 3 leading, 2 repeated)
    cand = Candidate((2,), ("tp",), ())
    space, costs, res = solve_space(traced, mesh, layers.config, cand, (), None,
                                    sequence_parallel=False)
    want = layer_costs(traced, fwd, space, costs, res.choice, 2, "adam", 1, (1, 1, 1))
    assert (got.lead_blocks, want.lead_blocks) == (3, 3)
    for name in ("forward_s", "backward_s", "state_bytes", "activation_bytes", "param_elements",
                 "attention_forward_s"):
        assert getattr(got.pre, name) == pytest.approx(getattr(want.pre, name), rel=0.01), name
    assert got.lead_forward_s == pytest.approx(want.lead_forward_s, rel=0.01)
    assert got.lead_activation_bytes == pytest.approx(want.lead_activation_bytes, rel=0.01)
    assert model_flops(layers, 4) == pytest.approx(graph_flops(traced.gm), rel=1e-9)


def test_the_load_skew_prices_the_busiest_rank_where_experts_are_split():
    """``Config.expert_load_skew`` (the busiest rank's rows over the mean): the experts op
    split over ranks computes and sends that much more on its busiest rank; the same op with
    its experts whole on every rank has no skew (each rank runs its own tokens); the closed
    form's ep setups pay it too, the ep=1 setup not."""
    import dataclasses

    from autopar.cost_models.experts import ExpertsWork, experts_comm_time
    from autopar.cost_models.topology import get_preset
    from autopar.cost_models.step_price import price_setup
    from autopar.cost_models.training_step import LayerCosts, Setup, UnitCosts

    topo = get_preset("h100-dgx")
    work = ExpertsWork(1e12, 8e6, 3.2e8)
    assert work.skewed(1.5).flops == 1.5e12 and work.skewed(1.5).skewed(1.0).flops == 1e12
    assert work.skewed(1.5).weight_bytes == work.weight_bytes
    shapes = [(16, 64), (16, 2), (16, 2), (4, 256, 64), (4, 64, 128)]
    S = (Shard(0),)
    even = experts_comm_time(FORWARD, [S] * 5, shapes, 4, (2,), topo)
    assert experts_comm_time(FORWARD, [S] * 5, shapes, 4, (2,), topo, skew=1.5) > even
    block = UnitCosts(1e-2, 2e-2, 0, 0, 1.6e9, 1e8, 1e8, expert_elements=8e7,
                      expert_state_bytes=1.28e9, expert_forward_bytes=(8.0, 4e6, 4e6),
                      expert_backward_bytes=(8.0, 8e6, 4e6), expert_forward_work=work)
    zero = UnitCosts(0, 0, 0, 0, 0, 0, 0)
    lc = LayerCosts(zero, block, zero, 4, 0, 0, 0, 1e7, 4, "adam")
    skewed = dataclasses.replace(lc, expert_load_skew=1.5)
    plain = Setup(8, 1, 1, 1, 1, "none", 1, "none", 0, False)
    ep = dataclasses.replace(plain, ep=4)
    assert price_setup(skewed, plain, topo, 80e9).step_time_s == \
        price_setup(lc, plain, topo, 80e9).step_time_s
    assert price_setup(skewed, ep, topo, 80e9).step_time_s > price_setup(lc, ep, topo, 80e9).step_time_s
    with pytest.raises(ValueError, match="expert_load_skew"):
        Config(expert_load_skew=0.5)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_each_activation_derivative_matches_autograd(name):
    """The op's backward writes its activations' derivatives out (autograd does not run inside
    a custom op): each against autograd of the function, fp64, away from ReLU's kink."""
    fn, grad = ACTIVATIONS[name]
    x = torch.linspace(-4, 4, 101, dtype=torch.float64).add(1e-3).requires_grad_()
    (want,) = torch.autograd.grad(fn(x).sum(), x)
    torch.testing.assert_close(grad(x.detach()), want, rtol=1e-10, atol=1e-12)


def test_the_op_without_a_gate_and_with_transposed_weights():
    """The forms no family above has: experts without a gate (``up_proj``, one activation)
    and weights stored transposed ``[experts, in, out]``; output and gradients against the
    experts written out per token, fp64 (so that only the maths can differ)."""
    import json

    g = torch.Generator().manual_seed(3)
    tokens, k, d, ffn, n = 7, 2, 6, 5, 3
    hidden = torch.randn(tokens, d, dtype=torch.float64, generator=g, requires_grad=True)
    index = torch.randint(0, n, (tokens, k), generator=g)
    weights = torch.rand(tokens, k, dtype=torch.float64, generator=g, requires_grad=True)
    w_in = torch.randn(n, d, ffn, dtype=torch.float64, generator=g, requires_grad=True)
    w_out = torch.randn(n, ffn, d, dtype=torch.float64, generator=g, requires_grad=True)
    form = json.dumps({"gate": False, "transposed": True, "act": "GELUActivation"})
    out = experts(hidden, index, weights, w_in, w_out, form, [0] * n, "")
    want = torch.stack([sum(weights[t, j] * (torch.nn.functional.gelu(hidden[t] @ w_in[index[t, j]])
                                             @ w_out[index[t, j]]) for j in range(k))
                        for t in range(tokens)])
    torch.testing.assert_close(out, want)
    args = (hidden, weights, w_in, w_out)
    for a, b in zip(torch.autograd.grad(out.sum(), args), torch.autograd.grad(want.sum(), args)):
        torch.testing.assert_close(a, b)


def test_full_recomputation_does_not_run_the_experts_again():
    """The experts' backward op takes their inputs, not their output: full recomputation
    picks the rest of a MoE block, not the experts op, and the closed form re-runs the block's
    forward without the experts' seconds."""
    from autopar.capture.remat import recompute_nodes
    from autopar.cost_models.topology import get_preset
    from autopar.cost_models.step_price import price_setup
    from autopar.cost_models.training_step import LayerCosts, Setup, UnitCosts

    model, inputs = build("mixtral")
    traced = capture(model, inputs)
    full = {traced.node(n).target for n in recompute_nodes(traced, "full")}
    assert FORWARD not in full and torch.ops.aten.mm.default in full
    block = UnitCosts(3e-3, 6e-3, 0, 0, 1e6, 1e6, 1e5, expert_forward_s=1e-3)
    zero = UnitCosts(0, 0, 0, 0, 0, 0, 0)
    lc = LayerCosts(zero, block, zero, 4, 0, 0, 0, 1e3, 4, "adam")
    plain = Setup(1, 1, 1, 1, 1, "none", 1, "none", 0, False)
    topo = get_preset("h100-dgx")
    again = price_setup(lc, Setup(1, 1, 1, 1, 1, "none", 1, "full", 0, False), topo, 80e9)
    assert again.step_time_s - price_setup(lc, plain, topo, 80e9).step_time_s == \
        pytest.approx(4 * 2e-3)  # (4 blocks, each 3 ms forward less the experts' 1 ms)


def _published_shapes(name: str):
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from moe_plan_scale import build as build_row

    return build_row(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v3"])
def test_published_moe_shapes_take_expert_parallelism_where_it_is_faster(name):
    """Without devices: Mixtral-8x7B on 64 virtual H100s and DeepSeek-V3 (3 dense layers, then
    58 MoE layers of 256 routed experts and a shared one) on 2,048 (benchmarks/moe_plan_scale.py,
    about 30 s and 90 s of search): the search's best setup splits the experts (ep > 1) and is
    predicted faster than the best without; DeepSeek-V3's dense layers are traced once, counted
    three times."""
    from autopar.planning.search import LayerSolver, search

    model, inputs, mesh = _published_shapes(name)
    layers = LayerSolver(model, inputs, mesh, Config(), ())
    result = search(model, inputs, mesh, Config(), layers=layers)
    best = result.best
    without = min((c for c in result.ranked if c.setup.ep == 1), key=lambda c: c.step_time_s)
    assert best.setup.ep > 1 and best.step_time_s < without.step_time_s, (
        best.setup.describe(), without.setup.describe())
    assert best.fits and max(best.rank_memory_bytes) <= mesh.topology.memory_bytes
    if name == "deepseek-v3":
        assert (layers.lead_runs, layers.num_blocks) == ((3,), 58)


@pytest.mark.slow
def test_a_deepseek_v3_stage_on_dp_ep_tp_costs_what_the_search_priced():
    """Five layers of DeepSeek-V3 at their published widths (one dense, four MoE), dp=16 tp=4
    pp=2 ep=8 on 128 virtual H100s (about 100 s): the stage mesh is (dp, ep, tp), its dp axis
    placed alone first (planning.solve._pin_data_axes). That one-axis ILP priced every run the
    gradient reductions a pipeline stage makes once a step, so it split the experts over dp in
    the backward, and the stages all-gathered each layer's whole expert weights over ep for
    every microbatch: 15.1 s per operator against the search's 2.46 s (docs/validation.md).
    The per-operator step must be within 10% of the search's (the two models differ in detail:
    2.36 s against 2.43 s when written) and no collective over ep may move a layer's experts
    (14 GiB all-gathers before)."""
    import autopar
    import transformers as tf
    from autopar.planning.search import LayerSolver, search

    real = tf.DeepseekV3Config

    def five_layers(**kw):
        return real(**{**kw, "num_hidden_layers": 5, "first_k_dense_replace": 1})

    tf.DeepseekV3Config = five_layers
    try:
        model, inputs, _ = _published_shapes("deepseek-v3")
    finally:
        tf.DeepseekV3Config = real
    inputs = {k: v[:256] for k, v in inputs.items()}
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=16, gpus_per_node=8)
    cfg = Config(dp=16, tp=4, pp=2, ep=8, recompute="selective", zero=1, schedule="1f1b",
                 microbatch_size=16, sequence_parallel=False)
    best = search(model, inputs, mesh, cfg, layers=LayerSolver(model, inputs, mesh, cfg, ())).best
    plan = autopar.plan(model, mesh, inputs, config=cfg)
    step = plan.predicted["step_time_s"]
    assert abs(step / best.step_time_s - 1) < 0.10, (step, best.step_time_s)
    expert = 256 * 4096 * 7168 * 2 // 8  # one layer's gate_up_proj, bf16, split over ep
    assert max(c.bytes for c in plan.collectives if c.axis == "ep") < expert


@pytest.mark.parametrize("zero,once", [(0, False), (1, True), (1, False)])
def test_the_experts_weights_are_priced_split_over_ep(zero, once):
    """The memory the ILP prices for an expert weight split over ep: its own experts' share of
    the state, and (ZeRO) a computed copy whole on the other data axes but still split over ep.
    It counted a copy whole over ep too, even without ZeRO: DeepSeek-V3's 26 MoE layers of a
    pipeline stage then needed at least 101 GiB for one weight on (dp, ep, tp) = (16, 16, 4)
    and no plan was found for the search's best setup."""
    import autopar
    from autopar.cost_models.sharding import state_bytes_per_element, zero_once_placement
    from autopar.planning.candidates import Candidate
    from autopar.planning.solve import priced_space
    from autopar.strategies.reshard import local_shape

    model, inputs = build("mixtral", experts=4)
    traced = capture(model, inputs)
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=1, gpus_per_node=4)
    cand = Candidate((2, 2), ("dp", "ep"), (0, 1), ep_axes=(1,))
    space, costs = priced_space(traced, mesh, Config(zero=zero), cand, (), zero_once=once)
    p = next(p for p in traced.params if p.name.endswith("experts.gate_up_proj"))
    shape = tuple(traced.node(p.node).meta["val"].shape)
    per = state_bytes_per_element("adam", 4)
    checked = 0
    for s, got in zip(space.nodes[p.node].strategies, costs.memory[p.node]):
        placed = s.outputs[0]
        assert placed[1] == Shard(0)  # stored split over ep
        stored = zero_once_placement(placed, shape, (2, 2), (0, 1)) if once else placed
        want = math.prod(local_shape(shape, stored, (2, 2))) * per
        computed = (Replicate(), Shard(0)) if zero else stored  # (whole over dp only)
        if computed != stored:
            want += math.prod(local_shape(shape, computed, (2, 2))) * 4
        assert got == want, (placed, got, want)
        checked += 1
    assert checked


@pytest.mark.parametrize("zero", [1, 3])
def test_zero_in_a_pipeline_stage_on_dp_and_ep_stores_each_weight_over_one_axis(zero):
    """A pipeline stage with ZeRO on a (dp, ep) stage mesh gathers its parameters and
    reduce-scatters their gradients over one mesh axis per collective
    (``sharding.step_end_buckets``). ZeRO stored a weight the stage replicates (the router,
    the embedding) sharded over both data axes, and planning stopped with "internal:
    parameter ... stored ('S(1)', 'S(0)') ... Please report this". A dense weight is now
    stored over ep (the inner axis, hybrid sharding's shard group), an expert weight, split
    over ep by the program, over dp; the plan's gathers are one bucket per axis, and
    ``techniques["dp_shard"]`` says the dense weights' shard group. (The 8-process run of
    this setup, equal to one process: ``tests/distributed/test_slow.py``.)"""
    import autopar
    from autopar.cost_models.sharding import stored_dim

    model, inputs = build("mixtral", experts=4, batch=16)
    cfg = Config(pp=2, dp=4, ep=2, zero=zero, schedule="1f1b", microbatch_size=8)
    plan = autopar.plan(model, Mesh.virtual("h100-dgx", nodes=1, gpus_per_node=8), inputs,
                        config=cfg)
    assert plan.axis_names == ("pp", "dp", "ep") and plan.techniques["dp_shard"] == 2
    dp, ep = 0, 1  # (the stage mesh's axes)
    over = {dp: [], ep: []}
    for stage in plan.pipeline.stages:
        for name, program in stage.params.items():
            kept = stored_dim(name, tuple(program), tuple(plan.params[name]))
            if kept is not None:  # (raises for a weight stored over two axes)
                over[kept[0]].append(name)
    assert over[dp] and all(".experts." in n for n in over[dp]), over
    assert over[ep] and not any(".experts." in n for n in over[ep]), over
    gathers = [c for c in plan.collectives if c.kind == "all_gather" and "parameters" in c.node]
    assert {c.axis for c in gathers} == {"dp", "ep"}, gathers
    # the search prices the dense state over ep only (step_price._dense_setup): observed -1.4%
    # (ZeRO-1) and -1.2% (ZeRO-3) under the per-operator peak; -6.0% and -7.9% when it priced
    # it over both axes. Before torch 2.13 (without autopar's rule for Tensor.new_*) the two
    # models differ by -8.1% with it (not traced to its ops), so the check says nothing there.
    if not older_than("2.13"):
        assert plan.predicted["search_peak_memory_bytes"] >= 0.97 * max(
            plan.pipeline.predicted["stage_memory_bytes"])
