"""A deep model's forward graph unrolled from a short copy's export (autopar.capture.unroll):
checked node for node against exporting the whole model, run on real weights, through the
stage traces and a whole fake model's plan, and refused where the blocks differ."""

from __future__ import annotations

import functools

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from torch._subclasses.fake_tensor import FakeTensorMode

import autopar
from autopar.capture import stages as stages_mod
from autopar.capture.joint import LossModule, export_program, prepare_inputs
from autopar.capture.layers import attribute, module_paths, with_blocks
from autopar.capture.stages import capture_stages, export_forward, microbatch_inputs
from autopar.capture.unroll import attribute_refusal, unroll_blocks
from autopar.planning import pipeline
from models import GPT, hf_moe
from plan_equality import assert_same_pipeline_plan

FOUR = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=4)


def _gpt(layers: int = 6):
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (4, 16))
    return GPT(vocab=64, dim=32, heads=2, layers=layers, seq=16), (ids, ids)


def _deepseek(layers: int = 6):
    # one dense first layer, then MoE layers with a shared expert (leading_blocks = 1)
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    return hf_moe("deepseekv3", layers=layers, seq=16), {"input_ids": ids, "labels": ids}


def _canonical(gm: fx.GraphModule) -> list[tuple]:
    """Every call, in order, with its arguments by position (a parameter by name, a constant or
    a region's body by value), output shape and module paths: what two exports must share."""
    out, index = [], {}

    def ref(a: fx.Node):
        if a.op == "get_attr":
            value = attribute(gm, a.target)
            if isinstance(value, fx.GraphModule):
                return ("body", value.code)
            if "lifted_tensor" in a.target:  # (a constant: its own name in each export)
                return ("constant", tuple(value.shape), value.dtype, value.flatten().tolist())
            return ("attr", a.target)
        return ("input", a.name) if a.op == "placeholder" else ("node", index[a.name])

    for n in gm.graph.nodes:
        if n.op in ("call_function", "output"):
            v = n.meta.get("val")
            index[n.name] = len(out)
            out.append((n.op, str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), ref)),
                        tuple(v.shape) if isinstance(v, torch.Tensor) else None,
                        tuple(module_paths(n))))
    return out


def _call(gm, inputs):
    return gm(**inputs) if isinstance(inputs, dict) else gm(*inputs)


@pytest.mark.parametrize("kind", ["gpt", "deepseekv3"])
def test_the_unrolled_graph_is_the_whole_export_node_for_node(kind, monkeypatch):
    model, inputs = _gpt() if kind == "gpt" else _deepseek()
    whole = export_forward(model, inputs, unroll=False)
    exported = []  # the blocks each export saw: the unrolled one must export a short copy
    real = stages_mod.export_program

    def counting(wrapper, args, kwargs):
        exported.append(len(wrapper.model.get_submodule(whole.units[1].rsplit(".", 1)[0])))
        return real(wrapper, args, kwargs)

    monkeypatch.setattr(stages_mod, "export_program", counting)
    unrolled = export_forward(model, inputs, unroll=True)
    lead = 0 if kind == "gpt" else 1
    assert exported == [lead + 2]
    assert unrolled.units == whole.units and unrolled.canonical == whole.canonical
    assert _canonical(unrolled.gm) == _canonical(whole.gm)
    # its later blocks read their own weights: the loss on real weights is the same to the bit
    assert {n.target for n in unrolled.gm.graph.nodes if n.op == "get_attr"
            and "lifted_tensor" not in n.target} == \
        {n.target for n in whole.gm.graph.nodes if n.op == "get_attr" and "lifted_tensor" not in n.target}
    torch.testing.assert_close(_call(unrolled.gm, inputs), _call(whole.gm, inputs), rtol=0, atol=0)
    # and the unit of every node is the whole export's (by position)
    order = lambda f: [f.unit_of[n.name] for n in f.gm.graph.nodes if n.op == "call_function"]  # noqa: E731
    assert order(unrolled) == order(whole)


def test_stages_cut_from_the_unrolled_graph_trace_as_the_whole_exports():
    model, inputs = _deepseek(layers=7)
    chunks, _ = microbatch_inputs(inputs, 1)
    cut = (0, 0, 1, 1, 2, 2, 3, 3, 3)  # pre+dense | b1 b2 | b3 b4 | b5 b6+post
    a = capture_stages(export_forward(model, inputs, unroll=True), cut, chunks[0], copy_identical=False)
    b = capture_stages(export_forward(model, inputs, unroll=False), cut, chunks[0], copy_identical=False)
    for (sa, ta), (sb, tb) in zip(a, b):
        assert sa.params == sb.params and sa.user_inputs == sb.user_inputs
        assert [(n.op, str(n.target)) for n in ta.gm.graph.nodes] == \
            [(n.op, str(n.target)) for n in tb.gm.graph.nodes]
        assert ta.fingerprint() == tb.fingerprint()
        assert [(p.name, p.shape, p.tied_to) for p in ta.params] == \
            [(p.name, p.shape, p.tied_to) for p in tb.params]


class _Scaled(nn.Module):
    """A block scaled by its index: alike by structure and weights, not by what it computes."""

    def __init__(self, i: int) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = float(i + 1)

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale


class _Stack(nn.Module):
    def __init__(self, blocks: list[nn.Module], every: bool = False,
                 before_last: bool = False, each: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(8, 8)
        self.aux = nn.Linear(8, 8)
        self.every, self.before_last, self.each = every, before_last, each

    def forward(self, x, y):
        outs, aux = [], 0.0
        for b in self.blocks:
            x = b(x)
            outs.append(x)
            if self.each:  # (a module outside the blocks reading each one's output, in the loop)
                aux = aux + self.aux(x).pow(2).mean()
        # every: the head reads every block's output; before_last: a module after the blocks
        # reads the one before the last (in the short copy, the first: what the copies cannot see)
        h = self.head(torch.stack(outs).sum(0) if self.every else x)
        if self.before_last:
            h = h + self.aux(outs[-2])
        return (h - y).pow(2).mean() + aux


def _reason(model: nn.Module, inputs: tuple) -> str | None:
    args, kwargs, _ = prepare_inputs(model, inputs)
    short = with_blocks(model, "blocks", list(model.blocks)[:2])
    gm = stages_mod._module(export_program(LossModule(short), args, kwargs))
    before = [(n.op, str(n.target)) for n in gm.graph.nodes]
    why = unroll_blocks(gm, model, "blocks", 0, len(model.blocks))
    if why:  # (a refusal leaves the graph as it was)
        assert [(n.op, str(n.target)) for n in gm.graph.nodes] == before
    return why


@pytest.mark.parametrize("case", ["scaled", "every", "before_last", "each", "plain"])
def test_blocks_that_are_not_one_function_are_not_unrolled(case):
    torch.manual_seed(0)
    blocks = [_Scaled(i if case == "scaled" else 0) for i in range(5)]
    model = _Stack(blocks, every=case == "every", before_last=case == "before_last",
                   each=case == "each")
    inputs = (torch.randn(3, 8), torch.randn(3, 8))
    why = _reason(model, inputs)
    if case == "plain":  # (the same blocks, the loss on the last: unrolled)
        assert why is None
    else:
        assert why is not None, case
    # export_forward falls back to the whole export: the loss is the model's either way
    fwd = export_forward(model, inputs, unroll=True)
    torch.testing.assert_close(fwd.gm(*inputs), model(*inputs), rtol=0, atol=0)


def test_a_block_differing_beyond_the_exported_two_by_an_attribute_is_not_unrolled():
    # blocks 0 and 1 alike, block 3 scaled otherwise (a window on the last layers, say): the
    # exported two cannot show it; the blocks' plain attributes do
    torch.manual_seed(0)
    model = _Stack([_Scaled(3 if i == 3 else 0) for i in range(5)])
    inputs = (torch.randn(3, 8), torch.randn(3, 8))
    assert _reason(model, inputs) is None  # (the graph check alone would unroll it)
    why = attribute_refusal(list(model.blocks), 0)
    assert why is not None and "3.scale" in why
    fwd = export_forward(model, inputs, unroll=True)
    torch.testing.assert_close(fwd.gm(*inputs), model(*inputs), rtol=0, atol=0)
    # an attribute the exported two already differ in (a layer index) does not refuse
    for i, b in enumerate(model.blocks):
        b.scale, b.index = 1.0, i
    assert attribute_refusal(list(model.blocks), 0) is None


class _Indexed(_Stack):
    """Blocks in a Sequential called whole, or looped over by a count kept apart."""

    def __init__(self, sequential: bool) -> None:
        super().__init__([_Scaled(0) for _ in range(5)])
        self.sequential, self.n = sequential, 5
        if sequential:
            self.blocks = nn.Sequential(*self.blocks)

    def forward(self, x, y):
        if self.sequential:
            x = self.blocks(x)
        else:
            for i in range(self.n):
                x = self.blocks[i](x)
        return (self.head(x) - y).pow(2).mean()


@pytest.mark.parametrize("sequential", [True, False])
def test_a_short_copy_that_does_not_export_leaves_the_whole_export(sequential):
    # a Sequential stays one in the copy (unrolled); a count kept apart indexes past the
    # copy's blocks (IndexError while exporting it): the whole model is exported instead
    torch.manual_seed(0)
    model = _Indexed(sequential)
    inputs = (torch.randn(3, 8), torch.randn(3, 8))
    args, kwargs, fake = prepare_inputs(model, inputs)
    assert (stages_mod._unrolled(model, args, kwargs, fake) is not None) == sequential
    fwd = export_forward(model, inputs, unroll=True)
    torch.testing.assert_close(fwd.gm(*inputs), model(*inputs), rtol=0, atol=0)


def test_a_fake_models_pipeline_plan_is_the_same_unrolled(monkeypatch):
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = GPT(vocab=64, dim=32, heads=2, layers=8, seq=16)
    ids = torch.randint(0, 64, (4, 16))
    cfg = autopar.Config(pp=4, schedule="1f1b", microbatch_size=1)
    calls = []
    real, unrolling = pipeline.export_forward, stages_mod._unrolled

    def spy(*a, **k):
        calls.append(unrolling(*a, **k))
        return calls[-1]

    pipeline._LAST_STAGES.clear()
    monkeypatch.setattr(stages_mod, "_unrolled", spy)
    unrolled = autopar.plan(model, FOUR, (ids, ids), config=cfg)
    assert calls and calls[-1] is not None  # (the stages' forward graph was unrolled)
    pipeline._LAST_STAGES.clear()
    monkeypatch.setattr(pipeline, "export_forward", functools.partial(real, unroll=False))
    whole = autopar.plan(model, FOUR, (ids, ids), config=cfg)
    pipeline._LAST_STAGES.clear()
    assert_same_pipeline_plan(unrolled, whole)
