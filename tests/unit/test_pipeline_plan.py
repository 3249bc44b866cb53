"""The stage pass and the pipeline search, in one process (the runtime is in tests/distributed).

- the stage split computes the same loss, holds a tied weight in two stages, recomputes pure
  values and passes long skips through every stage between producer and consumer;
- large-vocabulary models get cuts that balance time rather than layer counts;
- the search picks pp > 1 when nothing without a pipeline fits the device, pp = 1 when it fits;
- a pipelined plan shows its pipeline in the tables and survives a JSON round trip.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

import autopar
from autopar.capture.stages import capture_stages, export_forward, microbatch_inputs
from models import GPT, build

FOUR = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=4)


def _run_stages(stages, flat):
    boundary: tuple = ()
    for st in stages:
        boundary = st.gm(*boundary, *(flat[i] for i in st.user_inputs))
    return boundary[0]


def test_split_stages_compute_the_same_loss_and_share_the_tied_weight():
    model, inputs = build("gpt", layers=4, batch=4)
    fwd = export_forward(model, inputs)
    assert fwd.units == ("pre", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "post")
    assert fwd.canonical["head.weight"] == "wte.weight"  # tied: one tensor, two names
    stages = capture_stages(fwd, (0, 0, 1, 1, 2, 2), list(inputs))
    graphs = [st for st, _ in stages]
    # exact: the same ops on the same inputs in the same order
    assert torch.equal(_run_stages(graphs, list(inputs)), model(*inputs))
    first, last = stages[0][1], stages[-1][1]
    assert "head.weight" in {p.name for p in first.params}  # the embedding's use of the tie
    assert "head.weight" in {p.name for p in last.params}  # the LM head's
    # every non-first stage receives activations and sends their gradients back
    for st, traced in stages[1:]:
        assert len(traced.boundary_inputs) == st.num_boundary >= 1
        assert len(traced.boundary_grad_outputs) == st.num_boundary
    # the targets are read by the last stage only (reshaped there: a pure node, recomputed)
    assert graphs[0].user_inputs == (0,) and graphs[-1].user_inputs == (1,)


class _Skip(nn.Module):
    """The embedding feeds the last layer directly: a value crossing two cuts."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.out = nn.Linear(16, 32)

    def forward(self, ids: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        x0 = self.emb(ids)
        x = x0
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.cross_entropy(self.out(x + x0).flatten(0, 1), tgt.flatten())


def test_a_value_skipping_stages_is_passed_through_each_of_them():
    torch.manual_seed(0)
    model = _Skip()
    ids, tgt = torch.randint(0, 32, (2, 5)), torch.randint(0, 32, (2, 5))
    fwd = export_forward(model, (ids, tgt))
    stages = capture_stages(fwd, (0, 0, 1, 2, 2), [ids, tgt])
    graphs = [st for st, _ in stages]
    assert torch.equal(_run_stages(graphs, [ids, tgt]), model(ids, tgt))
    # stage 1 carries the embedding on to stage 2 next to its own output
    assert graphs[1].num_boundary == 2 and graphs[1].num_outputs == 2
    # and the gradient of the skip reaches stage 0 through stage 1
    assert len(stages[1][1].boundary_grad_outputs) == 2


def test_microbatches_must_divide_the_batch():
    _, inputs = build("gpt", batch=4)
    chunks, _ = microbatch_inputs(inputs, 2)
    assert len(chunks) == 2 and chunks[0][0].shape[0] == 2
    with pytest.raises(ValueError, match="microbatch"):
        microbatch_inputs(inputs, 3)


def _fake_gpt(**kw):
    with FakeTensorMode(allow_non_fake_inputs=True):
        return GPT(**kw)


def test_large_vocabulary_gets_time_balanced_cuts():
    # the LM head over an 8k vocabulary costs about three blocks (2*V*d vs 24*d^2 FLOPs per
    # token): the last stage must take fewer blocks than the middle ones, not an equal share
    model = _fake_gpt(vocab=8192, dim=256, heads=4, layers=8, seq=64)
    ids = torch.randint(0, 8192, (8, 64))
    plan = autopar.plan(model, FOUR, (ids, ids), config=autopar.Config(
        pp=4, schedule="1f1b", microbatch_size=2))
    pipe = plan.pipeline
    blocks = [sum(1 for u in pipe.stage_units(j) if u.startswith("blocks.")) for j in range(4)]
    assert blocks[-1] < min(blocks[1:-1]), blocks
    assert blocks != [2, 2, 2, 2]  # not the equal-layer-count split
    times = pipe.predicted["stage_time_s"]
    # the equal split would put two blocks on top of the head in the last stage; the chosen
    # cut keeps every stage below the head plus one block
    head_and_block = times[-1] + (times[1] / max(blocks[1], 1))
    assert max(times) < head_and_block, times


@pytest.mark.slow  # three plans with pipeline searches (~20 s): the default suite's margin
def test_pipeline_is_chosen_only_when_nothing_else_fits():
    model = _fake_gpt(vocab=512, dim=256, heads=4, layers=4, seq=32)
    ids = torch.randint(0, 512, (8, 32))
    fits = autopar.plan(model, FOUR, (ids, ids), config=autopar.Config(tp=2))
    assert fits.degrees["pp"] == 1 and fits.pipeline is None
    with pytest.raises(autopar.PlanError) as err:  # the smallest plan without a pipeline
        autopar.plan(model, FOUR, (ids, ids), config=autopar.Config(tp=2, pp=1, memory_bytes=1.0,
                                                                    recompute="none", zero=0))
    smallest = err.value.required_bytes
    budget = 0.8 * smallest
    # without recomputation and ZeRO, only a pipeline fits (one microbatch size: one trace)
    plan = autopar.plan(model, FOUR, (ids, ids), config=autopar.Config(
        tp=2, memory_bytes=budget, recompute="none", zero=0, microbatch_size=2))
    assert plan.degrees["pp"] == 2 and plan.degrees["tp"] == 2
    assert plan.pipeline is not None
    assert plan.predicted["peak_memory_bytes"] <= budget


@pytest.mark.slow
def test_recompute_and_zero_come_before_a_pipeline():
    model = _fake_gpt(vocab=512, dim=256, heads=4, layers=4, seq=32)
    ids = torch.randint(0, 512, (8, 32))
    with pytest.raises(autopar.PlanError) as err:
        autopar.plan(model, FOUR, (ids, ids), config=autopar.Config(tp=2, pp=1, memory_bytes=1.0,
                                                                    recompute="none", zero=0))
    budget = 0.8 * err.value.required_bytes  # too small without a pipeline or the techniques
    # left free, they come first: cheaper than a pipeline's bubble (the ILP under a binding
    # memory budget may run to its time limit: 5 s keeps the test short, any feasible plan does)
    free = autopar.plan(model, FOUR, (ids, ids), config=autopar.Config(
        tp=2, memory_bytes=budget, solver_time_limit_s=5))
    assert free.pipeline is None and free.predicted["peak_memory_bytes"] <= budget
    assert (free.techniques["recompute"], free.techniques["zero"]) != ("none", 0)


def test_pipelined_plan_tables_json_and_digest():
    model, inputs = build("gpt", layers=2, batch=8)
    plan = autopar.plan(model, FOUR, inputs, config=autopar.Config(
        pp=2, tp=2, schedule="interleaved-1f1b", virtual_stages=2, microbatch_size=2))
    text = str(plan)
    assert "pp=2" in text and "interleaved-1f1b" in text and "4 microbatches of 2" in text
    assert "pipeline stages" in text and "blocks.0" in text
    data = json.loads(plan.to_json())
    assert data["pipeline"]["schedule"] == "interleaved-1f1b"
    assert data["pipeline"]["stage_of_unit"] == list(plan.pipeline.stage_of_unit)
    again = autopar.Plan.from_dict(data)
    assert again.digest() == plan.digest() and again.pipeline.stages[1].params == plan.pipeline.stages[1].params
    assert again.collective_counts(pp_rank=1) == plan.collective_counts(pp_rank=1)


def test_config_pipeline_fields_are_checked():
    with pytest.raises(ValueError, match="schedule"):
        autopar.Config(schedule="1f2b")
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="virtual_stages"):
            autopar.Config(virtual_stages=bad)
        with pytest.raises(ValueError, match="microbatch_size"):
            autopar.Config(microbatch_size=bad)
    cfg = autopar.Config(pp=2, schedule="zero-bubble", virtual_stages=2, microbatch_size=4)
    assert autopar.Config.from_dict(cfg.to_dict()) == cfg


def test_impossible_pipeline_settings_say_why():
    model, inputs = build("gpt", layers=2, batch=8)
    with pytest.raises(autopar.PlanError, match="one stage per rank"):  # 1F1B has no chunks
        autopar.plan(model, FOUR, inputs, config=autopar.Config(
            pp=2, tp=2, schedule="1f1b", virtual_stages=2, microbatch_size=2))


def test_zero_bubble_backward_runs_input_and_weight_parts_once_each():
    """The split backward: autograd's backward runs the input gradients only and defers the
    weight part to the stage's gradient sink; the schedule's weight step runs it later; every
    gradient equals the unsplit backward's."""
    from autopar.runtime.autograd import (GradSink, JointFunction, split_forward_backward,
                                          split_weight_backward)

    model, inputs = build("gpt", layers=2, batch=2)
    fwd = export_forward(model, inputs)
    (st0, _), (st1, traced) = capture_stages(fwd, (0, 0, 1, 1), list(inputs))
    order = [n.name for n in traced.gm.graph.nodes if n.op == "placeholder"]
    f, b = split_forward_backward(traced.gm, order, traced.num_forward_outputs)
    params = {p.node: p for p in traced.params}
    grad_of = {p.node: p.grad_output_index for p in traced.params}
    grad_of.update(zip(traced.boundary_inputs, traced.boundary_grad_outputs))
    names = [n for n in order if n not in traced.tangent_nodes]
    slots = tuple(grad_of[n] - 1 if grad_of.get(n) is not None else None for n in names)
    x = st0.gm(inputs[0])[0].detach()
    weights = dict(st1.gm.named_parameters())

    def primals(requires_grad: bool):
        out = []
        for n in names:
            if n in params:
                w = weights["model." + params[n].name].detach().clone()
                out.append(w.requires_grad_() if requires_grad else w)
            elif n in traced.boundary_inputs:
                out.append(x.clone().requires_grad_())
            else:
                out.append(inputs[1])
        return out

    ref_in = primals(True)
    JointFunction.apply(f, b, slots, 1, False, None, *ref_in).backward()
    split = split_weight_backward(b, [s for n, s in zip(names, slots) if n in traced.boundary_inputs])
    calls = {"input": 0, "weight": 0}
    for part in ("input", "weight"):
        gm = getattr(split, f"{part}_part")
        gm.register_forward_pre_hook(lambda *_, p=part: calls.__setitem__(p, calls[p] + 1))
    got_in = primals(False)  # (the parameters' gradients go to the sink, as in a stage)
    sink = GradSink()
    by_name = tuple(params[n].name if n in params else None for n in names)
    anchor = torch.zeros((), requires_grad=True)
    loss = JointFunction.apply(f, split, slots, 1, True, (sink, by_name, None), anchor, *got_in)
    loss.backward()  # the schedule's input step
    assert calls == {"input": 1, "weight": 0}  # weights not touched yet
    boundary = [t for n, t in zip(names, got_in) if n in traced.boundary_inputs][0]
    ref_boundary = [t for n, t in zip(names, ref_in) if n in traced.boundary_inputs][0]
    # the same graph nodes evaluated in the same order: equal to the last bit
    assert torch.equal(boundary.grad, ref_boundary.grad)
    assert sink.grads == {}
    sink.take_deferred()()  # the weight step
    assert calls == {"input": 1, "weight": 1}
    with pytest.raises(RuntimeError, match="no backward deferred one"):
        sink.take_deferred()  # (each microbatch's weight step runs once)
    got = sink.take()
    ref = {params[n].name: r.grad for n, r in zip(names, ref_in) if n in params}
    assert set(got) == set(ref) and all(torch.equal(got[k], ref[k]) for k in ref)


@pytest.mark.slow  # 13 s: the default suite's time
def test_a_budget_no_stage_split_meets_names_the_stage_and_the_excess():
    model, inputs = build("gpt", layers=4, batch=8)
    mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2)
    config = dict(pp=2, microbatch_size=2, schedule="1f1b")
    # just under what the best cut needs: one pipeline rank is over, by a small amount
    with pytest.raises(autopar.InfeasibleMemoryError) as err:
        autopar.plan(model, mesh, inputs, config=autopar.Config(memory_bytes=1.9e6, **config))
    msg, e = str(err.value), err.value
    assert "pipeline rank 0 (layers 0-2) needs" in msg and "over;" in msg, msg
    assert "pipeline rank 1 (layers 3-5) needs" in msg and "fits" in msg, msg
    assert 1.9e6 < e.required_bytes < 1.1 * 1.9e6 and e.budget_bytes == 1.9e6
    # far below: even all the pipeline ranks together cannot hold the model
    with pytest.raises(autopar.InfeasibleMemoryError) as err:
        autopar.plan(model, mesh, inputs, config=autopar.Config(memory_bytes=6e5, **config))
    assert "the 2 pipeline ranks together (2 x 586 KiB) cannot hold the model" in str(err.value)


def test_a_stage_of_one_block_recomputes_as_a_stage_of_several():
    # A stage holding one block cannot show which module list repeats from its own parameter
    # names; it takes the model's. Before, such a stage had no layers, so recomputation (and its
    # price) silently did nothing there while the search counted it.
    from autopar.capture.remat import recompute_nodes
    from autopar.capture.stages import capture_stages, capture_with_forward

    model, inputs = build("gpt", layers=4)
    _, fwd = capture_with_forward(model, inputs)
    one = capture_stages(fwd, (0, 0, 1, 2, 3, 3), list(inputs))
    two = capture_stages(fwd, (0, 0, 0, 1, 1, 1), list(inputs))
    for policy in ("selective", "full"):
        per_block = len(recompute_nodes(two[0][1], policy)) // 2
        assert per_block > 0
        for k, (_, traced) in enumerate(one):
            assert f"blocks.{k}" in set(traced.node_layer.values())
            assert len(recompute_nodes(traced, policy)) == per_block, (policy, k)


def test_a_microbatch_smaller_than_the_replicas_is_refused_with_the_fix():
    # Config.microbatch_size counts samples over all dp replicas: 1 sample cannot be split over
    # dp=2 (before, the error ended at "no mesh candidate can place the model:" with nothing after)
    model, inputs = build("gpt", layers=4, batch=8)
    mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=4)
    config = autopar.Config(pp=2, dp=2, tp=1, schedule="1f1b", microbatch_size=1)
    with pytest.raises(autopar.PlanError, match=r"microbatch_size=1\).*dp=2.*use microbatch_size=2"):
        autopar.plan(model, mesh, inputs, config=config)
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(
        pp=2, dp=2, tp=1, schedule="1f1b", microbatch_size=2))
    assert plan.pipeline.microbatches == 4 and plan.techniques["replica_microbatch_size"] == 1


def test_step_end_reductions_are_one_bucket_per_stage_whatever_the_microbatches():
    """A pp=2 x dp=2 plan without ZeRO lists one dp all-reduce per stage, for after its last
    backward, holding every gradient the stage leaves partial over dp (the runtime's bucket,
    cost_models.sharding.step_end_buckets), at 2 and at 4 microbatches alike; the stages'
    programs all-reduce no gradient over dp themselves."""
    from autopar.cost_models.sharding import step_end_buckets
    from autopar.planning.pipeline import forward_for_plan

    model, inputs = build("gpt", dim=128, seq=32, batch=16)
    mesh = autopar.Mesh.virtual("a100-dgx", gpus_per_node=4)
    ends = []
    for size in (8, 4):  # 2 and 4 microbatches
        plan = autopar.plan(model, mesh, inputs, config=autopar.Config(
            pp=2, dp=2, tp=1, zero=0, schedule="1f1b", microbatch_size=size))
        dp_reduces = [c for c in plan.collectives if c.axis == "dp" and c.stage is not None
                      and c.kind == "all_reduce"]
        assert sorted(c.stage for c in dp_reduces) == [0, 1], dp_reduces
        _, stages = forward_for_plan(model, inputs, plan)
        for (st, traced), c in zip(stages, sorted(dp_reduces, key=lambda c: c.stage)):
            splan = plan.pipeline.stages[st.index]
            buckets = step_end_buckets(traced, splan.output_placements, splan.params, (2, 1))
            partial = [p for p in traced.params if p.grad_output_index is not None
                       and (splan.output_placements[p.grad_output_index] or ("R",))[0].startswith("P")]
            assert len(buckets) == 1 and buckets[0].params == tuple(p.name for p in partial)
            assert c.bytes == buckets[0].bytes == sum(4 * math.prod(p.shape) for p in partial) > 0
            assert c.node == f"{len(partial)} gradients"
        ends.append(len(dp_reduces))
    assert ends[0] == ends[1] == 2


def test_a_zero_pipeline_gathers_and_reduce_scatters_each_stage_once_a_step():
    """With ZeRO-1 the same plan stores every parameter sharded over dp (plan.params: Shard on
    dp where a dim divides) while each stage's program computes with it replicated there; each
    stage lists one all-gather of its parameters (before its first forward) and one
    reduce-scatter of its partial gradients (after its last backward), of the same buffer, at 2
    and at 4 microbatches alike; the stage's memory holds a 1/dp share of the state plus the
    gathered copy, below the plan without ZeRO."""
    model, inputs = build("gpt", dim=128, seq=32, batch=16)
    mesh = autopar.Mesh.virtual("a100-dgx", gpus_per_node=4)
    for size in (8, 4):
        plans = {z: autopar.plan(model, mesh, inputs, config=autopar.Config(
            pp=2, dp=2, tp=1, zero=z, schedule="1f1b", microbatch_size=size)) for z in (0, 1)}
        plan = plans[1]
        assert plan.techniques["zero"] == 1
        once = [c for c in plan.collectives if c.axis == "dp" and c.node.endswith(("gradients", "parameters"))]
        for stage in (0, 1):
            kinds = sorted((c.kind, c.phase) for c in once if c.stage == stage)
            assert kinds == [("all_gather", "forward"), ("reduce_scatter", "backward")], kinds
            gather, scatter = (c.bytes for c in sorted((c for c in once if c.stage == stage),
                                                        key=lambda c: c.kind))
            assert gather >= scatter > 0  # (a gradient the program gives whole needs none)
        # stored sharded (every dim of this GPT divides by 2); computed replicated over dp
        assert all(pl[0].startswith("S") for pl in plan.params.values()), plan.params
        program = [pl[0] for s in plan.pipeline.stages for pl in s.params.values()]
        assert program.count("R") >= len(program) - 2, program
        for z in (0, 1):
            assert any(c.kind == "all_reduce" and c.axis == "dp" and c.stage is not None
                           and c.node.endswith("gradients") for c in plans[z].collectives) == (z == 0)
        assert plan.predicted["peak_memory_bytes"] < plans[0].predicted["peak_memory_bytes"]


def test_a_rank_major_bucket_reduce_scatters_into_shards_and_gathers_back_whole():
    """FlatBucket with dims (ZeRO-1 once a step): gradients summed into strided views land so
    that part r of the buffer is every tensor's chunk r on its dim, which a reduce-scatter
    leaves on rank r; packing each rank's chunks and unpacking the gathered parts gives every
    tensor whole again. Checked against torch.chunk, the chunking of DTensor's Shard."""
    from autopar.runtime.autograd import FlatBucket, GradSink

    shapes, dims, parts = [(4, 6), (3, 8), (8,)], [0, 1, 0], 2
    bucket = FlatBucket(["a", "b", "c"], shapes, torch.float32, dims, parts)
    ready = []
    sink = GradSink([bucket], 2, lambda b, buffer: ready.append(buffer))
    grads = [[torch.randn(s) for s in shapes] for _ in range(2)]
    for microbatch in grads:
        for name, g in zip("abc", microbatch):
            sink.add(name, g)
        sink.end_backward()
    assert len(ready) == 1 and ready[0].numel() == sum(math.prod(s) for s in shapes)
    total = [a + b for a, b in zip(*grads)]
    for r, part in enumerate(ready[0].view(parts, -1)):
        for chunk, whole, d in zip(bucket.chunks(part), total, dims):
            assert torch.equal(chunk, whole.chunk(parts, d)[r])
    gathered = torch.cat([bucket.pack([t.chunk(parts, d)[r] for t, d in zip(total, dims)])
                          for r in range(parts)])
    for whole, back in zip(total, bucket.unpack(gathered)):
        assert torch.equal(whole, back) and back.is_contiguous()
    with pytest.raises(ValueError, match="do not split evenly"):
        FlatBucket(["a"], [(3, 5)], torch.float32, [1], 2)


def test_an_interleaved_stage_may_use_its_predicted_peak_scaled_by_its_ranks_slack():
    """A rank of an interleaved pipeline holds one computing stage's peak beside its other
    stages' held bytes, so a stage's peak is not a share of the rank's budget. Splitting the
    budget in proportion to the stages' peaks gave the first of DeepSeek-V3's v=3 stages (pp=2,
    ZeRO-3, 2,048 GPUs) 29.3 GiB of 80; the search predicted 30.4 GiB for it (without ZeRO-3's
    gathered copies, which its stage memory now counts) and the per-operator model 37.6 GiB,
    so the per-operator solve refused it. Now: the stage's predicted peak times the rank's slack; without the
    ranks' predictions, the proportional split as before."""
    from autopar.planning.candidates import Candidate
    from autopar.planning.pipeline import PipelineSetup

    cand = Candidate((2,), ("dp",), (0,))
    stages = (30.0, 30.0, 20.0, 20.0)  # stages 0 and 2 on rank 0, 1 and 3 on rank 1
    setup = PipelineSetup(2, cand, 8, "interleaved-1f1b", 2, (), 1.0, 64.0, stages, (64.0, 40.0))
    assert setup.stage_budgets(80.0) == pytest.approx([37.5, 60.0, 25.0, 40.0])
    older = PipelineSetup(2, cand, 8, "interleaved-1f1b", 2, (), 1.0, 64.0, stages)
    assert older.stage_budgets(80.0) == pytest.approx([48.0, 48.0, 32.0, 32.0])
    # one stage a rank: its whole budget, either way
    one = PipelineSetup(2, cand, 8, "1f1b", 1, (), 1.0, 64.0, (64.0, 40.0), (64.0, 40.0))
    assert one.stage_budgets(80.0) == pytest.approx([80.0, 80.0])
