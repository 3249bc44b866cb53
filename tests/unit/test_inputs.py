"""Example inputs: real, fake of any FakeTensorMode, or meta, all capture the same graph.

- a fake model with inputs of another fake mode, or meta inputs, and a real model with fake or
  meta inputs trace exactly the graph a real model traces on real inputs of the same shapes,
  and plan on a virtual mesh (also pipelined, where the stages are traced again);
- a real model with real inputs is traced from them unchanged, and their values (token ids,
  ignore_index labels) change nothing in the graph;
- :func:`autopar.capture.to_fake` keeps metadata only, keeps one tensor given twice as one, and
  refuses what it cannot re-create.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

import autopar
from autopar.capture import capture, prepare_inputs, to_fake
from autopar.errors import InputMismatchError
from autopar.capture.stages import (capture_stages, capture_with_forward, first_microbatch,
                                    microbatch_inputs, unflatten_inputs)
from models import GPT

SIZE = dict(vocab=128, dim=32, heads=2, layers=2, seq=16)
BATCH = 4
TWO = autopar.Mesh.virtual("a100-dgx", nodes=1, gpus_per_node=2)


def _real_model() -> GPT:
    torch.manual_seed(0)
    return GPT(**SIZE)


def _fake_model() -> GPT:
    with FakeTensorMode(allow_non_fake_inputs=True):
        return GPT(**SIZE)


def _real_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, 128, (BATCH, SIZE["seq"]), generator=g),
            torch.randint(0, 128, (BATCH, SIZE["seq"]), generator=g))


def _other_fake_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    with FakeTensorMode():  # a mode of its own, as a notebook cell makes
        return (torch.randint(0, 128, (BATCH, SIZE["seq"])),
                torch.randint(0, 128, (BATCH, SIZE["seq"])))


def _meta_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, 128, (BATCH, SIZE["seq"]), device="meta"),
            torch.empty(BATCH, SIZE["seq"], dtype=torch.long, device="meta"))


CASES = {
    "fake model, inputs of another fake mode": (_fake_model, _other_fake_inputs),
    "fake model, meta inputs": (_fake_model, _meta_inputs),
    "real model, fake inputs": (_real_model, _other_fake_inputs),
    "real model, meta inputs": (_real_model, _meta_inputs),
    "fake model, real inputs": (_fake_model, _real_inputs),
}


@pytest.fixture(scope="module")
def reference():
    """The graph of a real model traced on real inputs."""
    return capture(_real_model(), _real_inputs())


@pytest.fixture(scope="module")
def reference_plan():
    """The plan of a real model on real inputs."""
    return autopar.plan(_real_model(), TWO, _real_inputs())


@pytest.mark.parametrize("case", list(CASES))
def test_inputs_of_any_kind_capture_and_plan_the_real_graph(case, reference, reference_plan):
    make_model, make_inputs = CASES[case]
    model, inputs = make_model(), make_inputs()
    traced = capture(model, inputs)
    assert traced.fingerprint() == reference.fingerprint()
    assert len(traced.gm.graph.nodes) == len(reference.gm.graph.nodes)
    assert traced.gm.code == reference.gm.code
    assert traced.is_fake == (make_model is _fake_model)  # the model's, not the inputs'
    shapes = lambda t: [(i.shape, i.dtype) for i in t.inputs]  # noqa: E731
    assert shapes(traced) == shapes(reference)
    plan = autopar.plan(model, TWO, inputs)
    assert plan.digest() == reference_plan.digest()  # the same placements and collectives


def test_a_real_model_stays_real_after_planning_with_fake_inputs():
    model, ids = _real_model(), _real_inputs()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    loss = model(*ids)
    autopar.plan(model, TWO, _other_fake_inputs())
    assert not any(isinstance(p, FakeTensor) for p in model.parameters())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(model(*ids), loss)


def test_real_inputs_of_a_real_model_are_traced_as_given(reference):
    model, inputs = _real_model(), _real_inputs()
    args, kwargs, mode = prepare_inputs(model, inputs)
    assert mode is None and kwargs == {}
    assert all(a is b for a, b in zip(args, inputs))  # not copied: the runtime runs these
    # values never reach the graph: all-zero ids and all-ignored (-100) labels trace the same
    zeros = torch.zeros_like(inputs[0])
    ignored = torch.full_like(inputs[1], -100)
    assert capture(model, (zeros, ignored)).gm.code == reference.gm.code


def test_pipeline_stages_trace_the_same_from_any_inputs():
    def stage_prints(model, inputs):
        chunks, _ = microbatch_inputs(inputs, 2)
        _, fwd = capture_with_forward(model, tuple(chunks[0]))
        return [t.fingerprint() for _, t in capture_stages(fwd, (0, 0, 1, 1), chunks[0])]

    expected = stage_prints(_real_model(), _real_inputs())
    assert len(expected) == 2
    assert stage_prints(_fake_model(), _other_fake_inputs()) == expected
    assert stage_prints(_real_model(), _meta_inputs()) == expected


def test_to_fake_keeps_metadata_only():
    mode = FakeTensorMode()
    with mode:
        mine = torch.ones(3)
    real = torch.randn(4, 6).t()  # not contiguous
    weights = torch.randn(5, requires_grad=True)
    meta = torch.empty(2, 3, dtype=torch.bfloat16, device="meta")
    out = to_fake({"a": (real, real), "w": weights, "m": meta, "k": 7, "mine": mine}, mode)
    a0, a1 = out["a"]
    assert a0 is a1  # one tensor given twice stays one
    assert isinstance(a0, FakeTensor) and a0.fake_mode is mode
    assert (a0.shape, a0.stride(), a0.dtype) == (real.shape, real.stride(), real.dtype)
    assert out["w"].requires_grad and not a0.requires_grad
    assert out["m"].device == torch.device("cpu") and out["m"].dtype == torch.bfloat16
    assert out["k"] == 7 and out["mine"] is mine


def test_to_fake_refuses_a_tensor_subclass():
    class Tagged(torch.Tensor):
        pass

    with pytest.raises(InputMismatchError, match="Tagged of shape \\(2,\\).*plain tensors"):
        to_fake((torch.zeros(2).as_subclass(Tagged),), FakeTensorMode())


class _Batch(dict):
    """A dict subclass, as some data loaders return (pytree takes it for one leaf)."""


@pytest.mark.parametrize("form", ["tuple", "dict", "dict subclass", "tensor"])
def test_the_first_microbatch_is_the_first_chunk_of_the_split(form):
    ids, labels = torch.arange(24).reshape(6, 4), torch.arange(24).reshape(6, 4) + 100
    inputs = {"tuple": (ids, labels), "dict": {"input_ids": ids, "labels": labels},
              "dict subclass": _Batch(input_ids=ids, labels=labels), "tensor": ids}[form]
    chunks, _ = microbatch_inputs(inputs, 3)
    first, want = first_microbatch(inputs, 3), unflatten_inputs(inputs, chunks[0])
    assert type(first) is type(want)
    pairs = zip(first.values(), want.values()) if isinstance(want, dict) else (
        zip(first, want) if isinstance(want, tuple) else [(first, want)])
    for got, expected in pairs:
        assert got.shape[0] == 2 and torch.equal(got, expected)
    with pytest.raises(ValueError, match="must divide into 4 microbatches"):
        first_microbatch(inputs, 4)
