"""Capture: joint graph, layers and fingerprints, tied parameters, buffers, and capture errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import autopar
from autopar.capture import capture
from models import build


@pytest.fixture(scope="module")
def gpt_traced():
    model, inputs = build("gpt", layers=3)
    return model, capture(model, inputs)


def test_repeated_layers_share_a_fingerprint(gpt_traced):
    _, traced = gpt_traced
    blocks = [layer for layer in traced.layers if layer.name.startswith("blocks.")]
    assert [b.name for b in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert len({b.fingerprint for b in blocks}) == 1
    assert len({len(b.nodes) for b in blocks}) == 1
    outside = [layer for layer in traced.layers if layer.name == ""]
    assert outside and outside[0].fingerprint != blocks[0].fingerprint


def test_tied_parameters_and_gradients(gpt_traced):
    model, traced = gpt_traced
    assert traced.param("head.weight").tied_to == "wte.weight"
    assert traced.param("wte.weight").tied_to is None
    names = {p.name for p in traced.params}
    assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    assert all(p.grad_output_index is not None for p in traced.params)
    assert traced.loss_output_index == 0
    # tied weights counted once
    assert traced.num_parameters == sum(p.numel() for p in model.parameters())


def test_backward_nodes_are_in_layers(gpt_traced):
    _, traced = gpt_traced
    backward = [n for n in traced.gm.graph.nodes if n.meta.get("partitioner_tag") == "is_backward"
                and n.op == "call_function"]
    assert backward, "the graph must contain the backward"
    in_blocks = [n for n in backward if traced.node_layer[n.name].startswith("blocks.")]
    assert len(in_blocks) > len(backward) / 2


def test_hf_llama_buffers_are_captured():
    model, inputs = build("llama")
    traced = capture(model, inputs)
    assert traced.buffers, "the rotary embedding's inv_freq is a buffer the graph reads"
    assert all(b.name for b in traced.buffers)
    assert {layer.name for layer in traced.layers} >= {"model.layers.0", "model.layers.1"}


class _Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:  # data-dependent control flow
            return self.fc(x).sum()
        return (self.fc(x) * 2).sum()


def test_data_dependent_control_flow_is_a_capture_error():
    with pytest.raises(autopar.CaptureError) as err:
        capture(_Branchy(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "data-dependent" in msg and "test_capture.py" in msg and "if x.sum() > 0" in msg


def test_inputs_that_do_not_match_the_signature():
    model, (ids, tgt) = build("gpt")
    with pytest.raises(autopar.InputMismatchError, match="forward"):
        capture(model, (ids, tgt, tgt))
    with pytest.raises(autopar.InputMismatchError):
        capture(model, {"idx": ids, "wrong": tgt})
    with pytest.raises(autopar.InputMismatchError, match="example_inputs is required"):
        capture(model, None)


def test_meta_device_is_refused():
    with torch.device("meta"):
        model = nn.Linear(4, 4)
    with pytest.raises(autopar.CaptureError, match="FakeTensorMode"):
        capture(model, (torch.randn(2, 4),))


class _NotScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_non_scalar_loss_is_refused():
    with pytest.raises(autopar.CaptureError, match="scalar"):
        capture(_NotScalar(), (torch.randn(2, 4),))
