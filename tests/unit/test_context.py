"""Context parallelism in the plan: the cp axis, attention's queries sharded on the sequence
over it, and the rank's place in the sequence (the equivalence checks with processes are in
tests/distributed/test_equivalence.py)."""

from __future__ import annotations

import dataclasses

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.errors import PlanError
from autopar.passes.seq_attention import query_offset
from models import build, slow_compute


def _plan(cp: int, devices: int, **config) -> autopar.Plan:
    model, inputs = build("gpt", dim=64, heads=4, layers=2, batch=4, seq=64)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=devices)
    return autopar.plan(model, mesh, inputs, config=autopar.Config(cp=cp, **config))


def test_cp_axis_shards_attention_queries_and_gathers_keys_and_values():
    plan = _plan(2, 4, tp=2, cp_attention="gather")
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
    from autopar.planning.setups import CP_MIN_SEQUENCE, candidate_setups, cp_degrees

    short = list(candidate_setups(64, 8, 256, 16, autopar.Config(), seq=CP_MIN_SEQUENCE // 2))
    assert {s.cp for s in short} == {1}
    long = list(candidate_setups(64, 8, 256, 16, autopar.Config(), seq=CP_MIN_SEQUENCE * 2))
    assert {s.cp for s in long} == {1, 2, 4, 8, 16, 32}
    assert all(s.dp * s.cp * s.tp * s.pp == 64 for s in long)
    asked = list(candidate_setups(64, 8, 256, 16, autopar.Config(cp=4), seq=2048))
    assert asked and {s.cp for s in asked} == {4}
    assert cp_degrees(autopar.Config(cp=3), 4096, 8) == []  # 3 does not divide 8 devices


def test_the_search_tries_several_sequences_a_dp_rank_beside_cp_last():
    """dp > 1 and cp > 1 with two or more sequences a replica's microbatch run the linears whole
    on cp (``strategies.nested_views``): the search prices them only if no other setup fits
    (``setups.tried_last``), unless the Config fixes dp and cp or sets ``microbatch_size``."""
    from autopar.planning.setups import candidate_setups, tried_last

    def several(setups):
        return [s for s in setups if s.cp > 1 and s.dp > 1 and s.microbatch_size > 1]

    free = autopar.Config(cp=2)
    setups = list(candidate_setups(32, 8, 8, 4, free, seq=4096))
    assert several(setups) and [s for s in setups if not tried_last(s, free)]
    assert [s for s in setups if tried_last(s, free)] == several(setups)
    for fixed in (autopar.Config(cp=2, dp=4), autopar.Config(cp=2, microbatch_size=8)):
        kept = several(candidate_setups(32, 8, 8, 4, fixed, seq=4096))
        assert kept and not any(tried_last(s, fixed) for s in kept), fixed

def test_cp_gradients_are_reduced_once_a_step_at_the_step_end():
    """Each cp rank's gradients are partial sums over its sequence chunk. The closed form
    all-reduces them over cp once a step (stride tp), after the dp reduction: with dp=1 and
    cp=8 that is the all-reduce of dp=8 without cp (same bytes, group and stride); with dp=4 x
    cp=2 both, each over its own group."""
    from autopar.cost_models.topology import get_preset
    from autopar.cost_models.step_price import price_setup
    from autopar.cost_models.training_step import LayerCosts, Setup, UnitCosts

    unit = UnitCosts(1e-3, 2e-3, 0.0, 0.0, 1e9, 1e9, 2.5e8)
    lc = LayerCosts(unit, unit, unit, 4, 0.0, 0.0, 1e6, 1e6, 2, "adam")
    topo = get_preset("h100-dgx")

    def comm(dp: int, cp: int) -> float:
        setup = Setup(dp, 1, 1, 1, 1, "none", 1, "none", 0, False, cp=cp)
        return price_setup(lc, setup, topo, 1e15).parts["dp_comm_s"]

    assert comm(1, 8) == pytest.approx(comm(8, 1), rel=1e-12) and comm(8, 1) > 0
    assert comm(4, 2) > comm(4, 1) > 0  # the dp all-reduce (stride 2) and the cp one
    assert comm(1, 1) == 0


def test_cp_layer_costs_leave_the_gradient_reduction_to_the_step_end():
    """The per-layer ILP at cp=2 leaves the weights' gradients partial over cp (the step end
    reduces them, summed over the microbatches): the block's backward communication is the
    keys' and values' gather again and the reduce-scatter of their gradients, twice its
    forward's (the gather); it held an all-reduce of the weights' gradients too (1.8x then)."""
    from autopar.model_presets import megatron_gpt
    from autopar.planning.search import LayerSolver

    model, inputs = megatron_gpt(dict(hidden=512, layers=2, heads=8), batch=1, seq=2048,
                                 vocab=1024, flash=True)
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=1, gpus_per_node=2)
    layers = LayerSolver(model, inputs, mesh, autopar.Config(cp_attention="gather"), ())
    block = layers.costs(1, 1, False, cp=2).block
    assert block.forward_comm_s > 0
    assert block.backward_comm_s == pytest.approx(2 * block.forward_comm_s, rel=1e-6)
    assert layers.costs(1, 1, False, cp=1).block.backward_comm_s == 0


def test_a_pipeline_stage_reduces_its_gradients_over_cp_once_a_step():
    """pp=2 x cp=2: each stage's program leaves its weights' gradients partial over cp (no
    gradient all-reduce per microbatch) and the plan lists one step-end all-reduce over cp per
    stage (the runtime's gradient buckets; counted against the plan in test_slow.py's pp=2 x
    cp=2 run)."""
    model, inputs = build("gpt", dim=256, heads=4, layers=4, batch=2, seq=512)
    mesh = autopar.Mesh.virtual("a100-dgx", gpus_per_node=4)
    plan = autopar.plan(model, mesh, inputs,
                        config=autopar.Config(pp=2, cp=2, dp=1, tp=1, microbatch_size=1))
    cp = [c for c in plan.collectives if c.axis == "cp" and c.kind == "all_reduce"]
    assert not [c for c in cp if c.node == "output"], cp  # (a gradient moved at the output)
    once = [c for c in cp if c.node.endswith("gradients")]
    assert sorted(c.stage for c in once) == list(range(len(plan.pipeline.stages))), once
    for stage in plan.pipeline.stages:
        assert ("P(sum)",) in {tuple(o) for o in stage.output_placements if o}


def test_a_pipeline_cut_sends_each_cp_rank_its_part_of_the_sequence():
    """pp=2 x cp=2: the activation crossing the cut, [microbatch 1, seq 512, dim 256] fp32
    (512 KiB), is split on the sequence over cp, so each rank sends and receives its half per
    microbatch and direction (it sent the whole to every cp rank before); the search's closed
    form prices the same half."""
    model, inputs = build("gpt", dim=256, heads=4, layers=4, batch=2, seq=512)
    mesh = autopar.Mesh.virtual("a100-dgx", gpus_per_node=4)
    plan = autopar.plan(model, mesh, inputs,
                        config=autopar.Config(pp=2, cp=2, dp=1, tp=1, microbatch_size=1))
    p2p = [c for c in plan.collectives if c.axis == "pp" and c.kind in ("send", "recv")]
    assert p2p and {c.bytes for c in p2p} == {512 * 256 * 4 // 2}, {c.bytes for c in p2p}


def test_a_three_axis_mesh_places_its_data_axis_as_that_axis_alone_does(monkeypatch):
    """On (dp, cp, tp) the dp axis is placed first, alone (``solve._pin_data_axes``): every
    node that can sits on dp as in the plan of dp alone on 2 devices, and the space the ILP
    sees is smaller than the unpinned one (each node keeps at least one strategy). (A node that
    cannot: the labels' flatten ``[4, 64] -> [256]``, split on the batch over dp and on the
    sequence over cp, has no strategy split on dp: DTensor's view rule has none for a dim split
    inside a flattened one.)"""
    from autopar.planning import solve
    from autopar.planning.candidates import Candidate
    from autopar.capture.stages import capture_with_forward
    from autopar.placements import to_str

    model, inputs = build("gpt", dim=64, heads=4, layers=2, batch=4, seq=64)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=8)
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(dp=2, cp=2, tp=2, zero=0))
    assert plan.axis_names == ("dp", "cp", "tp")
    alone = autopar.plan(model, autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2),
                         inputs, config=autopar.Config(dp=2, tp=1, zero=0))
    assert alone.axis_names == ("dp",)
    traced, _ = capture_with_forward(model, inputs, None)
    cand = Candidate((2, 2, 2), ("dp", "cp", "tp"), (0,), cp_axes=(1,))
    config = autopar.Config(dp=2, cp=2, tp=2)
    pinned, _ = solve.priced_space(traced, mesh, config, cand, ())
    monkeypatch.setattr(solve, "PIN_DATA_FROM_AXES", 4)
    free, _ = solve.priced_space(traced, mesh, config, cand, ())
    def on_dp(placements):  # (a plan's placements are text, a space's objects)
        return [None if p is None else p[0] if isinstance(p[0], str) else to_str(p[0])
                for p in placements]

    placed = 0
    for name, node in alone.nodes.items():
        if name not in free.nodes:  # (a getitem of an attention the cp axis changes)
            continue
        dp = on_dp(node.outputs)
        if not any(on_dp(s.outputs) == dp for s in free.nodes[name].strategies):
            assert name.startswith("view"), name  # (the flatten of the docstring)
            continue
        placed += 1
        assert on_dp(plan.nodes[name].outputs) == dp, name
        assert on_dp(plan.nodes[name].inputs) == on_dp(node.inputs), name
    assert placed > 0.8 * len(alone.nodes)  # (240 of 289 on 2026-11-27)
    assert all(pinned.nodes[n].strategies for n in free.nodes)
    assert all(set(pinned.nodes[n].strategies) <= set(free.nodes[n].strategies) for n in free.nodes)
    assert sum(map(len, (ns.strategies for ns in pinned.nodes.values()))) * 3 < sum(
        map(len, (ns.strategies for ns in free.nodes.values())))


@pytest.mark.parametrize("form", ["gather", "ring"])
def test_dp_beside_cp_splits_the_linear_layers_on_both_axes(form):
    """One sequence a dp rank: the traced linears' ``[b, s, h] -> [b * s, h]`` keeps the batch's
    split over dp nested with the sequence's over cp (``strategies.nested_views``), so every
    matmul is split over all four devices, as the search priced it. (Without the nested views
    DTensor's view rule asks the flatten's input whole on cp: each forward matmul ran on the
    whole sequence on both cp ranks.) Priced on ``slow-compute`` so that splitting pays."""
    model, inputs = build("gpt", dim=64, heads=4, layers=2, batch=2, seq=64)
    mesh = autopar.Mesh.virtual(slow_compute(), nodes=1, gpus_per_node=4)
    plan = autopar.plan(model, mesh, inputs,
                        config=autopar.Config(dp=2, cp=2, tp=1, zero=0, cp_attention=form))
    assert plan.axis_names == ("dp", "cp")
    mms = [n for n, p in plan.nodes.items() if p.op in ("aten.mm", "aten.addmm")
           and p.phase == "forward"]
    assert len(mms) == 9  # (qkv, proj, two MLP linears a layer; the head)
    for name in mms:  # (the activations' rows, the weight whole)
        rows = plan.nodes[name].inputs[-2 if plan.nodes[name].op == "aten.addmm" else 0]
        assert rows == ("S(0)", "S(0)"), (name, plan.nodes[name])
    assert plan.predicted.step_time_s > 0


def test_nested_views_merge_and_split_one_block_a_rank_of_the_outer_axis():
    """The nested views' placements, and the candidates they refuse: a strided split, the
    inner dim's axis before the outer's, an outer dim of two blocks a rank."""
    from autopar._torch_private import _StridedShard
    from autopar.strategies.nested_views import nested_view_strategies
    r, s = Replicate(), Shard
    mesh = (2, 2, 2)  # (dp, cp, tp)
    # [2, 8, 6] -> [16, 6]: batch on dp, sequence on cp, hidden on tp
    merged = nested_view_strategies((2, 8, 6), (16, 6), [(s(0), s(1), s(2)), (s(0), r, r),
                                                        (s(1), s(0), r), (r, s(1), r)], mesh)
    assert merged == [((s(0), s(1), s(2)), (s(0), s(0), s(1)))]
    # the reverse view splits the nested pair back
    assert nested_view_strategies((16, 6), (2, 8, 6), [(s(0), s(0), s(1))], mesh) == \
        [((s(0), s(0), s(1)), (s(0), s(1), s(2)))]
    # two sequences a dp rank: the merged dim is not the rank's block of the sequence
    assert nested_view_strategies((4, 8, 6), (32, 6), [(s(0), s(1), r)], mesh) == []
    # a view that merges no split pair
    assert nested_view_strategies((2, 8, 6), (2, 48), [(s(0), s(1), r)], mesh) == []
    # a partial sum and a later dim carried over; the batch over two axes (HSDP, or dp and ep)
    p = Partial()
    assert nested_view_strategies((2, 8, 6, 4), (16, 6, 4), [(s(0), s(1), p), (r, s(1), s(3))],
                                  mesh) == [((s(0), s(1), p), (s(0), s(0), p))]
    assert nested_view_strategies((4, 8, 6), (32, 6), [(s(0), s(0), s(1))], mesh) == \
        [((s(0), s(0), s(1)), (s(0), s(0), s(0)))]
    assert nested_view_strategies((32, 6), (4, 8, 6), [(s(0), s(0), s(0))], mesh) == \
        [((s(0), s(0), s(0)), (s(0), s(0), s(1)))]
    # refused: the sequence's axis before the batch's, a strided split anywhere
    assert nested_view_strategies((2, 8, 6), (16, 6), [(s(1), s(0), r)], mesh) == []
    strided = _StridedShard(2, split_factor=2)
    assert nested_view_strategies((2, 8, 6), (16, 6), [(s(0), s(1), strided)], mesh) == []


def test_the_cp_and_tp_axes_are_tried_in_both_orders_where_the_order_matters():
    """cp inside tp (tp the outer of the two axes) is a setup of its own where cp x tp spans
    more than a node, so that one of them crosses nodes: the search and the per-operator
    candidates try both orders there, the one the Config fixes, and one order elsewhere."""
    from autopar.planning.candidates import mesh_candidates
    from autopar.planning.setups import candidate_setups

    def orders(config, devices=16, node=8):
        return {(s.cp, s.tp, s.cp_inside_tp) for s in candidate_setups(
            devices, node, 16, 4, config, seq=4096) if s.cp > 1 and s.tp > 1}

    assert orders(autopar.Config(cp=4, tp=4)) == {(4, 4, False), (4, 4, True)}
    assert orders(autopar.Config(cp=2, tp=4)) == {(2, 4, False)}  # (8 devices: one node)
    assert orders(autopar.Config(cp=2, tp=4), node=4) == {(2, 4, False), (2, 4, True)}
    assert orders(autopar.Config(cp=4, tp=4, cp_inside_tp=True)) == {(4, 4, True)}
    assert orders(autopar.Config(cp=2, tp=4, cp_inside_tp=True)) == {(2, 4, True)}
    assert orders(autopar.Config(cp=4, tp=4, cp_inside_tp=False)) == {(4, 4, False)}
    cands = mesh_candidates(16, autopar.Config(cp=4, tp=2), gpus_per_node=4)
    assert [(c.names, c.shape, c.cp_axes) for c in cands] == [
        (("dp", "cp", "tp"), (2, 4, 2), (1,)), (("dp", "tp", "cp"), (2, 2, 4), (2,))]
    assert [c.names for c in mesh_candidates(16, autopar.Config(cp=4, tp=2))] == [("dp", "cp", "tp")]
    with pytest.raises(ValueError, match="cp_inside_tp=1"):
        autopar.Config(cp_inside_tp=1)


def test_the_step_end_reduces_the_gradients_over_cp_on_the_links_of_its_order():
    """With tp=4 on nodes of 4 devices, cp=2 outside tp has stride 4 (its two ranks on two
    nodes: the all-reduce over InfiniBand), inside tp stride 1 (inside a node): the same
    all-reduce as a dp=2 group's of the same stride and bytes."""
    from autopar.cost_models.topology import custom
    from autopar.cost_models.step_price import price_setup
    from autopar.cost_models.training_step import LayerCosts, Setup, UnitCosts

    unit = UnitCosts(1e-3, 2e-3, 0.0, 0.0, 1e9, 1e9, 2.5e8)
    lc = LayerCosts(unit, unit, unit, 4, 0.0, 0.0, 1e6, 1e6, 2, "adam")
    topo = custom("h100-4", base="h100-dgx", gpus_per_node=4)

    def comm(dp: int, tp: int, cp: int, inside: bool = False) -> float:
        setup = Setup(dp, tp, 1, 1, 1, "none", 1, "none", 0, False, cp=cp, cp_inside_tp=inside)
        return price_setup(lc, setup, topo, 1e15).parts["dp_comm_s"]

    assert comm(1, 4, 2) == pytest.approx(comm(2, 4, 1), rel=1e-12)  # (stride 4: two nodes)
    assert comm(1, 4, 2, inside=True) == pytest.approx(comm(2, 1, 1), rel=1e-12)  # (stride 1)
    assert comm(1, 4, 2) > 1.5 * comm(1, 4, 2, inside=True) > 0


def test_the_search_prices_both_orders_and_the_plan_runs_the_one_chosen():
    """On two nodes of two devices, cp=2 x tp=2 puts tp or cp across the nodes: both are priced
    (their layer ILPs on the (cp, tp) and (tp, cp) submeshes), the faster is realized with its
    axes in that order, and a Config fixing the order gets it."""
    from autopar.model_presets import megatron_gpt
    from autopar.planning.search import search

    model, inputs = megatron_gpt(dict(hidden=256, layers=2, heads=4), batch=1, seq=1024,
                                 vocab=512, flash=True)
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=2, gpus_per_node=2)
    config = autopar.Config(cp=2, tp=2, cp_attention="gather", recompute="none", zero=0)
    result = search(model, inputs, mesh, config)
    by_order = {o: min((c for c in result.ranked if c.setup.cp_inside_tp == o),
                       key=lambda c: c.step_time_s) for o in (False, True)}
    # (the gradients' all-reduce over cp at the step end: across the nodes with cp outside tp,
    # inside one node with cp inside it)
    assert by_order[True].parts["dp_comm_s"] < by_order[False].parts["dp_comm_s"]
    best = result.ranked[0].setup.cp_inside_tp
    assert result.ranked[0].step_time_s == by_order[best].step_time_s < \
        by_order[not best].step_time_s
    plan = autopar.plan(model, mesh, inputs, config=config)
    assert plan.axis_names == (("tp", "cp") if best else ("cp", "tp"))
    forced = autopar.plan(model, mesh, inputs,
                          config=dataclasses.replace(config, cp_inside_tp=not best))
    assert forced.axis_names == (("cp", "tp") if best else ("tp", "cp"))


def test_the_search_interleaves_uneven_stages_but_not_a_v_no_better_than_a_smaller_one():
    """126 blocks on pp=16 (Llama 3 405B): no v > 1 splits them evenly, yet v=2..4 are tried,
    their largest stages 4, 3 and 2 blocks; v=5..7 leave 2 too (no shorter bubble, more sends
    and microbatches in flight) and v=8 would leave stages empty. On pp=8: v=5 and v=7 repeat
    v=4's and v=6's largest stage; a Config asking for one gets it."""
    from autopar.planning.setups import _schedule_options

    free = autopar.Config()
    assert _schedule_options(16, 16, 126, free) == [("1f1b", 1)] + [
        ("interleaved-1f1b", v) for v in (2, 3, 4)]
    assert [v for _, v in _schedule_options(8, 16, 126, free)] == [1, 2, 3, 4, 6, 8]
    assert _schedule_options(8, 16, 126, autopar.Config(virtual_stages=7)) == [
        ("interleaved-1f1b", 7)]
    assert _schedule_options(16, 8, 126, free) == []  # (m < pp, not a multiple of it)


def test_a_v_the_search_skips_is_no_faster_and_holds_no_less_than_the_v_kept():
    """126 blocks on pp=8: v=5 and v=7 repeat the largest stage of v=4 and v=6
    (``setups._schedule_options``); priced (the better of the balanced and the even split, as
    the search does), each is no faster than the kept v and holds at least as much."""
    from autopar.cost_models.step_price import price_setup
    from autopar.cost_models.topology import get_preset
    from autopar.cost_models.training_step import LayerCosts, Setup, UnitCosts

    unit = UnitCosts(1e-3, 2e-3, 0.0, 0.0, 1e9, 1e9, 2.5e8)
    lc = LayerCosts(unit, unit, unit, 126, 0.0, 0.0, 1e6, 1e6, 2, "adam")
    topo = get_preset("h100-dgx")

    def cost(v: int):
        setup = Setup(1, 1, 8, 1, 16, "interleaved-1f1b", v, "none", 0, False)
        return min((price_setup(lc, dataclasses.replace(setup, even_split=e), topo, 1e15)
                    for e in (False, True)), key=lambda c: c.step_time_s)

    for skipped, kept in ((5, 4), (7, 6)):
        a, b = cost(skipped), cost(kept)
        assert a.step_time_s >= b.step_time_s, (skipped, a.step_time_s, b.step_time_s)
        assert max(a.rank_memory_bytes) >= max(b.rank_memory_bytes), skipped


def test_an_order_of_cp_and_tp_without_both_axes_is_said_to_change_nothing():
    plan = _plan(2, 2, tp=1, cp_inside_tp=True)
    assert plan.axis_names == ("cp",)
    assert any("cp_inside_tp=True changes nothing" in w for w in plan.warnings), plan.warnings
