"""The static form of expert blocks that depend on the routing (autopar.capture.experts): the
same numbers as the model's own forward, captured whole, priced by their FLOPs. The
multi-process runs: tests/distributed/test_equivalence.py (JetMoE) and test_slow.py (DBRX)."""

from __future__ import annotations

import pytest
import torch

from autopar.capture import capture
from autopar.capture.experts import grouped_mm, static_expert_blocks
from autopar.cost_models.compute import flops_of_node
from models import build


def test_grouped_mm_and_its_gradients_match_autograd_of_the_loop():
    """Groups of 3, 0 (an expert the batch does not route to) and 4 rows; fp64 gradcheck."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 5, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(3, 5, 2, dtype=torch.float64, generator=g, requires_grad=True)
    ends = torch.tensor([3, 3, 7], dtype=torch.int32)
    want = torch.cat([x[:3] @ w[0], x[3:] @ w[2]])
    assert torch.equal(grouped_mm(x, w, ends), want)
    assert torch.autograd.gradcheck(lambda a, b: grouped_mm(a, b, ends), (x, w))
    assert flops_of_node(torch.ops.autopar.grouped_mm.default, (x, w, ends), {}, None) == 2 * 7 * 5 * 2


@pytest.mark.parametrize("kind", ["dbrx", "jetmoe"])
def test_static_expert_blocks_compute_what_the_model_does_and_capture_whole(kind):
    model, inputs = build(kind)
    before = {n: type(m).forward for n, m in model.named_modules()}
    own = model(**inputs).loss
    own.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with static_expert_blocks(model) as blocks:
        assert blocks, kind
        loss = model(**inputs).loss
        loss.backward()
    # (fp32 sums in another order: the tokens of each expert summed sorted, not in a loop)
    assert abs(loss.item() - own.item()) <= 1e-6 * abs(own.item())
    for n, p in model.named_parameters():
        if n in grads:
            assert torch.allclose(p.grad, grads[n], rtol=1e-4, atol=1e-6), n
    # restored: the model's own forward again, on every module
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert {n: type(m).forward for n, m in model.named_modules()} == before
    traced = capture(model, inputs)
    ops = [n.target for n in traced.gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.autopar.grouped_mm.default in ops and torch.ops.autopar.grouped_mm_backward.default in ops
