"""Part 4's techniques on one process: recomputation (selection, pass, pricing), ZeRO's
placement, mixed-precision capture, and the choice of recomputation / ZeRO by memory.

The multi-process numerics, collective counts and measured memory of each technique are in
tests/distributed/test_equivalence.py.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.utils._pytree import tree_flatten

import autopar
from autopar.capture import capture
from autopar.capture.remat import TAG, is_random, recompute_nodes
from autopar.passes.recompute import recompute_pass
from autopar.model_presets import megatron_gpt
from autopar.planning.candidates import memory_techniques
from autopar.cost_models.sharding import zero_once_placement, zero_placement
from models import build


def _feeds(traced, model, inputs):
    """Real inputs of the joint graph: parameters, user inputs, the loss tangent (1)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    by_node = {p.node: params[p.name].detach() for p in traced.params}
    user = iter(inputs)
    out = []
    for n in traced.gm.graph.nodes:
        if n.op != "placeholder":
            continue
        if n.name in by_node:
            out.append(by_node[n.name])
        elif n.name in traced.tangent_nodes:
            out.append(torch.ones(()))
        else:
            out.append(next(user))
    return out


def _saved_forward_values(gm: torch.fx.GraphModule) -> set[str]:
    """Forward nodes some backward node reads (what stays alive between the passes)."""
    fwd = {n for n in gm.graph.nodes if n.op == "call_function"
           and n.meta.get("partitioner_tag") != "is_backward"}
    return {a.name for n in gm.graph.nodes if n.op == "call_function" and n not in fwd
            for a in n.all_input_nodes if a in fwd}


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_recompute_pass_keeps_every_number_and_saves_fewer_values(policy):
    model, inputs = build("gpt", layers=2)
    traced = capture(model, inputs)
    picked = recompute_nodes(traced, policy)
    assert picked and all(traced.node_layer[n].startswith("blocks.") for n in picked)
    gm = copy.deepcopy(traced.gm)
    for n in gm.graph.nodes:
        if n.name in picked:
            n.meta[TAG] = True
    before = _saved_forward_values(gm)
    gm = recompute_pass(gm)
    after = _saved_forward_values(gm)
    assert not any(TAG in n.meta for n in gm.graph.nodes)  # torch's partitioner would act on it
    assert not (after & picked), "a recomputed value is still read by the backward"
    assert len(after) < len(before)
    feeds = _feeds(traced, model, inputs)
    ref = torch.fx.Interpreter(traced.gm).run(*feeds)
    out = torch.fx.Interpreter(gm).run(*feeds)
    ref, out = tree_flatten(ref)[0], tree_flatten(out)[0]
    assert len(ref) == len(out)
    for a, b in zip(ref, out):
        if isinstance(a, torch.Tensor):  # same ops on the same inputs: bit-identical
            assert torch.equal(a, b)


def test_full_recompute_keeps_block_outputs_and_selective_takes_the_attention_core():
    model, inputs = build("gpt", layers=2)
    traced = capture(model, inputs)
    full = recompute_nodes(traced, "full")
    nodes = {n.name: n for n in traced.gm.graph.nodes}
    # each block's output (read by the next block or the head) is saved, not recomputed
    for n in nodes.values():
        layer = traced.node_layer.get(n.name, "")
        if layer and n.meta.get("partitioner_tag") == "is_forward" and any(
                traced.node_layer.get(u.name) != layer and u.meta.get("partitioner_tag") == "is_forward"
                for u in n.users):
            assert n.name not in full, n.name
    sdpa = {n for n in recompute_nodes(traced, "selective")
            if "scaled_dot_product" in str(nodes[n].target)}
    assert len(sdpa) == 2  # the fused attention op of each block
    # explicit attention (Megatron's layer): every softmax-shaped value of the block
    mega, mega_inputs = megatron_gpt(dict(hidden=64, layers=2, heads=4), batch=2, seq=32, vocab=128)
    t2 = capture(mega, mega_inputs)
    sel = recompute_nodes(t2, "selective")
    shapes = {tuple(t2.node(n).meta["val"].shape) for n in sel
              if isinstance(t2.node(n).meta.get("val"), torch.Tensor)}
    assert any(s[-2:] == (32, 32) for s in shapes), shapes
    softmax = [n.name for n in t2.gm.graph.nodes if "_softmax.default" == str(n.target).split("aten.")[-1]]
    assert softmax and set(softmax) <= sel


def test_recompute_is_priced_as_compute_and_memory():
    model, inputs = build("gpt", dim=128, layers=2, batch=8, seq=64)
    mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=1)
    plans = {r: autopar.plan(model, mesh, inputs, config=autopar.Config(recompute=r))
             for r in ("none", "selective", "full")}
    mem = {r: p.predicted["peak_memory_bytes"] for r, p in plans.items()}
    comp = {r: p.predicted["compute_s"] for r, p in plans.items()}
    assert mem["full"] < mem["selective"] < mem["none"]
    assert comp["none"] < comp["selective"] < comp["full"]
    assert all(p.techniques["recompute"] == r for r, p in plans.items())


def test_zero_placement_shards_a_free_dim_over_dp():
    # mesh (dp=2, tp=2): a column-parallel weight [out, in] sharded S(0) on tp gets S(1) on dp
    assert zero_placement((Replicate(), Shard(0)), (64, 32), (2, 2), (0,)) == (Shard(1), Shard(0))
    assert zero_placement((Replicate(), Replicate()), (64, 32), (2, 2), (0,)) == (Shard(0), Replicate())
    # a bias sharded on its only dim by tp, or a dim that does not divide, stays replicated
    assert zero_placement((Replicate(), Shard(0)), (64,), (2, 2), (0,)) == (Replicate(), Shard(0))
    assert zero_placement((Replicate(),), (3,), (2,), (0,)) == (Replicate(),)


def test_zero_once_placement_shards_over_one_data_axis_the_innermost_that_divides():
    # a pipeline stage's once-a-step buckets move a tensor over one mesh axis, so ZeRO stores a
    # parameter over one data axis: mesh (dp=2, ep=4), a dense weight over ep (the inner axis)
    R, S = Replicate(), Shard
    assert zero_once_placement((R, R), (64, 32), (2, 4), (0, 1)) == (R, S(0))
    assert zero_placement((R, R), (64, 32), (2, 4), (0, 1)) == (S(0), S(1))  # (every run: both)
    # an expert weight the program splits over ep: over dp
    assert zero_once_placement((R, S(0)), (8, 64, 32), (2, 4), (0, 1)) == (S(1), S(0))
    # no dim divides by the inner axis: the outer one
    assert zero_once_placement((R, R), (6,), (2, 4), (0, 1)) == (S(0), R)
    # nothing divides: stored as computed
    assert zero_once_placement((R, R), (3,), (2, 4), (0, 1)) == (R, R)


def test_zero_plan_shards_parameters_and_state_over_dp():
    # large batch, narrow layers on A100s: plain data parallelism (as in test_equivalence)
    model, inputs = build("gpt", dim=64, layers=2, batch=256, seq=128)
    mesh = autopar.Mesh.virtual("a100-dgx", gpus_per_node=2)
    plain = autopar.plan(model, mesh, inputs, config=autopar.Config(dp=2))
    zero = autopar.plan(model, mesh, inputs, config=autopar.Config(dp=2, zero=1))
    assert zero.degrees == plain.degrees == {"dp": 2, "tp": 1, "pp": 1, "cp": 1, "ep": 1}
    sharded = [n for n, p in zero.params.items() if p[0].startswith("S")]
    assert len(sharded) == len(zero.params)  # every GPT parameter has a dim divisible by 2
    # every gradient all-reduce of plain data parallelism becomes a reduce-scatter
    # (the 4-byte all-reduce is the scalar loss's gradient, in both)
    def grad_reductions(plan: autopar.Plan, kind: str) -> list:
        return [c for c in plan.collectives if c.phase == "backward" and c.kind == kind and c.bytes > 4]

    alone, zero_alone = (autopar.plan(model, mesh, inputs, config=autopar.Config(
        dp=2, zero=z, bucket_bytes=0)) for z in (0, 1))
    assert len(grad_reductions(alone, "all_reduce")) == 28  # 29 parameters, one tied
    assert len(grad_reductions(zero_alone, "reduce_scatter")) == 28
    assert not grad_reductions(zero, "all_reduce") and not grad_reductions(zero_alone, "all_reduce")
    # with buckets (the planner picks the cap; these 0.5 MB fit the first one, of 1 MiB), one
    # all-reduce moves the same bytes, and with ZeRO one reduce-scatter
    for bucketed, one_each, kind in ((plain, alone, "all_reduce"),
                                     (zero, zero_alone, "reduce_scatter")):
        merged = grad_reductions(bucketed, kind)
        assert len(merged) == len(bucketed.grad_buckets) == 1
        assert len(bucketed.grad_buckets[0]) == 28
        assert sum(c.bytes for c in merged) == sum(c.bytes for c in grad_reductions(one_each, kind))
    # per parameter element: 16 B of state becomes 16/dp, plus the 4 B gathered copy
    assert zero.predicted["state_bytes"] == pytest.approx(plain.predicted["state_bytes"] * (8 + 4) / 16, rel=0.01)


def test_zero3_gathers_parameters_again_for_the_backward_and_holds_less():
    model, inputs = build("gpt", dim=64, layers=2, batch=256, seq=128)
    mesh = autopar.Mesh.virtual("a100-dgx", gpus_per_node=2)
    one, three = (autopar.plan(model, mesh, inputs, config=autopar.Config(dp=2, zero=z, bucket_bytes=0))
                  for z in (1, 3))
    assert (one.techniques["zero"], three.techniques["zero"]) == (1, 3)
    assert three.params == one.params  # stored as ZeRO-1 stores them: sharded over dp

    def listed(plan: autopar.Plan, phase: str, gathers: bool) -> list:
        return sorted((c.kind, c.axis, c.bytes) for c in plan.collectives if c.phase == phase
                      and (c.kind == "all_gather") == gathers)

    def gathered(plan: autopar.Plan, phase: str) -> int:
        return sum(b for *_, b in listed(plan, phase, True))

    # ZeRO-3 moves what ZeRO-1 moves in the forward; both gather each layer's parameters as
    # one flat all-gather (passes.gather_buckets): fewer collectives than parameters
    assert listed(three, "forward", True) == listed(one, "forward", True)
    for phase in ("forward", "backward"):
        assert listed(three, phase, False) == listed(one, phase, False)
    assert 0 < len(listed(one, "forward", True)) < len(list(model.parameters()))
    # what ZeRO-3 adds: all-gathers over dp of parameters the backward reads, each at most
    # once as the forward gathered it; at least the 9 matmul weights (4 per block and the
    # tied head), whose input gradients read them
    assert {a for _, a, _ in listed(three, "backward", True)} == {"dp"}
    extra = gathered(three, "backward") - gathered(one, "backward")
    weights = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                  if p.dim() == 2 and name != "wpe.weight")
    assert weights <= extra <= gathered(three, "forward")
    assert three.predicted["peak_memory_bytes"] < one.predicted["peak_memory_bytes"]
    assert three.predicted["comm_s"] > one.predicted["comm_s"]
    with pytest.raises(ValueError, match="ZeRO stage of"):
        autopar.Config(zero=4)


def test_memory_decides_recompute_and_zero_when_left_to_the_planner():
    assert [(c.recompute, c.zero) for c in memory_techniques(autopar.Config())][:2] == [("none", 0), ("none", 1)]
    model, inputs = build("gpt", dim=64, layers=2, batch=256, seq=128)
    mesh = autopar.Mesh.virtual("a100-dgx", gpus_per_node=2)
    free = autopar.plan(model, mesh, inputs, config=autopar.Config(dp=2))
    assert (free.techniques["recompute"], free.techniques["zero"]) == ("none", 0)
    need = free.predicted["peak_memory_bytes"]
    tight = autopar.plan(model, mesh, inputs, config=autopar.Config(dp=2, memory_bytes=0.8 * need))
    assert (tight.techniques["recompute"], tight.techniques["zero"]) != ("none", 0)
    assert tight.predicted["peak_memory_bytes"] <= 0.8 * need
    with pytest.raises(autopar.PlanError, match="memory budget"):
        autopar.plan(model, mesh, inputs, config=autopar.Config(dp=2, memory_bytes=0.05 * need))


def test_bf16_mixed_precision_traces_bf16_matmuls_and_fp32_gradients():
    model, inputs = build("gpt", layers=1)
    traced = capture(model, inputs, "bf16")
    mms = [n for n in traced.gm.graph.nodes if str(n.target) in ("aten.mm.default", "aten.addmm.default")]
    assert mms and all(n.meta["val"].dtype == torch.bfloat16 for n in mms)
    out = next(n for n in traced.gm.graph.nodes if n.op == "output")
    grads = [out.args[0][p.grad_output_index] for p in traced.params
             if p.grad_output_index is not None and out.args[0][p.grad_output_index] is not None]
    assert grads and all(g.meta["val"].dtype == torch.float32 for g in grads)  # fp32 master grads
    plan = autopar.plan(model, autopar.Mesh.virtual("cpu-gloo", gpus_per_node=1), inputs,
                        config=autopar.Config(mixed_precision="bf16"))
    assert plan.techniques["mixed_precision"] == "bf16-autocast"
    with pytest.raises(ValueError, match="mixed_precision"):
        autopar.Config(mixed_precision="fp16")


@pytest.mark.slow  # 18 s (two searches and their per-operator solves): the default suite's time
def test_search_turns_recompute_and_zero_on_only_when_memory_requires_it():
    model, inputs = megatron_gpt(dict(hidden=1024, layers=8, heads=16), batch=16, seq=1024)
    mesh = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=8)
    cfg = dict(tp=2, pp=1)  # degrees fixed: memory is met by the techniques
    roomy = autopar.search(model, mesh, inputs, config=autopar.Config(**cfg))
    assert (roomy.techniques["recompute"], roomy.techniques["zero"]) == ("none", 0)
    need = roomy.predicted["peak_memory_bytes"]
    tight = autopar.search(model, mesh, inputs, config=autopar.Config(memory_bytes=0.7 * need, **cfg))
    assert (tight.techniques["recompute"], tight.techniques["zero"]) != ("none", 0)
    # found by the search (again, within a budget cut by how far its first pick's walked peak
    # was over), not by the per-unit fallback
    assert tight.solver["path"] == "setup search + per-operator ILPs", tight.solver["path"]
    assert tight.predicted["peak_memory_bytes"] <= 0.7 * need


def test_selective_takes_only_the_attention_core_and_nothing_random():
    # seq == head_dim (16): q, k, v, the scores and a [b, s, h] slice all have 1024 elements per
    # sample; the core is still only the scores-to-softmax chain of each block
    model, inputs = build("gpt", layers=2, explicit=1, dim=64, heads=4, seq=16)
    traced = capture(model, inputs)
    sel = recompute_nodes(traced, "selective")
    ops = {str(traced.node(n).target).split(".")[1] for n in sel}
    assert "_softmax" in ops and "bmm" in ops
    assert not ops & {"add", "native_layer_norm", "addmm", "gelu"}, ops
    assert len(sel) <= 2 * 10
    # a dropout (random) value, or a getitem of one, is never recomputed: its mask would change
    mega, mega_inputs = megatron_gpt(dict(hidden=64, layers=2, heads=4), batch=2, seq=32, vocab=128)
    t2 = capture(mega, mega_inputs)
    for policy in ("selective", "full"):
        picked = recompute_nodes(t2, policy)
        assert picked and not any(is_random(t2.node(n)) for n in picked), policy
        assert not any(str(t2.node(n).target) == "<built-in function getitem>" and
                       "dropout" in str(t2.node(n).args[0].target) for n in picked), policy


def test_a_setting_that_changes_nothing_is_recorded_as_off():
    model, inputs = build("mlp")
    mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2)
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(tp=2, recompute="full", zero=1))
    assert (plan.techniques["recompute"], plan.techniques["zero"]) == ("none", 0)
    assert any("nothing to recompute" in w for w in plan.warnings)
    assert any("zero=1 shards nothing" in w for w in plan.warnings)
    # bf16 autocast is held by both planning paths: per-unit ILPs (a model without repeated
    # blocks) and the setup search, whose pipeline stages are traced under autocast too (run
    # against one process in tests/distributed/test_pipeline.py)
    mlp_bf16 = autopar.search(model, mesh, inputs, config=autopar.Config(mixed_precision="bf16"))
    assert "per-unit" in mlp_bf16.solver["path"]
    assert mlp_bf16.techniques["mixed_precision"] == "bf16-autocast"
    gpt, gpt_inputs = build("gpt", batch=8)
    piped = autopar.plan(gpt, mesh, gpt_inputs,
                         config=autopar.Config(pp=2, microbatch_size=2, mixed_precision="bf16"))
    assert piped.solver["path"] == "setup search + per-operator ILPs"
    assert piped.pipeline is not None and piped.techniques["mixed_precision"] == "bf16-autocast"


def test_forced_sequence_parallelism_is_honoured_or_refused_and_an_idle_axis_is_named():
    # Hugging Face Llama normalises with an RMSNorm written out (no aten.native_layer_norm), so
    # autopar's sequence parallelism has nothing to shard: forced, it is refused (before, the
    # plan said sequence_parallel=True and sharded nothing, silently)
    mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2)
    llama, llama_inputs = build("llama", layers=2, dim=64, heads=4, batch=4)
    with pytest.raises(autopar.PlanError, match="sequence_parallel=True.*cannot hold"):
        autopar.plan(llama, mesh, llama_inputs,
                     config=autopar.Config(tp=2, dp=1, pp=1, sequence_parallel=True))
    # tp=2 forced on a model too small to gain: every op replicated over the axis, which the
    # plan says, naming what would cost the same
    plan = autopar.plan(llama, mesh, llama_inputs, config=autopar.Config(tp=2, dp=1, pp=1))
    assert not plan.techniques["sequence_parallel"]
    assert any("'tp' (2 devices) splits nothing" in w and "tp=1 on 1 device" in w
               for w in plan.warnings), plan.warnings
    # the plain GPT has layer norms: forced sequence parallelism holds
    gpt, gpt_inputs = build("gpt", layers=2, dim=64, heads=4, batch=4)
    plan = autopar.plan(gpt, mesh, gpt_inputs,
                        config=autopar.Config(tp=2, dp=1, pp=1, sequence_parallel=True))
    assert plan.techniques["sequence_parallel"]


def test_pipeline_settings_without_a_pipeline_are_refused_not_dropped():
    """Config.schedule / virtual_stages / microbatch_size describe a pipeline: a plan without
    one (the planner free to choose pp, and choosing 1) stops with the fix, instead of running
    the whole batch at once under a schedule that was never applied."""
    model, inputs = build("gpt", batch=8)
    mesh = autopar.Mesh.virtual("cpu-gloo", gpus_per_node=2)
    for field, value in (("schedule", "1f1b"), ("virtual_stages", 2)):
        with pytest.raises(autopar.PlanError, match=f"{field}=.*describes a pipeline.*pp > 1"):
            autopar.plan(model, mesh, inputs, config=autopar.Config(**{field: value}))
    # microbatches of 2 of the 8 samples: no setup without a pipeline has them (it runs the
    # whole batch), so the search plans a pipeline that holds them
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(microbatch_size=2))
    assert plan.degrees["pp"] > 1 and plan.techniques["microbatch_size"] == 2
    # the same settings with a pipeline hold in the plan
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(pp=2, schedule="1f1b", microbatch_size=2))
    assert (plan.pipeline.schedule, plan.pipeline.microbatches) == ("1f1b", 4)


class _MathPathAttention(torch.nn.Module):
    """Attention whose keys are wider than its values (as DeepSeek-V3's): scaled dot-product
    attention then runs torch's math path, a softmax of its own (``aten._safe_softmax``)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = torch.nn.Linear(16, 48), torch.nn.Linear(16, 48)
        self.v, self.o = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k = (m(x).view(b, t, 4, 12).transpose(1, 2) for m in (self.q, self.k))
        v = self.v(x).view(b, t, 4, 8).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, 32))


def test_selective_recompute_takes_the_math_path_softmax():
    """The search prices selective recomputation by the values of (seq, seq) shape; the
    per-operator plan must recompute the same values, the math path's ``_safe_softmax`` chain
    included (missed before 2026-11-26: a DeepSeek-V3 plan held 52 GiB of softmaxes the
    search had dropped)."""
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList([_MathPathAttention(), _MathPathAttention()])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = x + block(x)
            return x.square().mean()

    traced = capture(Model(), (torch.randn(2, 8, 16),))
    picked = [traced.node(n) for n in recompute_nodes(traced, "selective")]
    safe = [n for n in traced.gm.graph.nodes if n.target is torch.ops.aten._safe_softmax.default]
    assert len(safe) == 2 and all(n in picked for n in safe)
    assert all(tuple(n.meta["val"].shape[-2:]) == (8, 8) for n in picked
               if n.target is not torch.ops.aten.detach.default)
