"""A pipeline stage's joint graph unrolled from the trace of a short copy (autopar.capture.
joint_unroll): checked node for node against tracing the whole stage (ops, arguments by
position, shapes, input and output descriptors, layers), through a fake model's pipeline plan,
and traced whole where the blocks do not allow it."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import autopar
from autopar.capture import stages as stages_mod
from autopar.capture.stages import capture_stages, export_forward, microbatch_inputs
from autopar.planning import pipeline
from models import GPT, hf_moe
from plan_equality import assert_same_pipeline_plan

FOUR = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=4)


def _fake_gpt(layers: int):
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = GPT(vocab=64, dim=32, heads=2, layers=layers, seq=16)
    ids = torch.randint(0, 64, (4, 16))
    return model, (ids, ids)


def _fake_deepseek(layers: int):
    # one dense first layer, then MoE layers with a shared expert
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = hf_moe("deepseekv3", layers=layers, dense=1)
    ids = torch.randint(0, 128, (4, 32))
    return model, {"input_ids": ids, "labels": ids}


def _canonical(gm: fx.GraphModule) -> list:
    """A graph without its node names: each node's op, target (a placeholder's descriptor),
    arguments with each node as its position, output shape and dtype, phase, and the output's
    descriptors."""
    index = {n: i for i, n in enumerate(gm.graph.nodes)}
    out = []
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        desc = n.meta.get("desc")
        out.append((n.op, repr(desc) if n.op == "placeholder" else str(n.target),
                     repr(fx.node.map_arg((n.args, n.kwargs), lambda a: index[a])),
                     (tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else None,
                     n.meta.get("partitioner_tag"), repr(desc) if n.op == "output" else None))
    return out


def _layers(traced) -> list[str]:
    return [traced.node_layer[n.name] for n in traced.gm.graph.nodes if n.op != "output"]


def _trace_both(model, inputs, cut, autocast, monkeypatch):
    """The stages traced with the joint unroll (and what each trace held: its parameter count,
    and whether the unroll took) and without it."""
    chunks, _ = microbatch_inputs(inputs, 1)
    fwd = export_forward(model, inputs)
    traced_params, unrolled = [], []
    real_joint, real_unroll = stages_mod._joint, stages_mod.unroll_joint

    def joint(st, *a):
        traced_params.append(len(st.params))
        return real_joint(st, *a)

    def unroll(*a):
        unrolled.append(real_unroll(*a))
        return unrolled[-1]

    monkeypatch.setattr(stages_mod, "_joint", joint)
    monkeypatch.setattr(stages_mod, "unroll_joint", unroll)
    short = capture_stages(fwd, cut, chunks[0], autocast, copy_identical=False)
    monkeypatch.setattr(stages_mod, "alike_run", lambda *a: [])
    whole = capture_stages(fwd, cut, chunks[0], autocast, copy_identical=False)
    return short, whole, traced_params, unrolled


@pytest.mark.parametrize("kind", ["gpt", "deepseekv3-bf16"])
def test_a_stage_unrolled_from_a_short_trace_is_its_whole_trace_node_for_node(kind, monkeypatch):
    if kind == "gpt":  # pre + 4 blocks | 4 blocks | 2 blocks + post
        model, inputs = _fake_gpt(10)
        cut, autocast = (0,) * 5 + (1,) * 4 + (2,) * 3, None
    else:  # pre + dense + 3 MoE | 4 MoE | 3 MoE + post, under bf16 autocast
        model, inputs = _fake_deepseek(11)
        cut, autocast = (0,) * 5 + (1,) * 4 + (2,) * 4, torch.bfloat16
    short, whole, traced_params, unrolled = _trace_both(model, inputs, cut, autocast, monkeypatch)
    # each stage with three alike blocks or more was traced with two of them, and unrolled
    assert len(unrolled) == (2 if kind == "gpt" else 3)
    assert all(isinstance(u, fx.GraphModule) for u in unrolled)
    held = [len(st.params) for st, _ in whole]
    assert sum(t < h for t, h in zip(traced_params, held)) == len(unrolled)
    for (sa, ta), (sb, tb) in zip(short, whole):
        assert sa.params == sb.params
        assert _canonical(ta.gm) == _canonical(tb.gm)
        assert _layers(ta) == _layers(tb)
        assert [(p.name, p.shape, p.dtype, p.grad_output_index, p.tied_to) for p in ta.params] == \
            [(p.name, p.shape, p.dtype, p.grad_output_index, p.tied_to) for p in tb.params]
        assert (ta.loss_output_index, ta.num_outputs, ta.boundary_outputs,
                ta.boundary_grad_outputs) == (tb.loss_output_index, tb.num_outputs,
                                              tb.boundary_outputs, tb.boundary_grad_outputs)
        assert [(x.name, x.fingerprint) for x in ta.layers] == [(x.name, x.fingerprint) for x in tb.layers]


class _Block(nn.Module):
    def __init__(self, scale: int = 0) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(scale)) if scale else None

    def forward(self, x, bias=None):
        y = self.lin(x) if self.scale is None else self.lin(x) * self.scale
        return torch.tanh(y if bias is None else y + bias)


class _Blocks(nn.Module):
    """Five blocks after a linear input layer. ``case``: ``shared``, each adds one bias the model
    holds (its gradient is summed over the blocks); ``before_last``, the loss reads the block
    before the last too; ``tap``, the loss reads block 2 too; ``weight``, the loss reads the
    last block's weight too; ``scales``, blocks 0 and 1 scale by a weight of 8 values, the
    others by one of 1 (broadcast: the same ops and shapes)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(8 if case == "scales" and i < 2 else 1 if
                                           case == "scales" else 0) for i in range(5))
        self.bias = nn.Parameter(torch.zeros(8))
        self.inp, self.head = nn.Linear(8, 8), nn.Linear(8, 8)
        self.case = case

    def forward(self, x, y):
        outs, x = [], self.inp(x)  # (so the first block's input has a gradient, as the others')
        for b in self.blocks:
            x = b(x, self.bias if self.case == "shared" else None)
            outs.append(x)
        tap = {"before_last": -2, "tap": 2}.get(self.case)
        aux = self.head(outs[tap]).pow(2).mean() if tap is not None else 0.0
        if self.case == "weight":  # (a regulariser on a block's weight, outside the block)
            aux = self.blocks[-1].lin.weight.pow(2).sum()
        return (self.head(x) - y).pow(2).mean() + aux


@pytest.mark.parametrize("case", ["shared", "before_last", "tap", "weight", "scales", "plain"])
def test_blocks_the_copies_cannot_stand_for_are_traced_whole(case, monkeypatch):
    torch.manual_seed(0)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = _Blocks(case)
    inputs = (torch.randn(4, 8), torch.randn(4, 8))
    # pre + the five blocks | the head and the loss; "tap": pre + block 0 | blocks 1-4 | the
    # rest; "weight": pre + block 0 | blocks 1-4 and the rest (the weight read beside them)
    cut = {"tap": (0, 0, 1, 1, 1, 1, 2), "weight": (0, 0, 1, 1, 1, 1, 1)}.get(case, (0,) * 6 + (1,))
    short, whole, _, unrolled = _trace_both(model, inputs, cut, None, monkeypatch)
    if case in ("plain", "scales"):  # ("scales": blocks 2-4 alike, copied with their own shape)
        assert len(unrolled) == 1 and isinstance(unrolled[0], fx.GraphModule)
    elif case == "shared":  # traced short, refused (the bias's gradient sums over the blocks)
        assert len(unrolled) == 1 and isinstance(unrolled[0], str), unrolled
    else:  # the loss reads a block of the run but the last, or a weight of one left out: no
        # short copy at all
        assert unrolled == []
    for (_, ta), (_, tb) in zip(short, whole):
        assert _canonical(ta.gm) == _canonical(tb.gm)
        assert [(p.name, p.shape) for p in ta.params] == [(p.name, p.shape) for p in tb.params]


def test_a_fake_models_pipeline_plan_is_the_same_from_short_traces(monkeypatch):
    model, inputs = _fake_gpt(12)
    cfg = autopar.Config(pp=2, schedule="1f1b", microbatch_size=1)
    unrolled = []
    real = stages_mod.unroll_joint
    monkeypatch.setattr(stages_mod, "unroll_joint", lambda *a: unrolled.append(real(*a)) or unrolled[-1])
    pipeline._LAST_STAGES.clear()
    short = autopar.plan(model, FOUR, inputs, config=cfg)
    assert len(unrolled) == 2 and all(isinstance(u, fx.GraphModule) for u in unrolled)
    monkeypatch.setattr(stages_mod, "alike_run", lambda *a: [])
    pipeline._LAST_STAGES.clear()
    whole = autopar.plan(model, FOUR, inputs, config=cfg)
    pipeline._LAST_STAGES.clear()
    # (the copies' nodes are named otherwise: the stages' node tables agree by position)
    assert_same_pipeline_plan(short, whole, same_names=False)
