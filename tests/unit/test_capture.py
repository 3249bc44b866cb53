"""Capture: joint graph, layers and fingerprints, tied parameters, buffers, and capture errors."""

from __future__ import annotations

import inspect

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


def test_repeated_layers_share_a_fingerprint_and_size(gpt_traced):
    _, traced = gpt_traced
    blocks = [layer for layer in traced.layers if layer.name.startswith("blocks.")]
    assert [b.name for b in blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert len({b.fingerprint for b in blocks}) == 1
    assert len({len(b.nodes) for b in blocks}) == 1
    # forward and backward of a block: more than a handful of nodes each
    assert len(blocks[0].nodes) > 50
    # the code outside the blocks (embeddings, head, loss) is a different layer
    outside = [layer for layer in traced.layers if layer.name == ""]
    assert outside and outside[0].fingerprint != blocks[0].fingerprint
    # every node of the graph is in exactly one layer
    members = [n for layer in traced.layers for n in layer.nodes]
    assert len(members) == len(set(members))


def test_a_different_layer_gets_a_different_fingerprint():
    """The fingerprint reads shapes: a GPT whose blocks are wider fingerprints differently."""
    fp = lambda m, i: next(l.fingerprint for l in capture(m, i).layers if l.name == "blocks.0")  # noqa: E731
    small = dict(layers=2, seq=8, batch=2)
    assert fp(*build("gpt", dim=32, **small)) != fp(*build("gpt", dim=64, **small))


def test_tied_parameters_and_gradients(gpt_traced):
    model, traced = gpt_traced
    assert traced.param("head.weight").tied_to == "wte.weight"
    assert traced.param("wte.weight").tied_to is None
    assert all(p.tied_to is None for p in traced.params if p.name != "head.weight")
    names = {p.name for p in traced.params}
    assert names == {n for n, _ in model.named_parameters(remove_duplicate=False)}
    # every parameter placeholder has its own gradient output slot
    grads = [p.grad_output_index for p in traced.params]
    assert None not in grads and len(set(grads)) == len(grads)
    # every distinct parameter tensor gets exactly one computed gradient of its shape (a tied
    # pair's summed gradient is computed once: the other slot of the pair is None)
    out = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
    group = {p.name: p.tied_to or p.name for p in traced.params}
    computed: dict[str, int] = {}
    for p in traced.params:
        g = out[p.grad_output_index]
        if g is not None:
            assert tuple(g.meta["val"].shape) == p.shape, p.name
            computed[group[p.name]] = computed.get(group[p.name], 0) + 1
    assert computed == {name: 1 for name in set(group.values())}
    # tied weights counted once
    assert traced.num_parameters == sum(p.numel() for p in model.parameters())


def test_loss_output_index_is_the_scalar_loss(gpt_traced):
    _, traced = gpt_traced
    assert traced.loss_output_index is not None
    out = next(n for n in traced.gm.graph.nodes if n.op == "output").args[0]
    loss = out[traced.loss_output_index]
    assert loss.meta["val"].dim() == 0
    assert traced.loss_output_index not in {p.grad_output_index for p in traced.params}


def test_backward_nodes_are_in_layers(gpt_traced):
    _, traced = gpt_traced
    backward = [n for n in traced.gm.graph.nodes if n.meta.get("partitioner_tag") == "is_backward"
                and n.op == "call_function"]
    assert backward, "the graph must contain the backward"
    in_blocks = [n for n in backward if traced.node_layer[n.name].startswith("blocks.")]
    assert len(in_blocks) > len(backward) / 2


def test_hf_llama_rotary_buffer_is_captured():
    model, inputs = build("llama")
    traced = capture(model, inputs)
    names = {b.name for b in traced.buffers}
    buffers = {n for n, _ in model.named_buffers()}
    rotary = {n for n in buffers if "rotary" in n and n.endswith("inv_freq")}
    assert rotary, "the test model must have a rotary inv_freq buffer"
    assert rotary <= names
    for b in traced.buffers:
        assert traced.node(b.node).op == "placeholder"
        assert b.shape == tuple(dict(model.named_buffers())[b.name].shape)
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
    lines, first = inspect.getsourcelines(_Branchy.forward)
    line = first + next(i for i, text in enumerate(lines) if "if x.sum() > 0" in text)
    with pytest.raises(autopar.CaptureError) as err:
        capture(_Branchy(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "data-dependent" in msg
    assert f"test_capture.py:{line}" in msg, msg
    assert "torch.where" in msg or "torch.cond" in msg  # says how to fix it


class _Raises(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != 8:
            raise ValueError(f"expected 8 features, got {x.shape[-1]}")
        return self.fc(x).sum()


def test_an_error_of_the_model_itself_is_not_called_untraceable():
    """A model whose own code raises on the example inputs (a user error, not a limit of the
    tracer) is told so, with its line, and not advised to rewrite its branches."""
    lines, first = inspect.getsourcelines(_Raises.forward)
    line = first + next(i for i, text in enumerate(lines) if "raise ValueError" in text)
    with pytest.raises(autopar.CaptureError) as err:
        capture(_Raises(), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "ValueError at" in msg and f"test_capture.py:{line}" in msg, msg
    assert "expected 8 features, got 4" in msg and "torch.cond" not in msg, msg
    assert isinstance(err.value.__cause__, ValueError)
    # an operator's own check on these shapes likewise (raised inside torch)
    with pytest.raises(autopar.CaptureError) as err:
        capture(nn.Sequential(nn.Linear(8, 4)), (torch.randn(2, 4),))
    msg = str(err.value)
    assert "RuntimeError" in msg and "runs on these inputs" in msg and "torch.cond" not in msg, msg


def test_inputs_that_do_not_match_the_signature():
    model, (ids, tgt) = build("gpt")
    with pytest.raises(autopar.InputMismatchError, match="too many positional"):
        capture(model, (ids, tgt, tgt))
    with pytest.raises(autopar.InputMismatchError, match="'wrong'"):
        capture(model, {"idx": ids, "targets": tgt, "wrong": tgt})
    with pytest.raises(autopar.InputMismatchError, match="targets"):
        capture(model, (ids,))
    with pytest.raises(autopar.InputMismatchError, match="example_inputs is required"):
        capture(model, None)
    # matching keyword inputs are accepted
    traced = capture(model, {"idx": ids, "targets": tgt})
    assert len(traced.inputs) == 2


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x).sum()


def test_meta_device_is_refused():
    capture(_Scalar(), (torch.randn(2, 4),))  # the same model on the CPU is fine
    with torch.device("meta"):
        model = _Scalar()
    with pytest.raises(autopar.CaptureError, match="FakeTensorMode"):
        capture(model, (torch.randn(2, 4),))


class _NotScalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_non_scalar_loss_is_refused():
    with pytest.raises(autopar.CaptureError, match="scalar") as err:
        capture(_NotScalar(), (torch.randn(2, 4),))
    assert "(2, 4)" in str(err.value)  # names the shape it got


def test_a_mean_loss_is_captured_as_a_sum_over_the_total_weight():
    """capture.joint.split_mean_losses: the same loss (to the last bit here), as a sum and a
    total weight that a sharded plan reduces before dividing; sharded over the tokens, the
    average of the shards' means would be wrong when they count different numbers of targets
    (Hugging Face's ignored last position)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autopar.capture.joint import split_mean_losses

    def loss(x, t):
        return torch.ops.aten.nll_loss_forward(x, t, None, 1, -100)[0]

    x = torch.randn(7, 5).log_softmax(-1)
    t = torch.tensor([0, 4, -100, 2, 1, -100, 3])
    gm = make_fx(loss)(x, t)
    split_mean_losses(gm)
    reductions = [n.args[3] for n in gm.graph.nodes if n.target is torch.ops.aten.nll_loss_forward.default]
    assert reductions == [2]
    assert torch.equal(gm(x, t), loss(x, t))
    # why: the two halves hold 2 and 3 counted targets; their means' average is another number
    halves = [(x[:3], t[:3]), (x[3:], t[3:])]
    average = sum(loss(a, b) for a, b in halves) / 2
    sums = [torch.ops.aten.nll_loss_forward(a, b, None, 2, -100) for a, b in halves]
    exact = sum(s for s, _ in sums) / sum(w for _, w in sums)
    assert torch.allclose(exact, loss(x, t)) and not torch.allclose(average, loss(x, t))
