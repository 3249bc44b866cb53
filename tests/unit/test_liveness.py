"""The liveness memory model (autopar.cost_models.liveness) and what a pipeline's ranks hold
(cost_models.pipeline.in_flight / peak_held_bytes): the parts the distributed memory test
(tests/distributed/test_equivalence.py) measures end to end, checked here on their own."""

from __future__ import annotations

import pytest

import autopar
from autopar.cost_models.liveness import StageRun, step_memory
from autopar.cost_models.pipeline import action_order, in_flight, peak_held_bytes
from autopar.cost_models.rank_bytes import weight_stash_bytes
from autopar.plan_context import context_of
from models import build


@pytest.mark.parametrize("schedule,v", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2)])
def test_a_fused_backward_releases_a_microbatch_at_the_same_step_either_way(schedule, v):
    # without a separate weight step, "until the input grad" and "until the weight grad" are
    # the same action (BW)
    assert in_flight(schedule, 2, v, 4, until="W") == in_flight(schedule, 2, v, 4)


def test_zero_bubble_holds_a_microbatch_until_its_weight_step():
    held_b, held_w = in_flight("zero-bubble", 2, 2, 4), in_flight("zero-bubble", 2, 2, 4, "W")
    assert all(w >= b for w, b in zip(held_w, held_b)) and held_w != held_b
    # counted by hand from the action order: the most F's of a stage before as many W's
    for rank, order in enumerate(action_order("zero-bubble", 2, 2, 4)):
        for stage in range(rank, 4, 2):
            live, most = 0, 0
            for kind, s, _ in order:
                if s == stage:
                    live += {"F": 1, "W": -1}.get(kind, 0)
                    most = max(most, live)
            assert held_w[stage] == most


def test_a_rank_with_one_stage_holds_its_peak_in_flight_and_two_stages_less_than_both_peaks():
    per_mb = [3.0, 5.0]
    flight = in_flight("1f1b", 2, 1, 4)
    assert peak_held_bytes("1f1b", 2, 1, 4, per_mb) == tuple(f * b for f, b in zip(flight, per_mb))
    per_mb = [3.0, 5.0, 7.0, 11.0]
    flight = in_flight("interleaved-1f1b", 2, 2, 4)
    held = peak_held_bytes("interleaved-1f1b", 2, 2, 4, per_mb)
    for rank in range(2):
        own = [flight[s] * per_mb[s] for s in range(rank, 4, 2)]
        assert max(own) <= held[rank] <= sum(own)
    with pytest.raises(ValueError, match="use 'B' or 'W'"):
        peak_held_bytes("1f1b", 2, 1, 4, per_mb[:2], until="F")


def _stages():
    model, inputs = build("gpt", dim=64, heads=4, layers=2, batch=4, seq=16)
    mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2)
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(
        pp=2, dp=1, tp=1, schedule="1f1b", microbatch_size=1))
    return [(context_of(stage).traced, stage) for stage in plan.pipeline.stages]


def test_a_stage_sums_its_gradients_in_a_second_copy_and_a_split_one_holds_its_stash():
    stages = _stages()
    traced, stage = stages[0]
    nodes, outputs = stage.nodes, stage.output_placements
    grads = {p.grad_output_index for p in traced.params}
    args = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
    grad_bytes = sum(args[i].meta["val"].numel() * args[i].meta["val"].element_size()
                     for i in grads if args[i] is not None)
    one = step_memory(traced, (1, 1), nodes, outputs, stage=StageRun(1, 1))
    four = step_memory(traced, (1, 1), nodes, outputs, stage=StageRun(1, 4))
    split = step_memory(traced, (1, 1), nodes, outputs, stage=StageRun(1, 4, split_backward=True))
    # the gradient sum (GradSink) is alive through the backward beside the backward's own
    # gradients; four microbatches also keep four receive buffers of the output's gradient
    tangent = sum(n.meta["val"].numel() * n.meta["val"].element_size()
                  for n in traced.gm.graph.nodes if n.name in traced.boundary_tangents)
    assert four.persistent_bytes - one.persistent_bytes == pytest.approx(3 * tangent)
    assert four.peak_bytes - one.peak_bytes == pytest.approx(3 * tangent + grad_bytes)
    # a split backward (zero-bubble) sums its weight steps' gradients into the same copy, and
    # holds the values its weight step reads from its input step: none on the first stage
    # (no input gradient), some on the second
    assert split.peak_bytes == pytest.approx(four.peak_bytes)
    traced1, stage1 = stages[1]
    whole, split = (step_memory(traced1, (1, 1), stage1.nodes, stage1.output_placements,
                                stage=StageRun(1, 4, split_backward=s)) for s in (False, True))
    stash = weight_stash_bytes(traced1, (1, 1), stage1.nodes)
    assert stash > 0 and split.peak_bytes - whole.peak_bytes == pytest.approx(stash)
    # each further microbatch in flight holds the saved values once more
    two = step_memory(traced, (1, 1), nodes, outputs, stage=StageRun(2, 4))
    assert two.peak_bytes - four.peak_bytes == pytest.approx(four.saved_bytes)
    assert four.saved_bytes > 0 and four.held_bytes <= four.peak_bytes


def test_a_zero_stage_holds_shards_of_the_state_and_a_gathered_copy():
    # ZeRO-1 once a step (StageRun.zero_axes): each parameter's 16 bytes per element of fp32
    # AdamW state (param, grad, two moments) are held at the dp=2 shard's size, 8, plus the 4 of
    # the copy gathered for the step: 4 bytes per element fewer than without ZeRO; at the
    # first forward the gather's flat buffer sits beside the copies
    model, inputs = build("gpt", dim=64, heads=4, layers=2, batch=8, seq=16)
    mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=4)
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(
        pp=2, dp=2, tp=1, zero=0, schedule="1f1b", microbatch_size=4))
    stage = plan.pipeline.stages[0]
    traced = context_of(stage).traced
    assert all(pl == ("R",) for pl in stage.params.values()), stage.params
    args = (traced, (2,), stage.nodes, stage.output_placements)
    plain = step_memory(*args, stage=StageRun(1, 2))
    zero = step_memory(*args, stage=StageRun(1, 2, zero_axes=(0,)))
    elements = sum(p.numel for p in traced.params if p.tied_to is None)
    assert plain.persistent_bytes - zero.persistent_bytes == pytest.approx(4 * elements)
    assert zero.peak_bytes >= zero.persistent_bytes + 4 * elements
    assert zero.saved_bytes == plain.saved_bytes
