"""The balanced layout of the sequence over cp (autopar.sequence_layout) and the ring's steps
under it (passes.ring_attention.RingStep): which positions a rank holds, that its causal work is
the same as every other rank's, and that the ring computes every causal (query, key) pair of a
rank exactly once. The equivalence checks with processes: tests/distributed/test_equivalence.py
(CONTEXT, every cp check runs this layout unless it says cp_layout=contiguous)."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

import autopar
from autopar._torch_private import _StridedShard
from autopar.passes.ring_attention import RingStep
from autopar.sequence_layout import SequenceLayout
from models import build


def _held(layout: SequenceLayout, length: int, rank: int) -> list[int]:
    """The natural positions rank ``rank`` holds of a dim of ``length`` split on cp."""
    size = length // layout.ranks
    return layout.positions(length, rank * size, size).tolist()


@pytest.mark.parametrize("n", [2, 3, 4])
def test_rank_r_holds_chunks_r_and_2n_minus_1_minus_r_in_ascending_order(n):
    layout, length = SequenceLayout(axis=0, ranks=n), 8 * n
    chunk = length // (2 * n)
    for r in range(n):
        want = list(range(r * chunk, (r + 1) * chunk)) + \
            list(range((2 * n - 1 - r) * chunk, (2 * n - r) * chunk))
        assert _held(layout, length, r) == want


def test_an_arranged_input_split_contiguously_gives_each_rank_its_pair():
    """The runtime arranges a whole input, DTensor splits it into contiguous blocks: each
    block holds the values at the rank's positions."""
    layout = SequenceLayout(axis=1, ranks=2)
    x = torch.arange(3 * 16).reshape(3, 16)  # value = 16 * row + position
    arranged = layout.arrange_input(x, (Replicate(), Shard(1)))
    for r, block in enumerate(arranged.chunk(2, 1)):
        assert torch.equal(block, x[:, _held(layout, 16, r)])
    # not split on the cp axis: left as it is
    assert layout.arrange_input(x, (Shard(1), Replicate())) is x


def test_a_strided_split_is_arranged_part_by_part():
    """``_StridedShard(d, k)`` (a concatenation of k values split on d) arranges each part."""
    layout = SequenceLayout(axis=0, ranks=2)
    x = torch.arange(32)
    arranged = layout.arrange_input(x, (_StridedShard(0, split_factor=2),))
    part = layout.arrange_input(torch.arange(16), (Shard(0),))
    assert torch.equal(arranged, torch.cat([part, part + 16]))


def test_a_dim_that_does_not_divide_into_the_chunks_is_refused_with_the_fix():
    layout = SequenceLayout(axis=0, ranks=2)
    with pytest.raises(NotImplementedError, match="2 x cp = 4 chunks.*cp_layout='contiguous'"):
        layout.follows(Shard(0), (6,))
    assert not layout.follows(Replicate(), (6,))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_the_causal_work_is_the_same_on_every_rank_and_not_with_contiguous_blocks(n):
    """Query position p attends to p + 1 keys: the pairs sum to the same total on every rank
    with the chunk pairs; with contiguous blocks the last rank has 2n - 1 times the first's."""
    layout, length = SequenceLayout(axis=0, ranks=n), 16 * n
    work = [sum(p + 1 for p in _held(layout, length, r)) for r in range(n)]
    assert len(set(work)) == 1
    size = length // n
    contiguous = [sum(p + 1 for p in range(r * size, (r + 1) * size)) for r in range(n)]
    assert contiguous[-1] / contiguous[0] == pytest.approx(2 * n - 1, rel=0.1)


def _ring_pairs(n: int, me: int, length: int, balanced: bool) -> tuple[list[tuple], list[int]]:
    """The (query, key) natural positions rank ``me``'s ring computes under a causal mask, and
    the kernel's pairs per step (a step with the kernel's causal mask counts its lower half)."""
    layout, size = SequenceLayout(axis=0, ranks=n), length // n
    pos = (lambda r: _held(layout, length, r)) if balanced else \
        (lambda r: list(range(r * size, (r + 1) * size)))
    pairs, work = [], []
    for t in range(n):
        src = (me - t) % n
        step = RingStep(src, me, n, size, True, balanced)
        if step.rows is None:
            work.append(0)
            continue
        queries, keys = pos(me)[step.rows], pos(src)[step.keys]
        done = [(q, k) for i, q in enumerate(queries) for j, k in enumerate(keys)
                if not step.causal or j <= i]
        pairs += done
        work.append(len(done))
    return pairs, work


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("balanced", [True, False])
def test_the_ring_computes_each_causal_pair_of_a_rank_once(n, balanced):
    """Every (query, key) pair with key <= query of the rank's queries, each once, and no
    other: the steps' slices and the kernel's own mask on the diagonal are the causal mask."""
    length = 8 * n
    layout, size = SequenceLayout(axis=0, ranks=n), length // n
    for me in range(n):
        pairs, _ = _ring_pairs(n, me, length, balanced)
        queries = _held(layout, length, me) if balanced else range(me * size, (me + 1) * size)
        want = sorted((q, k) for q in queries for k in range(q + 1))
        assert sorted(pairs) == want


@pytest.mark.parametrize("n", [2, 4])
def test_every_step_of_the_balanced_ring_computes_half_a_block(n):
    """Balanced: each of the n steps of each rank computes half a block (the diagonal's half
    plus its own diagonal row), so the ring's time is n half blocks; contiguous: the last rank
    computes n - 1/2 blocks, the first half a block."""
    length = 8 * n
    size = length // n
    half = size * size // 2
    for me in range(n):
        _, work = _ring_pairs(n, me, length, True)
        assert work[0] == half + size // 2  # (the kernel's causal diagonal keeps its own row)
        assert work[1:] == [half] * (n - 1)
    _, last = _ring_pairs(n, n - 1, length, False)
    assert sum(last) == (n - 1) * size * size + half + size // 2


def test_the_plan_holds_the_sequence_in_pairs_where_it_divides():
    """``cp_layout`` in the plan: balanced by default where 2 x cp divides the sequence,
    contiguous when asked, or where it does not divide; asking balanced there is an error."""
    model, inputs = build("gpt", dim=32, heads=4, layers=1, batch=1, seq=64)
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=1, gpus_per_node=2)
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(cp=2))
    assert plan.techniques["cp_layout"] == "balanced"
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(cp=2, cp_layout="contiguous"))
    assert plan.techniques["cp_layout"] == "contiguous"
    model, inputs = build("gpt", dim=32, heads=4, layers=1, batch=1, seq=62)
    plan = autopar.plan(model, mesh, inputs, config=autopar.Config(cp=2))
    assert plan.techniques["cp_layout"] == "contiguous"
    with pytest.raises(autopar.PlanError, match="2 x cp = 4 chunks"):
        autopar.plan(model, mesh, inputs, config=autopar.Config(cp=2, cp_layout="balanced"))
    with pytest.raises(ValueError, match="Config.cp_layout='pairs'"):
        autopar.Config(cp_layout="pairs")


class _TwoInputs(torch.nn.Module):
    """Token ids ``[b, 64]`` and a second input ``[b, 6]`` whose dim 1 is not the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.proj = torch.nn.Embedding(32, 16), torch.nn.Linear(16, 32)
        self.extra = torch.nn.Linear(6, 16)

    def forward(self, ids: torch.Tensor, extra: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids) + self.extra(extra).unsqueeze(1)).pow(2).mean()


def test_a_plan_splitting_on_cp_a_dim_that_does_not_divide_falls_back_to_contiguous():
    """The planner splits every input's dim 1 over cp; a ``[2, 6]`` input's does not cut into
    2 x cp = 4 chunks, which the runtime could not arrange: the plan holds the sequence in
    contiguous blocks, and asking for the pairs names the value."""
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=1, gpus_per_node=2)
    inputs = (torch.randint(0, 32, (2, 64)), torch.randn(2, 6))
    plan = autopar.plan(_TwoInputs(), mesh, inputs, config=autopar.Config(cp=2))
    assert plan.inputs[1] == ("S(1)",), plan.inputs
    assert plan.techniques["cp_layout"] == "contiguous"
    with pytest.raises(autopar.PlanError, match=r"shape \(2, 6\), planned S\(1\) on cp"):
        autopar.plan(_TwoInputs(), mesh, inputs,
                     config=autopar.Config(cp=2, cp_layout="balanced"))
