"""The cluster-scale search (autopar.planning.search) and its step model (training_step, step_price).

- Megatron-LM's hand configurations of SC'21 Table 1 are predicted within 10% of the published
  TFLOP/s per GPU (three rows here; all ten in benchmarks/megatron_table1.py), and the search's
  plan is never predicted slower than them;
- setups that do not fit are pruned with their reason and never chosen (175B with t = p = 1);
- the per-layer pricing agrees with the whole-model ILP of autopar.plan on a small GPT;
- the step model's closed forms reduce to Megatron's Eq. 1 and interleaved bubble;
- the plan view carries alternatives, techniques and per-stage peak memory, and round-trips JSON.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import pytest

import autopar
from autopar.planning.entry import model_fingerprint
from autopar.cost_models.step_price import price_setup
from autopar.cost_models.training_step import (
    RECOMPUTE, LayerCosts, Setup, UnitCosts, blocks_per_stage,
)
from autopar.model_presets import megatron_gpt
from autopar.planning.search import LayerSolver, only_when_needed, search
from autopar.planning.setups import Twins, candidate_setups
from models import build

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import megatron_table1  # noqa: E402


@pytest.mark.parametrize("row", [1, 5, 10])
def test_megatron_table1_rows_are_predicted_within_ten_percent(row):
    # +-10% is the bar for every row; the one calibrated constant (a100-dgx matmul
    # efficiency) was fitted on rows 1, 3, 5, 7, 9, so row 10 is held out.
    r = megatron_table1.table1_rows()[row - 1]
    res = megatron_table1.run_row(r, do_search=False)
    published = r["achieved_TFLOPs_per_gpu"]
    assert abs(res["megatron_tflops"] - published) / published <= 0.10, res["megatron_tflops"]


def test_search_is_never_worse_than_megatron_and_prunes_what_does_not_fit():
    r = megatron_table1.table1_rows()[4]  # 39B on 512 GPUs, t=8 p=2 d=32
    model, inputs = megatron_gpt(dict(hidden=8192, layers=48, heads=64), batch=1536)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=64, gpus_per_node=8)
    # microbatch 1 per replica (Megatron's) keeps the test to one trace; the benchmark
    # searches all sizes
    cfg = autopar.Config()
    layers = LayerSolver(model, inputs, mesh, cfg, ())
    # Megatron's hand setups (no ZeRO: one dp reduction a step, as autopar's pipelines run them
    # too): the search must find one at least as fast
    megatron = min((layers.price(s) for s in megatron_table1.megatron_setups(r)),
                   key=lambda c: c.step_time_s)
    result = search(model, inputs, mesh, cfg, layers=layers, replica_microbatches=(1,))
    assert result.best.step_time_s <= megatron.step_time_s
    assert all(c.fits for c in result.ranked)
    assert result.pruned and all(not c.fits and "GiB" in c.reason() for c in result.pruned)
    # each distinct (tp, sp) layer ILP is solved once, not once per setup
    assert result.layer_solves == 1 + 3 * 2 < result.evaluated


def test_175b_without_model_parallelism_is_pruned_not_chosen():
    model, inputs = megatron_gpt("gpt3-175b", batch=1024)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=128, gpus_per_node=8)
    cfg = autopar.Config(tp=1, pp=1)  # dp=1024: one sample per replica
    with pytest.raises(autopar.InfeasibleMemoryError, match="no setup fits"):
        search(model, inputs, mesh, cfg)


def test_layer_pricing_matches_the_whole_model_ilp():
    # A 4-layer GPT on 2 devices: the search prices blocks.1 of a 2-block copy and multiplies;
    # autopar.plan solves the whole 4-layer graph. With dp = 1 and one microbatch the two must
    # agree on compute + tensor-parallel communication. Not exactly: every block is charged
    # blocks.1's cost (blocks.0 differs by the reshard it reads from the embedding) and the
    # search pins layer norms to replicated (sequence_parallel=False); measured 0.4% apart.
    model, inputs = build("gpt", dim=256, heads=4, layers=4, batch=4, seq=32)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)
    whole = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2, dp=1, pp=1))
    layers = LayerSolver(model, inputs, mesh, autopar.Config(), ())
    cost = layers.price(Setup(1, 2, 1, 4, 1, "none", 1, "none", 0, False))
    assert cost.parts["pipeline_s"] == pytest.approx(whole.predicted["step_time_s"], rel=0.02)


@pytest.mark.parametrize("mixed_precision", [None, "bf16"])
def test_layer_costs_count_a_tied_weight_once_per_unit_reading_it(mixed_precision):
    """GPT's embedding is tied to its LM head: the search's units hold the model's parameters,
    the tied one in ``pre`` and ``post`` (a pipeline's first and last stage each keep a copy)
    and once in a stage holding both. The fp32 export names the tied weight by its second use
    and leaves the first name unread; that name was counted in ``pre`` again (8% of this
    model's state there), which the autocast trace, naming it once, did not."""
    model, inputs = build("gpt", dim=64, heads=4, layers=4, batch=4, seq=16)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)
    lc = LayerSolver(model, inputs, mesh, autopar.Config(mixed_precision=mixed_precision),
                     ()).costs(1, 4, False)
    shapes = {n: p.numel() for n, p in model.named_parameters()}  # (a tied weight once)
    tied = model.wte.weight.numel()
    assert lc.tied_elements == tied
    assert lc.pre.param_elements == shapes["wte.weight"] + shapes["wpe.weight"]
    assert lc.post.param_elements == tied + shapes["ln_f.weight"] + shapes["ln_f.bias"]
    assert lc.pre.param_elements + lc.post.param_elements - lc.tied_elements \
        + lc.num_blocks * lc.block.param_elements == sum(shapes.values())


def _uniform(f: float, b: float, blocks: int) -> LayerCosts:
    zero = UnitCosts(0, 0, 0, 0, 0, 0, 0)
    block = UnitCosts(f, b, 0, 0, 1e9, 1e8, 1e8, attention_forward_s=f / 4, attention_bytes=5e7)
    return LayerCosts(zero, block, zero, blocks, 0, 0, 0, 1e7, 2, "adam")


def test_closed_form_memory_counts_a_transient_once_a_rank_and_the_weight_copies_as_saved():
    """The closed form's two autocast-era memory terms, on synthetic layer costs (16 blocks,
    1 GB saved each, few parameters): a backward op's transient is held once per rank (one of
    its stages computes at a time), the loss's on the last stage with every value saved,
    ``pre``'s after the blocks' values are freed; the bf16 weight copies are saved values
    that a plan without a pipeline does not keep under ZeRO-3, and a pipeline stage does."""
    topo = autopar.Mesh.virtual("a100-dgx").topology
    zero = UnitCosts(0, 0, 0, 0, 0, 0, 0)
    block = UnitCosts(1.0, 2.0, 0, 0, 1e9, 1e9, 1e6)
    lc = LayerCosts(zero, block, zero, 16, 0, 0, 0, 1e7, 2, "adam")

    def added(setup: Setup, **units: UnitCosts) -> list[float]:
        base, more = (price_setup(x, setup, topo, 1e15).rank_memory_bytes
                      for x in (lc, dataclasses.replace(lc, **units)))
        return [b - a for a, b in zip(base, more)]

    transient = lambda u, t: dataclasses.replace(u, backward_transient_bytes=t)  # noqa: E731
    inter = Setup(1, 1, 2, 1, 8, "interleaved-1f1b", 2, "none", 0, False)
    assert added(inter, block=transient(block, 5e8)) == pytest.approx([5e8, 5e8])  # not 1e9
    assert added(inter, block=transient(block, 5e8), post=transient(zero, 7e8)) == \
        pytest.approx([5e8, 7e8])
    assert added(inter, pre=transient(zero, 1e8)) == pytest.approx([0.0, 0.0])  # blocks freed
    copies = dataclasses.replace(block, regathered_bytes=3e8)
    flat = Setup(2, 1, 1, 1, 1, "none", 1, "none", 3, False, grad_sync="gathered")
    piped = Setup(2, 1, 2, 1, 8, "1f1b", 1, "none", 3, False, grad_sync="regathered")
    assert added(flat, block=copies) == pytest.approx([-16 * 3e8])
    assert added(piped, block=copies) == pytest.approx([0.0, 0.0])


def test_step_model_reduces_to_megatron_closed_forms():
    topo = autopar.Mesh.virtual("a100-dgx").topology
    lc = _uniform(1.0, 2.0, 16)
    one = price_setup(lc, Setup(1, 1, 4, 1, 8, "1f1b", 1, "none", 0, False), topo, 1e15)
    # Eq. 1: (m + p - 1) (t_f + t_b) with 4 blocks per stage
    assert one.parts["pipeline_s"] == pytest.approx((8 + 3) * 4 * 3.0)
    inter = price_setup(lc, Setup(1, 1, 4, 1, 8, "interleaved-1f1b", 2, "none", 0, False), topo, 1e15)
    # interleaved: bubble (p - 1) / v of a rank's per-microbatch time
    assert inter.parts["bubble_s"] == pytest.approx(3 * 4 * 3.0 / 2)
    full = price_setup(lc, Setup(1, 1, 4, 1, 8, "1f1b", 1, "full", 0, False), topo, 1e15)
    assert full.parts["pipeline_s"] == pytest.approx((8 + 3) * 4 * 4.0)  # forward again
    assert max(full.rank_memory_bytes) < max(one.rank_memory_bytes)
    sel = price_setup(lc, Setup(1, 1, 4, 1, 8, "1f1b", 1, "selective", 0, False), topo, 1e15)
    assert one.step_time_s < sel.step_time_s < full.step_time_s
    z = price_setup(lc, Setup(8, 1, 4, 1, 8, "1f1b", 1, "none", 1, False), topo, 1e15)
    z0 = price_setup(lc, Setup(8, 1, 4, 1, 8, "1f1b", 1, "none", 0, False), topo, 1e15)
    # ZeRO-1 keeps 6 + 12/8 of 18 bytes per parameter (Megatron's distributed optimizer)
    state = 4 * 1e9
    assert z0.rank_memory_bytes[0] - z.rank_memory_bytes[0] == pytest.approx(state * (12 - 1.5) / 18)


def test_balanced_stages_give_the_heavy_last_stage_fewer_blocks():
    first, last = blocks_per_stage(8, 2, 0.0, 3.0, 1.0)  # the last stage also runs 3 s of head
    assert first + last == 8 and last < first and max(first, last + 3.0) == 6.0  # the optimum
    assert sum(blocks_per_stage(96, 8, 0.5, 2.0, 1.0)) == 96


def test_candidates_keep_tensor_parallelism_inside_a_node_and_respect_the_config():
    setups = list(candidate_setups(64, 8, 256, 16, autopar.Config()))
    assert setups and all(s.tp <= 8 and s.dp * s.tp * s.pp == 64 for s in setups)
    assert {s.recompute for s in setups} == {"none", "selective", "full"}
    assert {s.schedule for s in setups} >= {"none", "1f1b", "interleaved-1f1b"}
    fixed = list(candidate_setups(64, 8, 256, 16, autopar.Config(tp=4, zero=1, recompute="full")))
    assert fixed and all(s.tp == 4 and s.recompute == "full" and (s.zero or s.dp == 1) for s in fixed)


def test_searched_plan_is_runnable_with_alternatives_stage_memory_and_round_trips(tmp_path):
    model, inputs = megatron_gpt(dict(hidden=1024, layers=8, heads=16), batch=64, seq=512)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=2, gpus_per_node=8)
    told: list[str] = []
    plan = autopar.search(model, mesh, inputs, config=autopar.Config(pp=2, microbatch_size=2),
                          top_k=3, progress=told.append)
    assert plan.degrees["pp"] == 2 and len(plan.alternatives) == 3
    # progress through the per-operator placements too (minutes for a large model)
    assert any(re.match(r"traced the model and its \d+ pipeline stages", m) for m in told), told
    assert any(m.startswith("placed stage 0") for m in told), told
    assert all(a["step_time_s"] >= plan.predicted["search_step_time_s"] for a in plan.alternatives)
    assert plan.solver["path"] == "setup search + per-operator ILPs"
    pipe = plan.pipeline
    # runnable: every stage has its per-operator placements, every parameter a placement
    assert len(pipe.stages) == pipe.num_stages and all(st.nodes for st in pipe.stages)
    assert set(plan.params) == {n for n, _ in model.named_parameters()}
    assert len(pipe.predicted["stage_memory_bytes"]) == pipe.num_stages
    # the search's memory (closed form) against the per-operator model's: it counts the
    # gradients the backward makes beside the saved values (a stage's backward holds them until
    # it returns), their sum over the microbatches, the pipeline's receive buffers and the
    # backward's largest transient as the latter does. Measured 2026-11-29: 0.852 GiB against
    # 0.874 on the first stage (-2.5%); -9.3% (0.792) when the closed form freed the saved
    # values as the gradients were made. (Earlier the stage ILP replicated the attention
    # projection over tp where the layer ILP split it: -21%; and until the tied embedding was
    # counted once, its second count, 236 MB, hid that.) 5% is the planner's bar for memory
    # under-predicted between its two models.
    assert plan.predicted["search_peak_memory_bytes"] >= 0.95 * max(pipe.predicted["stage_memory_bytes"])
    assert set(plan.techniques) >= {"recompute", "zero", "sequence_parallel", "microbatches"}
    text = str(plan)
    assert "stage peak MiB" in text and "techniques" in text and "pipeline bubble" in text
    parts = plan.step_breakdown()  # the step of pmodel.step(), then the optimizer
    assert parts["total_s"] == pytest.approx(plan.predicted["step_time_s"]
                                             + plan.predicted["optimizer_s"], rel=1e-12)
    assert sum(parts[k] for k in ("compute_s", "exposed_comm_s", "bubble_s", "optimizer_s")) \
        == pytest.approx(parts["total_s"], rel=1e-9)
    assert parts["bubble_s"] > 0 and parts["optimizer_s"] > 0 and parts["exposed_comm_s"] > 0
    # model FLOPs without recomputation: 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (Narayanan et
    # al., SC'21, Eq. 3 with 3 instead of 4 passes); the graph also counts the attention
    # scaling, softmax and norms' few FLOPs, so it is a little above
    b, s_, l_, h, v = 64, 512, 8, 1024, 51200
    eq3 = 72 * b * s_ * l_ * h**2 * (1 + s_ / (6 * h) + v / (12 * l_ * h))
    assert 1.0 <= plan.predicted["model_flops"] / eq3 < 1.02
    assert 0 < plan.predicted["mfu"] < 1
    plan.save(tmp_path / "p.json")
    again = autopar.Plan.load(tmp_path / "p.json")
    assert again == plan and again.digest() == plan.digest()
    json.loads(again.to_json())
    # the plan names the model it was made for, and no other
    assert plan.model_fingerprint == model_fingerprint(model, inputs)
    small, small_inputs = build("gpt")
    assert plan.model_fingerprint != model_fingerprint(small, small_inputs)


def test_a_planning_view_saved_by_an_earlier_search_is_refused(tmp_path):
    model, inputs = build("gpt")
    plan = autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2), inputs)
    old = plan.to_dict()
    old["solver"] = {**old["solver"], "status": "search"}  # as autopar.search saved it before
    (tmp_path / "view.json").write_text(json.dumps(old))
    with pytest.raises(autopar.PlanError, match="planning view"):  # it has no placements to run
        autopar.parallelize(model, autopar.Mesh.virtual("cpu-gloo", gpus_per_node=1), inputs,
                            plan=tmp_path / "view.json")


def test_setups_skipped_by_their_bound_could_not_have_won():
    # A setup with tp > 1 whose layer ILP is not solved yet is skipped when its lower bound
    # (LayerSolver.bound: the one-device layer costs divided by tp, no collectives) is no
    # better than the best setup found: every bound is below the setup's price, and the search
    # finds the best setup that pricing every candidate finds. A setup with a lighter twin
    # that fits (less recomputation) is not priced: it is never the answer. (ZeRO-1 forced:
    # free, the best is a setup without ZeRO, whose ZeRO-1 twins, priced faster, would bound
    # others but are dropped, so nothing is bounded.)
    model, inputs = megatron_gpt(dict(hidden=1024, layers=8, heads=16), batch=64, seq=512)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=2, gpus_per_node=8)
    cfg = autopar.Config(pp=2, schedule="1f1b", zero=1)
    layers = LayerSolver(model, inputs, mesh, cfg, ())
    result = search(model, inputs, mesh, cfg, layers=layers)
    assert result.bounded > 0 and result.twins > 0
    every = [layers.price(s) for s in candidate_setups(16, 8, 64, 8, cfg, seq=512)
             if not (s.sequence_parallel and not layers.shards_sequence(s.microbatch_size))]
    for c in every[::7]:
        if c.setup.tp > 1:
            low = layers.bound(c.setup, c.budget_bytes)
            assert low.step_time_s <= c.step_time_s * (1 + 1e-12), c.setup.describe()
            assert max(low.rank_memory_bytes) <= max(c.rank_memory_bytes) * (1 + 1e-12)
    # (as the search prices them: the better of balanced and even stages, recomputation and
    # ZeRO only where needed)
    priced = [min(c, layers.price(dataclasses.replace(c.setup, even_split=True)),
                  key=lambda x: (not x.fits, x.step_time_s)) for c in every]
    kept = only_when_needed([c for c in priced if c.fits])
    best = min(kept, key=lambda c: c.step_time_s)
    assert result.best.step_time_s == pytest.approx(best.step_time_s, rel=1e-12)
    # the setups ranked are those pricing every one keeps, but for those skipped by their bound
    ranked = {c.setup.describe(): c.step_time_s for c in result.ranked}
    missing = [c for c in kept if c.setup.describe() not in ranked]
    assert len(ranked) + len(missing) == len(kept) and ranked.keys() <= {c.setup.describe() for c in kept}
    assert 0 < len(missing) and all(c.setup.tp > 1 and c.step_time_s >= best.step_time_s
                                    for c in missing)


def test_a_pipeline_is_searched_when_only_it_fits_on_one_node():
    # On one node pipelines are searched only when nothing without one fits; a skipped setup
    # (here sequence parallelism on a model whose RMSNorm is written out: nothing to split)
    # must not end the search before them
    model, inputs = build("llama", layers=4)
    mesh = autopar.Mesh.virtual("h100-dgx", gpus_per_node=2)
    need = {}
    for pp in (1, 2):
        with pytest.raises(autopar.InfeasibleMemoryError) as e:
            search(model, inputs, mesh, autopar.Config(pp=pp, memory_bytes=1.0))
        need[pp] = e.value.required_bytes
    assert need[2] < need[1]
    budget = (need[1] + need[2]) / 2
    result = search(model, inputs, mesh, autopar.Config(memory_bytes=budget))
    assert result.best.setup.pp == 2 and result.best.fits


def test_the_bound_is_below_the_price_for_experts_full_recomputation_and_interleaving():
    # LayerSolver.bound from one-device costs against the price of costs that split them ideally
    # over tp = 2 (and add collectives): MoE experts' work, full recomputation (which does not
    # run the experts again), an interleaved schedule (priced as the better of balanced and
    # even stages)
    from autopar.cost_models.experts import ExpertsWork

    topo = autopar.Mesh.virtual("h100-dgx").topology

    def costs(k: float, comm: float) -> LayerCosts:
        work = ExpertsWork(4e11 / k, 1e8 / k, 1e9 / k, itemsize=2)
        block = UnitCosts(1e-3 / k + comm + work.seconds(topo), 2e-3 / k + comm, comm, comm,
                          1e9 / k, 1e8 / k, 1e8 / k, attention_forward_s=2e-4 / k,
                          attention_bytes=2e7 / k, expert_elements=5e7 / k,
                          expert_state_bytes=5e8 / k, expert_forward_bytes=(1e6, 1e7, 1e7),
                          expert_backward_bytes=(1e6, 2e7, 1e7), expert_forward_work=work,
                          expert_backward_work=work,
                          expert_forward_s=work.seconds(topo))
        pre = UnitCosts(3e-3 / k, 6e-3 / k, 0, 0, 2e8 / k, 1e7 / k, 2e7 / k)
        return LayerCosts(pre, block, pre, 16, 0, 0, 1e7, 1e7 / k, 2, "adam")

    solver = LayerSolver.__new__(LayerSolver)
    solver.mesh = autopar.Mesh.virtual("h100-dgx", nodes=4, gpus_per_node=8)
    solver.costs = lambda tp, b, sp, cp=1: costs(1, 0.0) if tp == 1 else costs(tp, 5e-5)
    checked = 0
    for rc in ("none", "selective", "full"):
        for schedule, v in (("1f1b", 1), ("interleaved-1f1b", 2)):
            for ep in (1, 4):
                setup = Setup(8, 2, 2, 1, 16, schedule, v, rc, 1, False, grad_sync="gathered",
                              ep=ep)
                price = min(price_setup(costs(2, 5e-5), dataclasses.replace(setup, even_split=e),
                                        topo, 80e9).step_time_s for e in (False, True))
                assert solver.bound(setup, 80e9).step_time_s <= price, setup.describe()
                checked += 1
    assert checked == 12


def _old_twin_key(setup):
    """The twin key only_when_needed compared before Twins (kept here as the reference)."""
    return dataclasses.replace(setup, even_split=False, grad_sync="step",
                               dp_shard=setup.dp_shard if setup.zero else 0)


def test_twins_find_a_lighter_twin_exactly_as_the_key_rule_did():
    """Twins.has_lighter against the rule only_when_needed applied with one key per twin: on
    setups differing in recomputation, ZeRO stage (0, 1, 3), shard group, stage split, gradient
    sync and degrees, every pair of (set, setup)."""
    base = Setup(8, 2, 2, 1, 4, "1f1b", 1, "none", 0, False)
    setups = [dataclasses.replace(base, recompute=r, zero=z, dp_shard=d, even_split=e,
                                  grad_sync=g, dp=dp)
              for r in RECOMPUTE for z in (0, 1, 3) for d in (0, 2) for e in (False, True)
              for g in ("step", "gathered") for dp in (8, 4)]
    def old_rule(setup, fits):
        keys = {_old_twin_key(c) for c in fits}
        r = RECOMPUTE.index(setup.recompute)
        return any(_old_twin_key(dataclasses.replace(setup, recompute=r2, zero=z2)) in keys
                   for r2 in RECOMPUTE[:r + 1] for z2 in range(setup.zero + 1)
                   if (r2, z2) != (setup.recompute, setup.zero))
    import random
    rng = random.Random(0)
    found = 0
    for _ in range(40):
        fits = rng.sample(setups, 12)
        twins = Twins()
        for c in fits:
            twins.add(c)
        for st in setups:
            assert twins.has_lighter(st) == old_rule(st, fits), (st, fits)
            found += twins.has_lighter(st)
    assert found > 100  # (the sets do hold lighter twins)
