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


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transformers_experts_are_priced_by_their_flops(dtype):
    """Mixtral's experts capture as one ``autopar::experts`` op per layer (capture.moe). Their FLOPs
    are priced (at zero, a search found a step of an 8x7B Mixtral on 64 H100s 3.4x faster than
    the plan it realized). transformers' own grouped matmuls, which experts with biases still
    run (``transformers::grouped_mm_fallback`` in fp32 under export), are priced by name."""
    model, inputs = build("mixtral")
    traced = capture(model.to(dtype), inputs)
    expert_flops, kinds = 0.0, set()
    for n in traced.gm.graph.nodes:
        if n.op == "call_function" and "experts" in str(n.target):
            kinds.add(str(n.target).split(".")[0])
            args = [a.meta["val"] if hasattr(a, "meta") else a for a in n.args]
            expert_flops += flops_of_node(n.target, args, {}, None)
    assert kinds == {"autopar"}, kinds
    # per layer: 4 sequences x 16 positions x top-2 rows through gate_up (64 -> 2 x 128) and
    # down (128 -> 64): 2 * 128 * (64 * 256 + 128 * 64) forward, twice that backward (the
    # model's FLOPs: the op's own re-run of the experts is priced as time, not counted here)
    per_layer = 2 * 128 * (64 * 256 + 128 * 64)
    assert expert_flops == 2 * 3 * per_layer
    x, w = torch.empty(10, 64), torch.empty(4, 64, 32)
    offs = torch.tensor([3, 5, 9, 10], dtype=torch.int32)
    op = torch.ops.transformers.grouped_mm_fallback.default
    assert flops_of_node(op, (x, w, offs), {}, None) == 2 * 10 * 64 * 32
