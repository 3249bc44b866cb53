"""The search's shortcuts change when it answers, not what: layer costs solved ahead by forked
workers (autopar.planning.ahead) and setups set aside by their memory floor
(step_price.memory_floor) give the same ranking as the search without them.

The model is a 4-layer GPT of 512 hidden on 4 nodes of 8 H100s, batch 64 x 512: its search
has four microbatch sizes (1 to 8 per replica), tp of 1 to 8, pipelines and ZeRO, and many setups
over memory (the budget is cut to 0.4 GiB so that the floor has work to do: 10 setups fit, 978
are priced over it, 123 set aside by the floor).
"""

from __future__ import annotations

import os
import warnings

import pytest

import autopar
import autopar.planning.search as search_mod
from autopar.cost_models.step_price import memory_floor
from autopar.model_presets import megatron_gpt
from autopar.planning.search import LayerSolver, layer_key, model_flops, search

_BUDGET = 0.4 * 2**30


def _problem():
    model, inputs = megatron_gpt(dict(hidden=512, layers=4, heads=8), batch=64, seq=512)
    mesh = autopar.Mesh.virtual("h100-dgx", nodes=4, gpus_per_node=8)
    return model, inputs, mesh, autopar.Config(memory_bytes=_BUDGET)


def _summary(result):
    rows = lambda cs: [(c.setup, c.step_time_s, c.rank_memory_bytes) for c in cs]  # noqa: E731
    return rows(result.ranked), rows(result.pruned), result.over_memory, result.layer_solves


@pytest.fixture(scope="module")
def alone():
    model, inputs, mesh, cfg = _problem()
    layers = LayerSolver(model, inputs, mesh, cfg, (), workers=0)
    return layers, search(model, inputs, mesh, cfg, layers=layers)


def test_workers_solving_ahead_change_nothing(alone, monkeypatch):
    _, expected = alone
    assert expected.timings["workers"] == 0
    model, inputs, mesh, cfg = _problem()
    # (this model traces in well under AHEAD_AFTER_S: workers are forced for the test)
    monkeypatch.setattr(search_mod, "AHEAD_AFTER_S", 0.0)
    search_mod._TRACES.clear()  # (so that the workers trace, not read the cache they inherit)
    layers = LayerSolver(model, inputs, mesh, cfg, (), workers=2)
    taken = []
    close = search_mod.AheadSolver.close
    monkeypatch.setattr(search_mod.AheadSolver, "close",
                        lambda self: (taken.append(self.delivered), close(self))[1])
    result = search(model, inputs, mesh, cfg, layers=layers)
    assert result.timings["workers"] == 2
    assert taken and taken[0] > 0  # the search used what the workers solved
    assert _summary(result) == _summary(expected)
    # the sizes the workers traced were not traced here again, and their FLOPs (the plan's
    # model_flops) are the ones counted on the traces here
    sizes = {c.setup.microbatch_size for c in expected.ranked + expected.pruned}
    assert len(layers.traces) < len(sizes)
    assert all(model_flops(layers, b) == model_flops(alone[0], b) for b in sizes)
    assert len(layers.traces) < len(sizes)


def test_a_worker_that_fails_is_reported_and_its_sizes_solved_by_the_search(monkeypatch):
    model, inputs, mesh, _ = _problem()
    cfg = autopar.Config(tp=1, memory_bytes=2**29)  # (the layer ILPs on one device: cheap)
    expected = search(model, inputs, mesh, cfg,
                      layers=LayerSolver(model, inputs, mesh, cfg, (), workers=0))
    monkeypatch.setattr(search_mod, "AHEAD_AFTER_S", 0.0)
    search_mod._TRACES.clear()
    parent, costs = os.getpid(), LayerSolver.costs

    def failing(self, *key, **kw):
        if os.getpid() != parent:
            raise RuntimeError("worker broke")
        return costs(self, *key, **kw)

    monkeypatch.setattr(LayerSolver, "costs", failing)
    layers = LayerSolver(model, inputs, mesh, cfg, (), workers=1)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = search(model, inputs, mesh, cfg, layers=layers)
    assert result.timings["workers"] == 1
    assert any("worker broke" in str(w.message) for w in seen)
    assert _summary(result) == _summary(expected)


def test_the_memory_floor_is_below_every_price_and_sets_setups_aside(alone):
    layers, result = alone
    assert result.over_memory > 0 and result.ranked
    topo = layers.mesh.topology
    every = [c for c in result.ranked + result.pruned]
    for c in every:
        floor = memory_floor(layers.costs(*layer_key(c.setup)), c.setup, topo)
        assert floor <= max(c.rank_memory_bytes) * (1 + 1e-12), c.setup.describe()
    # the setups set aside, priced: none fits, and the floor is below their price too
    priced = {c.setup for c in every}
    over = [s for s in _candidates(layers, autopar.Config(memory_bytes=_BUDGET))
            if s not in priced and memory_floor(layers.costs(*layer_key(s)), s, topo) > _BUDGET]
    assert result.bounded == 0 and len(over) == result.over_memory
    for s in over[::5]:
        c = layers.price(s, _BUDGET)
        assert not c.fits and max(c.rank_memory_bytes) >= memory_floor(
            layers.costs(*layer_key(s)), s, topo)


def test_nothing_fits_names_the_smallest_need_among_the_setups_set_aside():
    model, inputs, mesh, _ = _problem()
    cfg = autopar.Config(tp=1, memory_bytes=2**20)  # (every setup over its floor)
    with pytest.raises(autopar.InfeasibleMemoryError) as e:
        search(model, inputs, mesh, cfg)
    # every setup was priced for the error: the smallest need is the least of all of theirs
    layers = LayerSolver(model, inputs, mesh, cfg, (), workers=0)
    least = min(max(search_mod._price_either_split(layers, s, 2**20).rank_memory_bytes)
                for s in _candidates(layers, cfg))
    assert e.value.required_bytes == pytest.approx(least, rel=1e-12)


def _candidates(layers, cfg):
    """The setups the search prices (sequence parallelism only where it splits something)."""
    from autopar.planning.setups import candidate_setups

    return [s for s in candidate_setups(layers.mesh.size, layers.mesh.topology.gpus_per_node,
                                        layers.batch, layers.num_blocks, cfg, seq=layers.seq,
                                        experts=layers.num_experts)
            if not (s.sequence_parallel and not layers.shards_sequence(s.microbatch_size))]
