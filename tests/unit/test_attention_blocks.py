"""Context parallelism with CUDA's attention kernels: their sharding rules, the blocks the
gathered form runs them in, how those are priced, and the blocks' arithmetic (on the CPU
kernel here; on a GPU's kernels by ``benchmarks/gpu_check.py --parts cp_kernels``; the
kernels end to end on CPU processes: ``tests/distributed/test_equivalence.py``, CONTEXT)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar._torch_private import TensorMeta
from autopar.cost_models.attention import AttentionCall, gathered_calls, gathered_seconds
from autopar.cost_models.topology import custom, get_preset
from autopar.passes.cp_simulation import simulate, whole
from autopar.sequence_layout import SequenceLayout, query_runs
from autopar.strategies.rules import (CUDNN_ATTENTION, CUDNN_ATTENTION_BACKWARD,
                                      EFFICIENT_ATTENTION, EFFICIENT_ATTENTION_BACKWARD,
                                      FLASH_ATTENTION, FLASH_ATTENTION_BACKWARD, rule_for)

S2, R, P = Shard(2), Replicate(), Partial()


def _meta(seq: int = 64, dtype: torch.dtype = torch.bfloat16) -> TensorMeta:
    shape = (2, 4, seq, 16)
    return TensorMeta(torch.Size(shape), (4 * seq * 16, seq * 16, 16, 1), dtype)


def _rules(op, args) -> list[list]:
    return rule_for(op).fn(tuple(args), {})


def _sequence_forms(rules: list[list], query: int) -> list[list]:
    """The rules that split the queries on the sequence (their index among the placements)."""
    return [r for r in rules if r[query] == S2]


def test_query_runs_follow_the_balanced_chunk_pairs():
    """16 positions over 2 ranks in chunk pairs of 4: rank 0 holds chunks 0 and 3 (two runs),
    rank 1 chunks 1 and 2, which are neighbours (one run); contiguous: one run each."""
    layout = SequenceLayout(0, 2)
    assert query_runs(16, 0, 8, layout) == [(0, 0, 4), (4, 12, 4)]
    assert query_runs(16, 8, 8, layout) == [(0, 4, 8)]
    assert query_runs(16, 8, 8) == [(0, 8, 8)]
    # every position once, over all ranks of cp=4
    layout = SequenceLayout(0, 4)
    seen = sorted(p + i for r in range(4) for _, p, c in query_runs(32, 8 * r, 8, layout)
                  for i in range(c))
    assert seen == list(range(32))


def test_the_gathered_calls_skip_the_keys_after_each_query():
    """Causal: each run against the keys before it unmasked and against its own positions
    with the kernel's mask (square: every kernel aligns it alike); not causal: one call."""
    runs = query_runs(16, 0, 8, SequenceLayout(0, 2))
    assert gathered_calls(runs, True, 16) == [
        (slice(0, 4), slice(0, 4), True),
        (slice(4, 8), slice(0, 12), False), (slice(4, 8), slice(12, 16), True)]
    assert gathered_calls(runs, False, 16) == [(slice(0, 8), slice(0, 16), False)]


@pytest.mark.parametrize("kernel,ranks,form,causal,balanced",
                         list(itertools.product(("cpu", "cudnn", "flash", "efficient"), (2, 4),
                                                ("ring", "gather"), (True, False),
                                                (True, False))))
def test_cp_ranks_in_blocks_equal_the_kernel_on_the_whole_sequence(kernel, ranks, form, causal,
                                                                   balanced):
    """The code the cp ranks run (both forms, both layouts), simulated for 2 and 4 ranks in
    threads, with CPU's kernel and with the CUDA ops as ``cuda_kernels_on_cpu`` runs them on
    the CPU (their log-sum-exp shapes and padding, cuDNN's lengths, causal masks on square
    blocks only): output, log-sum-exp and the three gradients equal the kernel run once on the
    whole sequence. Tolerance 1e-5 (fp32): the blocks merge in float32, a few roundings of 6e-8
    relative on values of order 1 (measured: 1.4e-6 at most). The GPU's kernels:
    ``benchmarks/gpu_check.py --parts cp_kernels``."""
    import cuda_kernels_on_cpu  # noqa: F401  (the CUDA ops on the CPU)

    torch.manual_seed(0)
    q, k, v, grad = (torch.randn(2, 3, 32, 8) for _ in range(4))
    got = simulate(kernel, q, k, v, grad, ranks, form, causal, balanced)
    want = whole(kernel, q, k, v, grad, causal)
    for field in ("out", "lse", "dq", "dk", "dv"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), atol=1e-5,
                                   rtol=1e-5, msg=field)


def test_the_blocks_depend_on_where_the_rank_s_queries_sit():
    """The check above can fail: rank 0's chunk pair (positions 0-7 and 24-31 of 32) attended
    as if it held positions 0-15 gives other rows for its second chunk."""
    from autopar.passes.attention_blocks import gathered_forward

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 8) for _ in range(3))
    mine = torch.cat([q[..., :8, :], q[..., 24:, :]], 2)
    right, _ = gathered_forward("cpu", mine, k, v, True, None, query_runs(32, 0, 16, SequenceLayout(0, 2)))
    wrong, _ = gathered_forward("cpu", mine, k, v, True, None, [(0, 0, 16)])
    torch.testing.assert_close(right[..., :8, :], wrong[..., :8, :])
    assert not torch.allclose(right[..., 8:, :], wrong[..., 8:, :], atol=1e-2)


@pytest.mark.parametrize("forward,backward,query", [
    (FLASH_ATTENTION, FLASH_ATTENTION_BACKWARD, 9),
    (EFFICIENT_ATTENTION, EFFICIENT_ATTENTION_BACKWARD, 4),
    (CUDNN_ATTENTION, CUDNN_ATTENTION_BACKWARD, 9)])
def test_cuda_kernels_offer_both_sequence_forms_and_never_a_local_one(forward, backward, query):
    """Each CUDA kernel's rule offers the gathered form (keys and values whole, their
    gradients partial) and the ring (all on the sequence), and no other split of the queries on
    the sequence: DTensor's own context-parallel rule (keys split, run as a plain call) would
    attend each rank's queries to its own keys only."""
    m = _meta()
    if forward is FLASH_ATTENTION:
        args = [m, m, m, 0.0, True]
    else:
        args = [m, m, m, None, True, 0.0, True]
    fwd = _sequence_forms(_rules(forward, args), query)
    assert [r[query + 1:query + 3] for r in fwd] == [[R, R], [S2, S2]]
    n_out = 4 if forward is EFFICIENT_ATTENTION else 3
    if backward is FLASH_ATTENTION_BACKWARD:
        bargs = [m, m, m, m, m, _meta(), None, None, 64, 64, 0.0, True, m, m]
    elif backward is EFFICIENT_ATTENTION_BACKWARD:
        bargs = [m, m, m, m, None, m, _meta(), m, m, 0.0, [True] * 4, True]
    else:
        bargs = [m, m, m, m, m, _meta(), m, m, None, None, None, 64, 64, 0.0, True]
    bwd = _sequence_forms(_rules(backward, bargs), n_out + 1)
    assert len(bwd) == 2
    gathered, ring = bwd
    assert gathered[1:3] == [P, P] and gathered[n_out + 2:n_out + 4] == [R, R]
    assert set(ring[:3]) == {S2} and ring[n_out + 2:n_out + 4] == [S2, S2]


def test_the_sequence_forms_need_no_dropout_no_bias_and_an_aligned_log_sum_exp():
    m = _meta()
    assert not _sequence_forms(_rules(FLASH_ATTENTION, [m, m, m, 0.1, True]), 9)  # dropout
    assert not _sequence_forms(_rules(CUDNN_ATTENTION, [m, m, m, m, True, 0.0, True]), 9)  # bias
    short = _meta(48)  # the efficient kernel pads its log-sum-exp to 32 rows: 48 is not whole
    assert not _sequence_forms(_rules(EFFICIENT_ATTENTION, [short] * 3 + [None, True, 0.0, True]), 4)
    assert _sequence_forms(_rules(EFFICIENT_ATTENTION, [m] * 3 + [None, True, 0.0, True]), 4)


def _linear(call: AttentionCall, flops: float) -> float:
    return flops / 1e15  # a kernel priced by its FLOPs alone, to count what the blocks compute


def test_the_gathered_blocks_are_priced_at_the_scores_they_compute():
    """cp=4, 8,192 keys, balanced: rank 0 holds chunks 0 and 7 of 8 (1,024 positions each);
    its calls compute 1024 x 1024 (chunk 0's diagonal) + 1024 x 7168 (chunk 7 against the keys
    before it) + 1024 x 1024 (its diagonal) scores, 9/16 of its 2048 x 8192 (a diagonal block
    counted whole here: the kernel's price halves it). Contiguous, the last rank (positions
    6,144-8,191) computes 2048 x 6144 + 2048 x 2048: all of them. With memory free, the price
    is those FLOPs (a kernel priced by its FLOPs alone)."""
    topo = custom("fast-memory", base="h100-dgx", mem_bandwidth_Bps=1e30)
    call = AttentionCall("fwd", True, 2048, 8192, 128)
    flops = 4.0 * 2048 * 8192 * 128
    balanced = gathered_seconds(call, flops, 1, 2, True, topo, _linear, rank=0)
    assert balanced == pytest.approx(flops * 9 / 16 / 1e15)
    # rank 3 holds chunks 3 and 4, one run: 2048 x 3072 + its 2048 x 2048 diagonal counted
    # whole, 10/16: the slowest by this count, which the price takes without a rank
    assert gathered_seconds(call, flops, 1, 2, True, topo, _linear) == pytest.approx(
        flops * 10 / 16 / 1e15)
    last = gathered_seconds(call, flops, 1, 2, False, topo, _linear)
    assert last == pytest.approx(flops / 1e15)
    # the blocks' own memory traffic: with the preset's bandwidth it costs more than nothing
    assert gathered_seconds(call, flops, 1, 2, True, get_preset("h100-dgx"), _linear,
                            rank=0) > balanced


def test_the_gathered_form_is_priced_as_one_call_where_it_runs_as_one():
    """Not causal, as many queries as keys, or a CPU topology (CPU's kernel takes a mask and
    runs once): no block price."""
    topo = get_preset("h100-dgx")
    assert gathered_seconds(AttentionCall("fwd", False, 2048, 8192, 128), 1.0, 1, 2, True, topo,
                            _linear) is None
    assert gathered_seconds(AttentionCall("fwd", True, 8192, 8192, 128), 1.0, 1, 2, True, topo,
                            _linear) is None
    assert gathered_seconds(AttentionCall("fwd", True, 2048, 8192, 128), 1.0, 1, 2, True,
                            get_preset("cpu-gloo"), _linear) is None
