"""Resharding steps on hand cases and as a property; placement text; the strategy space."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from autopar._torch_private import older_than
from autopar.capture import capture
from autopar.mesh import planning_device_mesh
from autopar.placements import fmt, from_str, to_str
from autopar.strategies.reshard import reshard_steps
from autopar.strategies.space import build_space
from models import build

R, P = Replicate(), Partial("sum")
S0, S1 = Shard(0), Shard(1)
SHAPE = (8, 12)
FULL = 8 * 12 * 4  # bytes of the whole fp32 tensor


def _kinds(steps):
    return [(s.axis, s.kind) for s in steps]


# ---- reshard_steps: hand cases -----------------------------------------------------------------

def test_partial_to_replicate_is_one_all_reduce_of_the_local_size():
    steps = reshard_steps((P,), (R,), SHAPE, 4, (2,))
    assert _kinds(steps) == [(0, "all_reduce")]
    assert steps[0].nbytes == FULL  # a partial sum holds the full shape on every rank
    assert steps[0].after == (R,)
    # on a 2-D mesh with the other axis sharding dim 0, the local size is half
    steps = reshard_steps((S0, P), (S0, R), SHAPE, 4, (2, 2))
    assert _kinds(steps) == [(1, "all_reduce")] and steps[0].nbytes == FULL // 2


def test_shard_to_replicate_is_one_all_gather_of_the_full_size():
    for src in (S0, S1):
        steps = reshard_steps((src,), (R,), SHAPE, 4, (2,))
        assert _kinds(steps) == [(0, "all_gather")]
        assert steps[0].nbytes == FULL  # the all-gather's output
    steps = reshard_steps((_StridedShard(0, split_factor=3),), (R,), (6, 4), 2, (2,))
    assert _kinds(steps) == [(0, "all_gather")] and steps[0].nbytes == 6 * 4 * 2


def test_partial_to_shard_is_one_reduce_scatter():
    for dst in (S0, S1):
        steps = reshard_steps((P,), (dst,), SHAPE, 4, (2,))
        assert _kinds(steps) == [(0, "reduce_scatter")]
        assert steps[0].nbytes == FULL  # the reduce-scatter's input
        assert steps[0].after == (dst,)


def test_replicate_to_shard_is_local():
    for dst in (S0, S1, _StridedShard(0, split_factor=2)):
        steps = reshard_steps((R,), (dst,), SHAPE, 4, (2,))
        assert _kinds(steps) == [(0, "local")] and steps[0].nbytes == 0
    steps = reshard_steps((R, R), (S0, S1), SHAPE, 4, (2, 2))
    assert _kinds(steps) == [(0, "local"), (1, "local")]


def test_shard_to_other_shard_gathers_then_slices():
    steps = reshard_steps((S0,), (S1,), SHAPE, 4, (2,))
    assert _kinds(steps) == [(0, "all_gather"), (0, "local")]
    assert steps[-1].after == (S1,)


def test_nested_shards_unwind_the_inner_axis_first():
    steps = reshard_steps((S0, S0), (R, R), SHAPE, 4, (2, 2))
    assert _kinds(steps) == [(1, "all_gather"), (0, "all_gather")]
    assert steps[0].after == (S0, R) and steps[1].after == (R, R)
    # inner gather outputs a quarter gathered to a half; the outer a half gathered to the whole
    assert [s.nbytes for s in steps] == [FULL // 2, FULL]


def test_changing_the_outer_axis_unwinds_an_inner_shard_of_the_same_dim():
    # dim 0 is split by axis 0 then axis 1; moving axis 0 off dim 0 must first undo axis 1
    steps = reshard_steps((S0, S0), (S1, S0), SHAPE, 4, (2, 2))
    assert [(a, k) for a, k in _kinds(steps) if k != "local"] == [(1, "all_gather"), (0, "all_gather")]
    assert steps[-1].after == (S1, S0)


def test_partial_inner_axis_nests_inside_a_pending_outer_shard():
    # reduce-scattering axis 1 onto dim 0 first would put axis 1 outside axis 0 on that dim:
    # reduce fully, then slice locally, outer axis first
    steps = reshard_steps((R, P), (S0, S0), SHAPE, 4, (2, 2))
    assert _kinds(steps) == [(1, "all_reduce"), (0, "local"), (1, "local")]
    # with no outer shard pending, the reduce-scatter is used
    steps = reshard_steps((S1, P), (S1, S0), SHAPE, 4, (2, 2))
    assert _kinds(steps) == [(1, "reduce_scatter")]


def test_two_partial_axes():
    steps = reshard_steps((P, P), (R, R), SHAPE, 4, (2, 2))
    assert _kinds(steps) == [(1, "all_reduce"), (0, "all_reduce")]
    steps = reshard_steps((R, P), (R, R), SHAPE, 4, (2, 2))
    assert _kinds(steps) == [(1, "all_reduce")]


def test_identity_needs_no_steps():
    for p in [(R,), (S0,), (P,), (_StridedShard(0, split_factor=3),), (S0, S1), (P, S0)]:
        assert reshard_steps(p, p, (12, 12), 4, (2,) * len(p)) == []


# ---- reshard_steps: properties over every pair on a 2 x 2 mesh ---------------------------------

_OPTIONS = [R, S0, S1, P, _StridedShard(0, split_factor=2)]


def _local_numel(shape, placements, mesh):
    sizes = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, (Shard, _StridedShard)):
            sizes[p.dim] //= mesh[axis]
    n = 1
    for s in sizes:
        n *= s
    return n


@pytest.mark.parametrize("itemsize", [2, 4])
def test_reshard_steps_properties(itemsize):
    """Every (src, dst) pair of placements on a 2 x 2 mesh (625 pairs)."""
    pairs = list(itertools.product(itertools.product(_OPTIONS, repeat=2), repeat=2))
    assert len(pairs) == 625
    for src, dst in pairs:
        _check_steps(src, dst, itemsize)


def _check_steps(src, dst, itemsize):
    mesh = (2, 2)
    steps = reshard_steps(src, dst, SHAPE, itemsize, mesh)
    assert (steps == []) == (src == dst)
    cur = src
    seen_local = False
    comm_axes = []
    for s in steps:
        before = cur
        # a step changes its own axis only
        assert all(s.after[a] == before[a] for a in range(2) if a != s.axis), (src, dst, s)
        assert s.after[s.axis] != before[s.axis]
        if s.kind == "local":
            seen_local = True
            assert before[s.axis] == R and s.nbytes == 0  # only a replica can be sliced locally
        else:
            assert not seen_local, "collectives come before local slicing"
            comm_axes.append(s.axis)
            if s.kind == "all_gather":
                assert isinstance(before[s.axis], (Shard, _StridedShard)) and s.after[s.axis] == R
                assert s.nbytes == _local_numel(SHAPE, s.after, mesh) * itemsize
            else:
                assert before[s.axis] == P
                assert s.kind in ("all_reduce", "reduce_scatter")
                assert s.after[s.axis] == (R if s.kind == "all_reduce" else dst[s.axis])
                assert s.nbytes == _local_numel(SHAPE, before, mesh) * itemsize
        cur = s.after
    assert cur == dst
    assert comm_axes == sorted(comm_axes, reverse=True)  # inner axis first
    assert len(comm_axes) == len(set(comm_axes))  # at most one collective per axis
    # no collective on an axis that was replicated in the source
    assert all(src[a] != R for a in comm_axes)


# ---- placements text ---------------------------------------------------------------------------

@pytest.mark.parametrize("p, text", [
    (Replicate(), "R"), (Shard(0), "S(0)"), (Shard(3), "S(3)"), (Partial("sum"), "P(sum)"),
    (Partial("avg"), "P(avg)"), (_StridedShard(0, split_factor=3), "SS(0,3)"),
    (_StridedShard(2, split_factor=2), "SS(2,2)"),
])
def test_placement_text_round_trip(p, text):
    assert to_str(p) == text
    back = from_str(text)
    assert back == p and type(back) is type(p)


def test_placement_text_errors_and_fmt():
    for bad in ("", "S", "S(x)", "SS(0)", "Q(1)", "r"):
        with pytest.raises(ValueError):
            from_str(bad)
    assert fmt((Shard(0), Replicate())) == "[S(0), R]"
    assert fmt(None) == "-"
    assert type(from_str("S(0)")) is Shard  # a plain shard, not a strided one


# ---- the strategy space ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def traced():
    # awkward sizes so that even sharding is a real filter: vocab 130 = 2 x 65, seq 6 = 2 x 3
    model, inputs = build("gpt", vocab=130, seq=6, batch=2)
    return capture(model, inputs)


def _space(traced, shape, names, dp_axes=()):
    with planning_device_mesh(shape, names) as dm:
        return build_space(traced, dm, names, dp_axes)


def _options(space, traced, param):
    return [s.outputs[0] for s in space.nodes[traced.param(param).node].strategies]


def test_fused_qkv_gets_a_strided_shard(traced):
    space = _space(traced, (2,), ("tp",))
    qkv = _options(space, traced, "blocks.0.qkv.weight")
    assert (_StridedShard(0, split_factor=3),) in qkv
    assert (_StridedShard(0, split_factor=3),) in _options(space, traced, "blocks.0.qkv.bias")
    # only the fused projection gets it: fc1 (4*dim rows, no split after it) does not
    fc1 = _options(space, traced, "blocks.0.fc1.weight")
    assert not any(isinstance(p, _StridedShard) for pl in fc1 for p in pl)
    assert (Shard(0),) in fc1 and (Shard(1),) in fc1 and (Replicate(),) in fc1


def test_data_parallel_axis_replicates_params_and_splits_the_batch(traced):
    space = _space(traced, (2,), ("dp",), dp_axes=(0,))
    for p in traced.params:
        assert _options(space, traced, p.name) == [(Replicate(),)], p.name
    for i in traced.inputs:
        assert [s.outputs[0] for s in space.nodes[i.node].strategies] == [(Shard(0),)]
    # without the dp axis the same parameters may be sharded
    free = _space(traced, (2,), ("tp",))
    assert len(_options(free, traced, "blocks.0.fc1.weight")) > 1


def _evenly(shape, placements, mesh):
    sizes = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, _StridedShard):
            if sizes[p.dim] % (mesh[axis] * p.split_factor):
                return False
            sizes[p.dim] //= mesh[axis]
        elif isinstance(p, Shard):
            if sizes[p.dim] % mesh[axis]:
                return False
            sizes[p.dim] //= mesh[axis]
    return True


def _shapes(traced, name):
    val = traced.node(name).meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else [val]
    return [tuple(v.shape) if isinstance(v, torch.Tensor) else None for v in vals]


@pytest.mark.parametrize("mesh", [(2,), (2, 2)])
def test_every_strategy_shards_evenly(traced, mesh):
    names = ("a", "b")[: len(mesh)]
    space = _space(traced, mesh, names)
    checked = sharded = 0
    for name, ns in space.nodes.items():
        out_shapes = _shapes(traced, name)
        for s in ns.strategies:
            for pl, shape in zip(s.outputs, out_shapes):
                if pl is not None and shape is not None:
                    assert _evenly(shape, pl, mesh), (name, shape, fmt(pl))
                    checked += 1
                    sharded += any(isinstance(p, Shard) for p in pl)
            assert len(s.inputs) == len(ns.inputs)
            for pl, (src, idx) in zip(s.inputs, ns.inputs):
                shape = _shapes(traced, src)[idx]
                assert _evenly(shape, pl, mesh), (name, src, shape, fmt(pl))
    assert checked > 1000 and sharded > 100  # the space is not trivially replicated
    if mesh == (2, 2):
        wte = _options(space, traced, "wte.weight")  # [130, 64]: 130 splits in 2, not in 4
        assert (Shard(0), Replicate()) in wte and (Shard(1), Shard(1)) in wte
        assert (Shard(0), Shard(0)) not in wte


def test_fused_qkv_is_strided_over_tp_while_the_batch_is_sharded_over_dp():
    # On a (dp, tp) mesh the fused QKV projection must be able to take its weight strided over
    # tp (q, k and v rows on each rank, head-aligned) with its input batch-sharded over dp: the
    # Megatron layout under data parallelism. Before, only a replicated or strided input paired
    # with the strided weight, so every dp x tp plan gathered q, k and v.
    model, inputs = build("gpt", layers=2, batch=4, dim=64, heads=4)
    traced = capture(model, inputs)
    with planning_device_mesh((2, 2), ("dp", "tp")) as dm:
        space = build_space(traced, dm, ("dp", "tp"), (0,), "replicate")
    qkv = next(p for p in traced.params if p.name == "blocks.1.qkv.weight")
    linear = next(u for t in traced.node(qkv.node).users for u in t.users
                  if str(u.target).startswith("aten.addmm"))
    pairs = {tuple(map(to_str, pl)) for s in space.nodes[linear.name].strategies
             for pl in [s.inputs[1]] if any("SS" in to_str(p) for p in s.inputs[2])}
    assert ("S(0)", "R") in pairs, pairs


class _WritesIntoABuffer(torch.nn.Module):
    """DeepSeek-V3's attention in small: a key preallocated with ``new_empty`` and written in
    two parts (functionalization makes ``aten.copy`` and ``slice_scatter`` of the writes)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 6)
        self.b = torch.nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = self.a(x), self.b(x)
        key = a.new_empty(*a.shape[:-1], 8)
        key[..., :6] = a
        key[..., 6:] = b
        return key.sum()


def test_functional_copy_splits_as_a_pointwise_op():
    # aten.copy (self, src) had no rule (DTensor registers only the in-place copy_): every copy
    # was replicated on every axis, and with it the values around it (DeepSeek-V3's keys on a
    # (dp, tp) mesh: computed whole on each dp rank)
    traced = capture(_WritesIntoABuffer(), (torch.randn(4, 4, 8),))
    copies = [n for n in traced.gm.graph.nodes if n.target == torch.ops.aten.copy.default]
    assert copies
    space = _space(traced, (2, 2), ("dp", "tp"), dp_axes=(0,))
    for n in copies:
        ns = space.nodes[n.name]
        assert ns.source == "dtensor", ns.source  # (not the replicating fallback)
        options = {(s.outputs[0], s.inputs[0], s.inputs[1]) for s in ns.strategies}
        both = (Shard(0), Shard(1))
        assert (both, both, both) in options


@pytest.mark.skipif(older_than("2.13"),
                    reason="autopar's new_* rule is registered on torch 2.13 and later only")
def test_new_empty_splits_on_the_dims_it_shares_with_its_input():
    # DTensor's rule for Tensor.new_* replicates the output unless it has the input's whole
    # shape: DeepSeek-V3's key, made by new_empty with a longer head dim than its input, was
    # whole on every axis, and with it the writes into it and the projection before them (on
    # its (dp, ep, tp) stage mesh every rank computed the whole microbatch's kv_b_proj)
    traced = capture(_WritesIntoABuffer(), (torch.randn(4, 4, 8),))
    [new] = [n for n in traced.gm.graph.nodes if n.target == torch.ops.aten.new_empty.default]
    space = _space(traced, (2, 2), ("dp", "tp"), dp_axes=(0,))
    options = {(s.outputs[0], s.inputs[0]) for s in space.nodes[new.name].strategies}
    both = (Shard(0), Shard(1))
    assert (both, both) in options  # split where the input is split, nothing moved
    # the last dim (6 in, 8 out) is not shared: never split there
    assert not any(Shard(2) in out for out, _ in options)
    # whole, from an input in any placement (its values are not read: no gather priced)
    assert {inp for out, inp in options if out == (Replicate(), Replicate())} >= {
        (Shard(0), Shard(1)), (Replicate(), Replicate()), (Shard(0), Replicate())}


def test_spaces_built_and_priced_after_others_equal_fresh_ones():
    # The setup search builds and prices one space per microbatch size and submesh in one
    # process, sharing DTensor's enumerations (strategies.space) and the priced arrays
    # (price_space's memo) between them: a space built and priced after another, for another
    # batch, must equal one built and priced cold, array for array.
    import numpy as np

    import autopar
    from autopar.planning.candidates import Candidate
    from autopar.planning.solve import priced_space
    from autopar.strategies.space import clear_enumerations

    mesh = autopar.Mesh.virtual("h100-dgx", nodes=1, gpus_per_node=4)
    # (tp=4 splits a batch of 4 evenly, not one of 2: the spaces differ where shapes differ)
    cand = Candidate((4,), ("tp",), ())
    small, large = (capture(*build("gpt", layers=2, batch=b, dim=64, heads=4)) for b in (2, 4))

    def priced(traced, memo):
        return priced_space(traced, mesh, autopar.Config(), cand, (), price_memo=memo)

    clear_enumerations()
    cold_space, cold = priced(large, None)
    clear_enumerations()
    memo: dict = {}
    first, _ = priced(small, memo)
    warm_space, warm = priced(large, memo)
    shared = {id(ns.strategies) for ns in first.nodes.values()}
    reused = [n for n, ns in warm_space.nodes.items()
              if id(ns.strategies) in shared and ns.source.startswith("dtensor")]
    assert reused, "no enumeration was shared: the test checks nothing"
    assert cold_space.nodes.keys() == warm_space.nodes.keys()
    for name, ns in cold_space.nodes.items():
        assert ns.strategies == warm_space.nodes[name].strategies, name
    for kind in ("compute", "memory", "edges"):
        a, b = getattr(cold, kind), getattr(warm, kind)
        assert a.keys() == b.keys(), kind
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=f"{kind} {key}")


def test_pinned_identical_layers_share_their_prices_and_keep_their_values():
    # Pinning gives each node a tuple of its own; share_equal_strategies gives the nodes that
    # were one enumeration and still list the same strategies one tuple again, so that
    # price_space prices a stage's identical layers once (DeepSeek-V3's 30-layer stage: 207 s
    # of pricing). Priced shared and unshared, every array must be equal, and fewer distinct
    # tuples must be priced.
    import numpy as np

    import autopar
    from autopar.cost_models.sharding import price_space
    from autopar.planning.candidates import Candidate
    from autopar.planning.solve import balanced_axis, priced_space

    mesh = autopar.Mesh.virtual("h100-dgx", nodes=1, gpus_per_node=8)
    traced = capture(*build("gpt", layers=4, batch=4, dim=64, heads=4))
    cand = Candidate((2, 2, 2), ("dp", "cp", "tp"), (0,), cp_axes=(1,))
    config = autopar.Config(sequence_parallel=True)
    space, shared = priced_space(traced, mesh, config, cand, ())
    own = dataclasses.replace(space, nodes={n: dataclasses.replace(ns, strategies=tuple(ns.strategies))
                                            for n, ns in space.nodes.items()})
    unshared = price_space(traced, own, mesh.topology, config.optimizer,
                           balanced_axis=balanced_axis(traced, config, cand))
    distinct = len({id(ns.strategies) for ns in space.nodes.values()})
    assert distinct < len(space.nodes) // 2, (distinct, len(space.nodes))
    for name in space.nodes:
        assert np.array_equal(shared.compute[name], unshared.compute[name]), name
        assert np.array_equal(shared.memory[name], unshared.memory[name]), name
    for key, m in shared.edges.items():
        assert np.array_equal(m, unshared.edges[key]), key


# ---- what makes enumeration and pricing cheaper keeps their answers ----------------------------

def test_is_kind_answers_as_isinstance():
    """``placements.is_kind`` caches ``isinstance`` by type; a strided shard is not a shard."""
    from autopar.placements import is_kind

    kinds = (Shard, _StridedShard, Replicate, Partial, (Shard, _StridedShard))
    for p in (S0, Shard(2), _StridedShard(0, split_factor=2), R, P, Partial("avg")):
        for cls in kinds:
            assert is_kind(p, cls) is isinstance(p, cls), (p, cls)
    assert not is_kind(_StridedShard(1, split_factor=3), Shard)


def test_no_redistribute_costs_replaces_dtensors_cost_rows_and_restores_them():
    """Inside ``no_redistribute_costs`` every DTensor rule module that imported
    ``generate_redistribute_costs`` gets a zero per source strategy; after, its own again."""
    import sys

    import torch.distributed.tensor._ops.utils as op_utils
    from autopar._torch_private import DTensorSpec, OpSpec, OpStrategy, no_redistribute_costs

    real = op_utils.generate_redistribute_costs
    holders = [m for n, m in sys.modules.items() if n.startswith("torch.distributed.tensor.")
               and getattr(m, "generate_redistribute_costs", None) is real]
    assert len(holders) >= 3  # (utils and the rule modules that import it by name)
    with planning_device_mesh((2, 2), ("a", "b")) as dm:
        strategy = OpStrategy([OpSpec(DTensorSpec(dm, (p, q))) for p in (R, S0) for q in (R, S1)])
        dst = DTensorSpec(dm, (R, R))
        with no_redistribute_costs():
            assert all(m.generate_redistribute_costs is not real for m in holders)
            assert op_utils.generate_redistribute_costs(strategy, dst) == [0.0] * 4
        assert all(m.generate_redistribute_costs is real for m in holders)


def test_edge_matrices_are_priced_pair_by_pair_and_kept_per_topology():
    """An edge's matrix equals each pair's own resharding price, and is kept by its
    placements, shape, element size, mesh and topology: the same lists again give the same
    prices; another topology (other links), mesh or dtype its own."""
    from autopar.cost_models.reshard_prices import edge_matrix, reshard_time
    from autopar.cost_models.topology import custom, get_preset
    from autopar.strategies.space import Strategy

    mesh = (2, 4)
    outs = [(R, R), (S0, R), (R, S1), (P, R), (S0, S1)]
    ins = [(R, R), (R, S1), (S0, R)]
    src = [Strategy((o,), ()) for o in outs + outs[:2]]  # (repeated placements: one price each)
    dst = [Strategy((None,), (i,)) for i in ins]
    val = torch.empty(64, 32)
    base = get_preset("a100-dgx")
    slow = custom("slow-links", base=base, intra_node=dataclasses.replace(
        base.intra_node, bandwidth_Bps=base.intra_node.bandwidth_Bps / 100))
    seen = []
    cases = [(get_preset("a100-dgx"), mesh, val), (slow, mesh, val), (get_preset("a100-dgx"), mesh, val),
             (get_preset("a100-dgx"), (4, 2), val), (get_preset("a100-dgx"), mesh, val.bfloat16())]
    for topo, m, v in cases:
        got = edge_matrix(src, 0, dst, 0, v, m, topo)
        want = [[reshard_time(s.outputs[0], t.inputs[0], (64, 32), v.element_size(), m, topo)
                 for t in dst] for s in src]
        assert got.tolist() == want
        seen.append(got.tolist())
    assert seen[0] == seen[2] and seen[1] != seen[0] and seen[3] != seen[0] and seen[4] != seen[0]


def test_the_kept_edge_matrices_stay_within_their_bytes(monkeypatch):
    """The edge matrices kept for the process hold at most ``_MATRICES_BYTES``, the oldest
    dropped first, their count of bytes exact; a dropped one is priced again, the same."""
    import autopar.cost_models.reshard_prices as rp
    from autopar.cost_models.topology import get_preset
    from autopar.strategies.space import Strategy

    monkeypatch.setattr(rp, "_MATRICES", {})
    monkeypatch.setattr(rp, "_matrices_held", 0)
    monkeypatch.setattr(rp, "_MATRICES_BYTES", 1000)  # (room for 5 of these 2 x 12 matrices)
    topo, mesh = get_preset("a100-dgx"), (2, 4)
    src = [Strategy(((R, R),), ()), Strategy(((S0, R),), ())]
    dst = [Strategy((None,), ((a, b),)) for a in (R, S0, S1, P) for b in (R, S0, S1)]
    first = rp.edge_matrix(src, 0, dst, 0, torch.empty(16, 8), mesh, topo)
    for rows in range(17, 40):
        rp.edge_matrix(src, 0, dst, 0, torch.empty(rows, 8), mesh, topo)
        assert rp._matrices_held == sum(m.nbytes for _, m in rp._MATRICES.values()) <= 1000
    assert len(rp._MATRICES) == 5 and not any(k[2] == (16, 8) for k in rp._MATRICES)
    assert rp.edge_matrix(src, 0, dst, 0, torch.empty(16, 8), mesh, topo).tolist() == first.tolist()
