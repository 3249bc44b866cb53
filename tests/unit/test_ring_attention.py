"""Ring attention, the second form of context parallelism: its strategy, what it sends, how
it is priced and how the planner chooses between it and the gathered keys and values (the
equivalence checks with processes: tests/distributed/test_equivalence.py, CONTEXT)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar.cost_models.comm import send_recv_time
from autopar.cost_models.ring import ring_axis, ring_exchanges, ring_seconds, ring_workspace_bytes
from autopar.cost_models.topology import get_preset
from autopar.strategies.rules import CPU_ATTENTION, CPU_ATTENTION_BACKWARD
from models import build

_FWD, _BWD = CPU_ATTENTION, CPU_ATTENTION_BACKWARD
S2, R = Shard(2), Replicate()


def _plan(seq: int, form: str | None, topo: str = "a100-dgx", **config) -> autopar.Plan:
    small = seq <= 64
    model, inputs = build("gpt", dim=64 if small else 256, heads=4, layers=2,
                          batch=4 if small else 1, seq=seq)
    devices = config.get("tp", 1) * 2
    mesh = autopar.Mesh.virtual(topo, nodes=1, gpus_per_node=devices)
    return autopar.plan(model, mesh, inputs, config=autopar.Config(cp=2, cp_attention=form, **config))


def test_the_ring_form_shards_queries_keys_and_values_and_lists_its_sends():
    """cp=2, the ring asked for: every tensor of attention and of its backward sharded
    on the sequence over cp (the keys and values never gathered), and per layer one exchange
    of the stacked keys and values in the forward, and in the backward one of them and two of
    their float32 gradients (the last bringing them home), each a send and a receive."""
    plan = _plan(64, "ring")
    assert plan.axis_names == ("cp",) and plan.techniques["cp_attention"] == "ring"
    attention = [n for n in plan.nodes if n.startswith("_scaled_dot_product_flash_attention_for_cpu")]
    assert len(attention) == 4
    for n in attention:
        assert {p[0] for p in plan.nodes[n].inputs} == {"S(2)"}, plan.nodes[n]
        assert {p[0] for p in plan.nodes[n].outputs if p} == {"S(2)"}, plan.nodes[n]
    # keys [batch 4, heads 4, seq 64, head 16] fp32: a rank's block is [4, 4, 32 (cp), 16]
    block = 4 * 4 * 32 * 16
    sends = [c for c in plan.collectives if c.kind == "send"]
    forward = sorted(c.bytes for c in sends if c.phase == "forward")
    backward = sorted(c.bytes for c in sends if c.phase == "backward")
    assert forward == [2 * block * 4] * 2
    assert backward == [2 * block * 4] * 6  # (fp32 model: the gradients' float32 is its dtype)
    assert plan.collective_counts()["recv"] == plan.collective_counts()["send"] == 8
    assert all(c.axis == "cp" for c in sends)


def test_the_gather_form_sends_nothing_point_to_point():
    plan = _plan(64, "gather")
    assert plan.techniques["cp_attention"] == "gather"
    assert "send" not in plan.collective_counts()


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_exchanges_per_rank(n):
    """Forward: n - 1 exchanges of the keys and values; backward: n - 1 of them and n of their
    gradients, for bf16 keys (the gradients travel in float32: twice the bytes)."""
    shapes = [(1, 8, 4096, 128)] * 3
    placements = [(S2,)] * 5
    fwd = ring_exchanges(_FWD, placements[:3], shapes, 2, (n,))
    block = 8 * (4096 // n) * 128
    assert fwd == [(k, 0, 2.0 * block * 2) for _ in range(n - 1) for k in ("send", "recv")]
    bwd = ring_exchanges(_BWD, [(S2,)] * 6, [(1, 8, 4096, 128)] * 6, 2, (n,))
    sizes = [b for k, _, b in bwd if k == "send"]
    assert sorted(sizes) == sorted([2.0 * block * 2] * (n - 1) + [2.0 * block * 4] * n)
    assert ring_exchanges(_FWD, [(S2,), (R,), (R,)], shapes, 2, (n,)) == []  # the gathered form


def test_ring_axis_is_the_keys_sequence_axis_and_one_at_most():
    assert ring_axis(_FWD, [(S2, Shard(1)), (S2, Shard(1)), (S2, Shard(1))]) == 0
    assert ring_axis(_BWD, [(R, S2)] * 6) == 1
    assert ring_axis(_FWD, [(S2, R), (R, R), (R, R)]) is None
    assert ring_axis(torch.ops.aten.mm.default, [(S2,), (S2,)]) is None
    with pytest.raises(ValueError, match="one axis"):
        ring_axis(_FWD, [(S2, S2)] * 3)


def test_ring_seconds_hide_the_exchange_behind_the_blocks_and_not_more():
    """With blocks longer than a send, a step costs a block: n blocks in all (and the last
    gradients' trip home in the backward); with blocks shorter, each step waits for its
    exchanges (Liu et al. 2023, sec. 3)."""
    topo = get_preset("h100-dgx")
    shapes, n = [(1, 8, 8192, 128)] * 3, 4
    kv = 2 * 8 * (8192 // n) * 128 * 2
    t_kv = send_recv_time(kv, topo.intra_node)
    slow = 10 * t_kv
    assert ring_seconds(_FWD, [(S2,)] * 3, shapes, 2, (n,), topo, slow) == pytest.approx(n * slow)
    fast = t_kv / 10
    assert ring_seconds(_FWD, [(S2,)] * 3, shapes, 2, (n,), topo, fast) == \
        pytest.approx(fast + (n - 1) * t_kv)
    t_dkv = send_recv_time(2 * kv, topo.intra_node)  # (float32 gradients of bf16 keys)
    # each of the n - 1 exchanges of keys and values, and the n of their gradients, waited for
    assert ring_seconds(_BWD, [(S2,)] * 6, [shapes[0]] * 6, 2, (n,), topo, fast) == \
        pytest.approx((n - 1) * t_kv + n * t_dkv)
    assert ring_seconds(_BWD, [(S2,)] * 6, [shapes[0]] * 6, 2, (n,), topo, slow) == \
        pytest.approx(n * slow + t_dkv)


def test_a_causal_ring_is_priced_at_its_last_rank_which_skips_nothing_but_half_a_block():
    """Causal: the last rank computes every block, its first (the diagonal) half, the first
    rank one half block; the node costs the last rank's n - 1/2 blocks."""
    topo = get_preset("h100-dgx")
    shapes, n = [(1, 8, 8192, 128)] * 3, 4
    slow = 10 * send_recv_time(2 * 8 * (8192 // n) * 128 * 2, topo.intra_node)
    assert ring_seconds(_FWD, [(S2,)] * 3, shapes, 2, (n,), topo, slow, causal=True) == \
        pytest.approx((n - 0.5) * slow)


def test_a_balanced_causal_ring_is_priced_at_half_a_block_a_step():
    """With the balanced chunk pairs every rank computes half a block at each of its n steps
    (tests/unit/test_sequence_layout.py counts them): n/2 blocks against the contiguous last
    rank's n - 1/2; without a causal mask the layout changes nothing."""
    topo = get_preset("h100-dgx")
    shapes, n = [(1, 8, 8192, 128)] * 3, 4
    slow = 10 * send_recv_time(2 * 8 * (8192 // n) * 128 * 2, topo.intra_node)
    args = (_FWD, [(S2,)] * 3, shapes, 2, (n,), topo, slow)
    assert ring_seconds(*args, causal=True, balanced=True) == pytest.approx(n * slow / 2)
    assert ring_seconds(*args, causal=False, balanced=True) == ring_seconds(*args)


def test_ring_workspace_counts_the_blocks_in_flight_and_the_float32_accumulators():
    """bf16 [1, 8, 4096, 128] over cp=4: a rank's block of keys is 1 MiB elements (2 MiB). The
    forward holds the stacked keys and values of the block it computes on and of the one
    arriving (2 x 4 MiB), the block's output (2 MiB) and the float32 output and log-sum-exp
    (4 MiB + 4 MiB / 128); the backward both blocks of keys and values, both of their float32
    gradients (2 x 8 MiB), the block's three gradients (2 + 4 MiB) and the float32 queries'
    gradient (4 MiB). The liveness walk holds them at the node's step only."""
    mib = 2 ** 20
    shapes = [(1, 8, 4096, 128)] * 3
    assert ring_workspace_bytes(_FWD, [(S2,)] * 3, shapes, 2, (4,)) == \
        pytest.approx(8 * mib + 2 * mib + 4 * mib * (1 + 1 / 128))
    assert ring_workspace_bytes(_BWD, [(S2,)] * 6, [shapes[0]] * 6, 2, (4,)) == \
        pytest.approx(8 * mib + 16 * mib + 2 * mib + 4 * mib + 4 * mib)
    assert ring_workspace_bytes(_FWD, [(S2,), (R,), (R,)], shapes, 2, (4,)) == 0.0


def test_the_planner_takes_the_cheaper_form_and_the_ring_at_long_sequences():
    """Left free (``cp_attention=None``), each attention gets the form the ILP prices cheaper:
    at 512 tokens the ring's per-step latency costs more than gathering the keys and values,
    at 4,096 the gather's exposed time (and its kernel's masked half) costs more than the ring's
    hidden exchanges (cp=2 on virtual H100s). The ILP's objective of the free plan is never
    above either form's asked for (its predicted step can be: the ILP does not see the
    overlap the step's walk prices)."""
    chosen = {}
    for seq in (512, 4096):
        plans = {form: _plan(seq, form, "h100-dgx") for form in ("gather", "ring", None)}
        steps = {form: p.predicted["step_time_s"] for form, p in plans.items()}
        ilp = {form: p.predicted["ilp_objective_s"] for form, p in plans.items()}
        assert ilp[None] <= min(ilp["gather"], ilp["ring"]) * (1 + 1e-6), ilp
        chosen[seq] = plans[None].techniques["cp_attention"]
        assert chosen[seq] == min(("gather", "ring"), key=steps.get), (seq, steps, chosen)
    assert chosen == {512: "gather", 4096: "ring"}


def test_cp_attention_must_be_a_form():
    with pytest.raises(ValueError, match="Config.cp_attention='rings'"):
        autopar.Config(cp_attention="rings")


def test_a_row_with_every_key_masked_gives_the_kernels_zeros_not_nan():
    """A padding mask that hides every key of a query row: the kernel gives that row output 0
    and log-sum-exp 0, and finite gradients. The ring (here one rank, no group: its own block
    only) keeps such a row out of its merge and must hand the kernel's values back, or its
    backward's exp(score - lse) is NaN for the whole block."""
    from autopar.passes.ring_attention import ring_attention, ring_attention_backward

    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(1, 2, 4, 8) for _ in range(4))
    mask = torch.zeros(1, 1, 4, 4)
    mask[..., 1, :] = float("-inf")  # query row 1 sees no key
    out, lse = _FWD(q, k, v, 0.0, False, attn_mask=mask)
    ring_out, ring_lse = ring_attention(q, k, v, False, None, mask, "", False, "cpu")
    assert torch.equal(ring_lse, lse) and torch.allclose(ring_out, out)
    want = _BWD(grad, q, k, v, out, lse, 0.0, False, attn_mask=mask)
    got = ring_attention_backward(grad, q, k, v, ring_out, ring_lse, False, None, mask, "", False,
                                  "cpu", [])
    for g, w in zip(got, want):
        assert torch.isfinite(g).all() and torch.allclose(g, w, atol=1e-6)


def test_a_recomputed_ring_holds_its_workspace_again_in_the_backward(monkeypatch):
    """With full recomputation the ring's forward runs again in the backward, which holds its
    blocks in flight and accumulators again there, among the backward's values. With that
    workspace made huge, the step's peak is where a recomputed copy runs, in the backward, and
    holds one workspace, not two (each is held while its op runs)."""
    from autopar.capture.layers import is_backward
    from autopar.capture.remat import recompute_nodes
    from autopar.cost_models import liveness
    from autopar.plan_context import context_of

    plan = _plan(64, "ring", recompute="full")
    traced = context_of(plan).traced
    huge = 1e12
    monkeypatch.setattr(liveness, "ring_workspace_bytes",
                        lambda target, *args: huge if target is _FWD else 0.0)
    mem = liveness.step_memory(traced, plan.mesh_shape, plan.nodes, plan.output_placements,
                               recompute=recompute_nodes(traced, "full"))
    assert is_backward(traced.node(mem.peak_node)), mem.peak_node
    assert huge < mem.peak_bytes < 2 * huge
