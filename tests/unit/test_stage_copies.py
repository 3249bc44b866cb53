"""A model that is never run traces each distinct pipeline stage once: the other stages of the
same program take its joint graph renamed (autopar.capture.stage_copies). Checked against
tracing every stage, field by field and through a whole plan."""

from __future__ import annotations

import functools

import pytest

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import autopar
from autopar.capture.stages import capture_stages, export_forward, microbatch_inputs
from autopar.planning import pipeline
from models import GPT, hf_moe
from plan_equality import assert_same_pipeline_plan

FOUR = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=4)


def _fake_gpt(layers: int = 6):
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = GPT(vocab=64, dim=32, heads=2, layers=layers, seq=16)
    ids = torch.randint(0, 64, (4, 16))
    return model, (ids, ids)


def _fields(traced):
    return dict(
        params=[(p.name, p.node, p.shape, p.dtype, p.grad_output_index, p.tied_to) for p in traced.params],
        buffers=traced.buffers, inputs=traced.inputs, node_layer=traced.node_layer,
        layers=[(lay.name, lay.nodes, lay.fingerprint) for lay in traced.layers],
        boundary=(traced.boundary_inputs, traced.boundary_outputs, traced.boundary_tangents,
                  traced.boundary_grad_outputs),
        nodes=[(n.name, n.op, str(n.target)) for n in traced.gm.graph.nodes],
        fingerprint=traced.fingerprint())


def _fake_deepseek():
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = hf_moe("deepseekv3", layers=5, seq=16)
    ids = torch.randint(0, 128, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("kind", ["gpt", "deepseekv3"])
def test_a_stage_repeating_an_earlier_one_is_its_trace_renamed(kind):
    # (DeepSeek-V3's router runs in an autocast region: a higher-order op whose body is hashed)
    model, inputs = _fake_gpt() if kind == "gpt" else _fake_deepseek()
    fwd = export_forward(model, inputs)
    chunks, _ = microbatch_inputs(inputs, 1)
    # pre+b0 | b1 b2 | b3 b4 | b5+post (GPT); pre+dense b0 | b1 | b2 | b3 b4+post (DeepSeek-V3):
    # stages 1 and 2 repeat
    cut = (0, 0, 1, 1, 2, 2, 3, 3) if kind == "gpt" else (0, 0, 1, 2, 3, 3, 3)
    copied = capture_stages(fwd, cut, chunks[0])
    traced = capture_stages(fwd, cut, chunks[0], copy_identical=False)
    # stage 2 was not traced: it shares stage 1's graph module (the others have their own)
    assert copied[2][1].gm is copied[1][1].gm
    assert len({id(t.gm) for _, t in copied}) == 3
    assert len({id(t.gm) for _, t in traced}) == 4
    for (_, a), (_, b) in zip(copied, traced):
        fa, fb = _fields(a), _fields(b)
        assert fa == fb, [k for k in fa if fa[k] != fb[k]]
    # its parameters are its own (those its forward program reads), not stage 1's
    assert {p.name for p in copied[2][1].params} == set(copied[2][0].params)


def test_a_stage_of_frozen_blocks_is_not_a_copy_of_one_that_trains():
    # the same program but for requires_grad: the frozen stage's joint graph has no gradients
    model, inputs = _fake_gpt()
    for name in ("blocks.1", "blocks.2"):
        model.get_submodule(name).requires_grad_(False)
    fwd = export_forward(model, inputs)
    chunks, _ = microbatch_inputs(inputs, 1)
    cut = (0, 0, 1, 1, 2, 2, 3, 3)  # stage 1 frozen (b1 b2), stage 2 trains (b3 b4)
    copied = capture_stages(fwd, cut, chunks[0])
    assert len({id(t.gm) for _, t in copied}) == 4
    assert all(p.grad_output_index is None for p in copied[1][1].params)
    assert all(p.grad_output_index is not None for p in copied[2][1].params)


def test_a_fake_models_pipeline_plan_is_the_same_with_copied_stages(monkeypatch):
    model, inputs = _fake_gpt(layers=8)
    cfg = autopar.Config(pp=4, schedule="1f1b", microbatch_size=1)
    pipeline._LAST_STAGES.clear()
    copied = autopar.plan(model, FOUR, inputs, config=cfg)
    pipeline._LAST_STAGES.clear()
    monkeypatch.setattr(pipeline, "capture_stages",
                        functools.partial(capture_stages, copy_identical=False))
    traced = autopar.plan(model, FOUR, inputs, config=cfg)
    pipeline._LAST_STAGES.clear()
    assert_same_pipeline_plan(copied, traced)
